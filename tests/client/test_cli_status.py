"""``changebus status``: one screen of relays and bootstrap servers (real servers).

A relay (synthetic source) with a consumer that stopped part-way (it lags),
a bootstrap server following the relay, and a URL where nothing listens:
the text screen names the roles, the partition, the consumer with its lag
and the unreachable server (exit 1); ``--json`` is one object with the same
facts; without the dead URL the exit status is 0. The renderer copes with
fields missing (an older server) and fields it does not know (a newer one).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import pytest

from changebus.bootstrap import (
    BootstrapConfig,
    BootstrapServer,
    HttpConfig as BootstrapHttp,
    StoreConfig,
)
from changebus.client import Consumer, ConsumerConfig, MemoryCheckpointPersister
from changebus.client._status_render import ServerReport, render_text, report_json
from changebus.cluster import ClusterConfig, PartitionState, Registry, ZkSession
from changebus.relay import Relay
from changebus.schemas._cli import main
from waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(
        str(ROOT / s)
        for s in ("schemas", "cluster", "fetchers", "relay", "bootstrap", "client", "discovery")
    ),
}
MakeRelay = Callable[..., AbstractAsyncContextManager[Relay]]


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


async def status(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "changebus.schemas",
        "status",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=ENV,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def lag_behind(url: str, windows: int) -> None:
    """A consumer named "lagger" reads ``windows`` windows in small pulls, then stops."""
    config = ConsumerConfig(
        relays=(url,), client_id="lagger", follow=False, max_bytes=1024, start="earliest"
    )
    seen = 0
    async with Consumer(config, persister=MemoryCheckpointPersister()) as c:
        async for _ in c:
            seen += 1
            if seen >= windows:
                break


async def test_status_of_a_relay_a_bootstrap_server_and_a_dead_url(
    make_relay: MakeRelay, tmp_path: Path
) -> None:
    async with make_relay(max_windows=200) as relay:
        await lag_behind(relay.url, 20)
        boot_cfg = BootstrapConfig(
            relays=(relay.url,),
            data_dir=tmp_path / "boot",
            store=StoreConfig(kind="sqlite", path=tmp_path / "boot" / "b.db"),
            http=BootstrapHttp(port=0),
        )
        async with BootstrapServer(boot_cfg) as boot:
            worker = boot.service.workers
            await wait_until(
                lambda: "syn" in worker and worker["syn"].state == "streaming",
                30,
                "the bootstrap server's partition",
            )
            dead = dead_url()
            code, out, err = await status(relay.url, boot.url, dead)
            assert code == 1, out + err
            assert "Traceback" not in err
            lines = out.splitlines()
            assert lines[0].startswith("changebus status") and "1 not ready or unreachable" in out
            assert f"relay {relay.url}  ready" in lines
            assert f"bootstrap {boot.url}  ready" in lines
            assert any(ln.startswith(f"UNREACHABLE {dead}") for ln in lines)
            lagger = next(ln for ln in lines if "lagger" in ln).split()
            assert lagger[0] == "syn" and int(lagger[3].replace(",", "")) > 0  # LAG SCN
            assert any(ln.split()[:2] == ["syn", "finished"] for ln in lines)  # relay partition
            assert any(ln.split()[:2] == ["syn", "streaming"] for ln in lines)  # bootstrap's

            code, out, err = await status("--json", relay.url, boot.url, dead)
            assert code == 1, err
            doc = json.loads(out)
            assert doc["ok"] is False
            by_url = {s["url"]: s for s in doc["servers"]}
            assert by_url[relay.url]["role"] == "relay" and by_url[relay.url]["ready"] is True
            consumers = by_url[relay.url]["partitions"][0]["consumers"]
            lagging = [c for c in consumers if c["client"] == "lagger"]
            assert lagging and lagging[0]["lag_scn"] > 0
            assert by_url[boot.url]["role"] == "bootstrap"
            assert by_url[boot.url]["partitions"][0]["partition"] == "syn"
            assert by_url[dead]["reachable"] is False and by_url[dead]["error"]

            code, out, err = await status(relay.url, boot.url)
            assert code == 0, out + err
            assert "all ready" in out.splitlines()[0]

            # --watch: a JSON line per screen until Ctrl-C, which ends it with the last status
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "changebus.schemas", "status", "--json", "--watch", "0.2",
                relay.url, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                env=ENV,
            )  # fmt: skip
            assert proc.stdout is not None
            screens = [json.loads(await proc.stdout.readline()) for _ in range(2)]
            assert all(s["ok"] for s in screens) and screens[0]["time"] < screens[1]["time"]
            proc.send_signal(signal.SIGINT)
            _, err_bytes = await asyncio.wait_for(proc.communicate(), 30)
            assert proc.returncode == 0 and b"Traceback" not in err_bytes, err_bytes


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for args in ((), ("ftp://x",), ("--zookeeper", "127.0.0.1:1"), ("--watch", "0", "http://x")):
        code = main(["status", *args])
        out, err = capsys.readouterr()
        assert code == 2 and out == "" and err.startswith("changebus status:"), (args, err)


def test_the_screen_tolerates_missing_and_unknown_fields() -> None:
    reports = [
        ServerReport(
            url="http://r:1",
            role="relay",
            reachable=True,
            ready=False,
            readiness={"a": "retrying"},
            partitions=[
                {"name": "a"},  # an older server: almost nothing
                {
                    "name": "b",
                    "state": "streaming",
                    "min_scn": 5,
                    "max_scn": 9,
                    "newest_timestamp_ns": 1_000 * 10**9,
                    "fetcher": {"kind": "postgres", "slot": "s", "retained_wal_bytes": 3 << 20},
                    "source_lag_seconds": 1.5,
                    "something_new": {"x": 1},
                    "consumers": [{"scn": 7, "lag_scn": 2, "lag_seconds": 0.25, "extra": 1}],
                    "last_error": "it broke once",
                },
            ],
        ),
        ServerReport(
            url="http://b:2",
            role="bootstrap",
            reachable=True,
            ready=True,
            partitions=[{"partition": "b", "seed": {"state": "running", "jobs": [{"table": "t"}]}}],
        ),
    ]
    text = render_text(reports, now=1_010.0)
    assert "relay http://r:1  NOT READY (a=retrying)" in text
    assert "postgres: slot s, retains 3.0 MiB" in text
    assert "10 s" in text and "1.5 s" in text  # newest window's age, behind the source
    assert "(hidden)" in text and "0.2 s" in text  # a consumer id only admins see
    assert "! b: it broke once" in text
    assert "snapshot job b t" in text
    doc: dict[str, Any] = report_json(reports, 1_010.0)
    assert doc["servers"][0]["partitions"][1]["something_new"] == {"x": 1}
    assert doc["ok"] is False


@pytest.mark.zk
async def test_status_of_a_clusters_members(
    make_relay: MakeRelay, zk_hosts: str, zk_cluster: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--zookeeper/--cluster``: every member of the routing table, with its member id."""
    async with make_relay(max_windows=5) as relay:
        session = ZkSession(
            ClusterConfig(
                zookeeper=zk_hosts,
                name=zk_cluster,
                member_id="relay-7",
                advertised_url=relay.url,
                connect_timeout_s=10.0,
            )
        )
        await session.start()
        registry = Registry(session, "relay")
        try:
            await registry.start()
            registry.update({"syn": PartitionState("leader", 1)})
            await registry.flush()
            args = ["status", "--zookeeper", zk_hosts, "--cluster", zk_cluster, "--json"]
            code = await asyncio.to_thread(main, args)
        finally:
            await registry.stop()
            await session.stop()
    out = capsys.readouterr().out
    assert code == 0, out
    [server] = json.loads(out)["servers"]
    assert server["url"] == relay.url and server["member"] == "relay-7"
    assert server["role"] == "relay" and server["partitions"][0]["name"] == "syn"
