"""``changebus group status`` and the group flags of ``tail`` / ``replicate`` over a
group of real consumers.

The commands run as subprocesses against a real ZooKeeper (``fix_zk``) and a
real relay started in the test's loop; the group is made of ``Consumer``
instances with ``group=...`` in the test's loop, or of the ``tail`` and
``replicate`` commands themselves. Helpers in group_cli_support.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import time
from pathlib import Path

import pytest
from group_cli_support import MakeRelay, changebus, group_name, relay_head, status_json
from test_client_cli import ENV, KEYS

from changebus.client import Consumer, ConsumerConfig
from changebus.relay import Relay

pytestmark = pytest.mark.zk

# -- a group of real consumers ------------------------------------------------------------


def member_config(relay: Relay, zk_hosts: str, group: str, name: str) -> ConsumerConfig:
    return ConsumerConfig(
        relays=(relay.url,),
        partition="syn",
        zookeeper=zk_hosts,
        group=group,
        buckets=4,
        member_name=name,
        start="earliest",
        commit_interval_s=0.1,
        zookeeper_session_timeout_s=4.0,
        wait_s=0.3,
        backoff_initial_s=0.01,
        backoff_max_s=0.05,
    )


async def test_status_of_two_consumers_caught_up(zk_hosts: str, make_relay: MakeRelay) -> None:
    group = group_name()
    async with make_relay(max_windows=40) as relay:
        head = await relay_head(relay.url)
        consumers = [Consumer(member_config(relay, zk_hosts, group, n)) for n in ("a", "b")]
        delivered: dict[str, set[str]] = {"a": set(), "b": set()}

        async def read(name: str, consumer: Consumer) -> None:
            async for window in consumer:
                delivered[name].add(window.unit)

        tasks = [asyncio.create_task(read(n, c)) for n, c in zip("ab", consumers, strict=True)]
        try:
            deadline = time.monotonic() + 40
            while True:
                doc = await status_json(group, "--zookeeper", zk_hosts, "--relay", relay.url)
                units = doc["units"]
                if (
                    len(doc["members"]) == 2
                    and all(u["state"] == "ok" for u in units)
                    and all(u["lag_scn"] == 0 for u in units)
                ):
                    break
                assert time.monotonic() < deadline, doc
                await asyncio.sleep(0.3)
            ids = {c.stats()["member_id"]: name for name, c in zip("ab", consumers, strict=True)}
            assert {m["id"]: m["name"] for m in doc["members"]} == ids
            assert sorted(m["units"] for m in doc["members"]) == [2, 2]
            assert [u["unit"] for u in units] == ["syn.0", "syn.1", "syn.2", "syn.3"]
            for u in units:
                assert u["owner"] in ids and u["generation"] >= 1
                assert u["checkpoint_scn"] == head.max_scn and u["lag_s"] == 0.0
            # every unit was read (by its owner, or before a move by the member that had it)
            assert delivered["a"] | delivered["b"] == {u["unit"] for u in units}
        finally:
            for c in consumers:
                c.stop()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait_for(t, 10)
            for c in consumers:
                await c.close()


async def test_tail_in_a_group_prints_each_event_with_its_unit(
    zk_hosts: str, make_relay: MakeRelay, tmp_path: Path
) -> None:
    group = group_name()
    async with make_relay(max_windows=40) as relay:
        args = ("tail", "--relay", relay.url, "--partition", "syn", "--from", "earliest")
        grouped = ("--group", group, "--zookeeper", zk_hosts, "--buckets", "4")
        code, out, err = await changebus(
            *args, *grouped, "--limit", "60", "--member-name", "tailer",
            "--checkpoint-dir", str(tmp_path / "units"), "--commit-interval", "0.1",
        )  # fmt: skip
        assert code == 0, err
        lines = [json.loads(line) for line in out.splitlines()]
        assert len(lines) == 60
        assert {line["unit"] for line in lines} == {"syn.0", "syn.1", "syn.2", "syn.3"}
        assert all(set(line) == KEYS | {"unit"} for line in lines)
        for unit in {line["unit"] for line in lines}:
            scns = [(r["scn"], r["seq"]) for r in lines if r["unit"] == unit]
            assert scns == sorted(scns), unit  # one unit's events in order
        # the same key always lands in the same unit
        units_of_key: dict[str, set[str]] = {}
        for line in lines:
            units_of_key.setdefault(json.dumps(line["key"]), set()).add(line["unit"])
        assert all(len(u) == 1 for u in units_of_key.values())
        # the member committed its units in the file store when it exited
        doc = await status_json(
            group, "--zookeeper", zk_hosts, "--store-dir", str(tmp_path / "units")
        )
        assert doc["members"] == []
        assert all(u["checkpoint_scn"] is not None for u in doc["units"]), doc["units"]
        assert all(u["state"] == "unassigned" for u in doc["units"])


async def test_replicate_in_a_group_keeps_unit_checkpoints_in_the_replica(
    zk_hosts: str, make_relay: MakeRelay, tmp_path: Path
) -> None:
    group = group_name()
    db = tmp_path / "copy.db"
    async with make_relay(max_windows=40) as relay:
        head = await relay_head(relay.url)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "changebus.schemas", "replicate", "--relay", relay.url,
            "--partition", "syn", "--sqlite", str(db), "--group", group, "--zookeeper", zk_hosts,
            "--buckets", "4", "--commit-interval", "0.1", "--member-name", "copier",
            "--log-level", "warning",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=ENV,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 40
            while True:
                if await asyncio.to_thread(db.exists):
                    code, out, err = await changebus(
                        "group", "status", group, "--zookeeper", zk_hosts, "--relay", relay.url,
                        "--store-sqlite", str(db), "--json",
                    )  # fmt: skip
                    doc = json.loads(out) if code == 0 else {"units": []}
                    units = doc["units"]
                    if units and all(u["lag_scn"] == 0 for u in units):
                        break
                assert proc.returncode is None, await proc.communicate()
                assert time.monotonic() < deadline, (code, out, err)
                await asyncio.sleep(0.3)
            assert [m["name"] for m in doc["members"]] == ["copier"]
            assert {u["checkpoint_scn"] for u in units} == {head.max_scn}
            assert {u["owner"] for u in units} == {doc["members"][0]["id"]}
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
            _, err_b = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0, err_b.decode()
