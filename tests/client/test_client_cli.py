"""``changebus tail`` as a subprocess against a relay running in the test's loop."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path

from changebus.relay import Relay
from changebus.schemas import Checkpoint

MakeRelay = Callable[..., AbstractAsyncContextManager[Relay]]
ROOT = Path(__file__).resolve().parents[2]
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(
        str(ROOT / s) for s in ("schemas", "cluster", "fetchers", "relay", "bootstrap", "client")
    ),
}
KEYS = {"scn", "seq", "op", "table", "key", "before", "after", "not_sent"}


async def tail(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "changebus.schemas",
        "tail",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=ENV,
    )


async def test_tail_prints_json_lines_and_keeps_a_checkpoint(
    make_relay: MakeRelay, tmp_path: Path
) -> None:
    ckpt = tmp_path / "tail.json"
    async with make_relay(max_windows=40) as relay:
        args = ("--relay", relay.url, "--partition", "syn", "--from", "earliest")
        proc = await tail(*args, "--limit", "30", "--checkpoint", str(ckpt))
        out, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0, err.decode()
        lines = [json.loads(line) for line in out.decode().splitlines()]
        assert len(lines) == 30 and all(set(line) == KEYS for line in lines)
        assert [(r["scn"], r["seq"]) for r in lines] == sorted((r["scn"], r["seq"]) for r in lines)
        assert lines[0]["scn"] == 1000 and lines[0]["op"] in ("insert", "update")
        assert lines[0]["after"]["id"] == lines[0]["key"]["id"]
        # the tenth window was yielded, not finished: the checkpoint is before it
        assert Checkpoint.parse(ckpt.read_text()).get("syn").window_scn == 1008
        # a second run continues from the file (the unfinished window again)
        proc = await tail(
            *args, "--limit", "3", "--checkpoint", str(ckpt), "--source", "synthetic.t0"
        )
        out, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0, err.decode()
        again = [json.loads(line) for line in out.decode().splitlines()]
        assert again[0]["scn"] == 1009 and {r["table"] for r in again} == {"synthetic.t0"}


async def test_tail_follows_live_and_stops_cleanly_on_ctrl_c(make_relay: MakeRelay) -> None:
    async with make_relay(max_windows=0, windows_per_s=100, wait=False) as relay:
        proc = await tail("--relay", relay.url)  # the only partition, from latest
        assert proc.stdout is not None
        first = json.loads(await asyncio.wait_for(proc.stdout.readline(), 20))
        assert set(first) == KEYS and first["scn"] >= 1000
        proc.send_signal(signal.SIGINT)
        out, err = await asyncio.wait_for(proc.communicate(), 20)
        assert proc.returncode == 0, err.decode()
        assert b"Traceback" not in err
        for line in out.decode().splitlines():
            assert set(json.loads(line)) == KEYS


async def test_tail_reports_bad_arguments() -> None:
    proc = await tail("--relay", "ftp://nowhere", "--from", "yesterday")
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2 and b"ftp://nowhere" in err and out == b""
