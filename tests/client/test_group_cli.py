"""``changebus group status|list|delete`` and the group flags of ``changebus tail``.

The commands run as subprocesses against a real ZooKeeper (``fix_zk``) and
real relays started in the test's loop. The group trees are made by real
members: ``GroupMember`` + ``ZkUnitStore`` (the coordination layer alone) and
group ``Consumer`` instances (the whole engine): those are in
test_group_cli_consumers.py.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from group_cli_support import (
    MakeRelay,
    changebus,
    changebus_env,
    group_name,
    relay_head,
    status_json,
)
from test_client_cli import ENV

from changebus.client import FileUnitStore
from changebus.client._cli_group_status import Head, build_report, render_text, unit_lag
from changebus.cluster import (
    ClusterConfig,
    GroupMember,
    PartitionState,
    Registry,
    ZkSession,
    ZkUnitStore,
)
from changebus.schemas import PartitionCheckpoint, StoredUnit, Unit, UnitCommit
from waiting import wait_until

pytestmark = pytest.mark.zk


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


# -- the report, without servers ----------------------------------------------------------


def ckpt(scn: int, ts_ns: int = 0) -> PartitionCheckpoint:
    return PartitionCheckpoint(window_scn=scn, prev_scn=scn, timestamp_ns=ts_ns)


def test_lag_is_scn_and_seconds_behind_the_head() -> None:
    head = Head(scn=1100, timestamp_ns=5_000_000_000)
    assert unit_lag(ckpt(1100, 5_000_000_000), head) == (0, 0.0)
    assert unit_lag(ckpt(1200, 6_000_000_000), head) == (0, 0.0)  # ahead of a lagging relay
    assert unit_lag(ckpt(1000, 2_500_000_000), head) == (100, 2.5)
    assert unit_lag(ckpt(1000), head) == (100, None)  # no commit time known
    assert unit_lag(None, head) == (None, None)
    assert unit_lag(ckpt(1000), None) == (None, None)
    # a window consumed halfway counts from the last complete one
    half = PartitionCheckpoint(window_scn=1050, window_offset=2, prev_scn=1040)
    assert unit_lag(half, head) == (60, None)
    assert unit_lag(PartitionCheckpoint(), head) == (None, None)  # no position yet


def test_report_states_counts_and_json() -> None:
    units = Unit.all_of(("p",), 4)
    report = build_report(
        group="g1",
        buckets=4,
        partitions=("p",),
        leader="m-0000000001",
        members={
            "m-0000000001": {"name": "a", "host": "h1", "pid": 10, "started_ns": 1},
            "m-0000000002": {"name": "b", "host": "h2", "pid": 20, "started_ns": 2},
        },
        # m-0000000000 is gone: what it was assigned counts for nobody
        assignment={
            "m-0000000001": units[:2],
            "m-0000000002": units[2:3],
            "m-0000000000": units[3:],
        },
        owners={units[0]: "m-0000000001", units[1]: "m-0000000002", units[3]: "m-0000000002"},
        stored={
            units[0]: StoredUnit(units[0], ckpt(1100, 9), "m-0000000001", 3, 77),
            units[1]: StoredUnit(units[1], None, "m-0000000002", 1, 0),
        },
        heads={"p": Head(1100, 9)},
        relays="http://r:1",
    )
    states = {str(u.unit): (u.owner, u.state) for u in report.units}
    assert states == {
        "p.0": ("m-0000000001", "ok"),
        "p.1": ("m-0000000002", "moving"),
        "p.2": (None, "starting"),
        "p.3": ("m-0000000002", "orphaned"),
    }
    assert [(m.member_id, m.owned, m.assigned, m.leader) for m in report.members] == [
        ("m-0000000001", 1, 2, True),
        ("m-0000000002", 2, 1, False),
    ]
    doc = json.loads(json.dumps(report.to_json()))
    assert doc["units"][0] == {
        "unit": "p.0",
        "owner": "m-0000000001",
        "assigned": "m-0000000001",
        "state": "ok",
        "generation": 3,
        "checkpoint_scn": 1100,
        "checkpoint_timestamp_ns": 9,
        "mode": "online",
        "updated_ns": 77,
        "lag_scn": 0,
        "lag_s": 0.0,
    }
    assert doc["units"][2]["checkpoint_scn"] is None and doc["units"][2]["lag_scn"] is None
    text = render_text(report)
    assert "leader m-0000000001" in text and "moving to m-0000000001" in text
    assert "p 1100" in text


# -- bad arguments -------------------------------------------------------------------------


async def test_tail_rejects_bad_group_arguments(zk_hosts: str) -> None:
    base = ("tail", "--relay", "http://127.0.0.1:1", "--partition", "p")
    cases = [
        (("--group", "g1", "--zookeeper", zk_hosts, "--buckets", "0"), "buckets"),
        (("--group", "bad/name", "--zookeeper", zk_hosts), "not a valid group name"),
        (("--group", "g1"), "needs --zookeeper"),
        (("--buckets", "8"), "--buckets: only with --group"),
        (("--group", "g1", "--zookeeper", zk_hosts, "--filter", "mod:2:0"), "filter"),
        (("--group", "g1", "--zookeeper", zk_hosts, "--checkpoint", "x.json"), "--checkpoint-dir"),
        (("--checkpoint-dir", "d"), "--checkpoint-dir: only with --group"),
        (("--group", "g1", "--zookeeper", zk_hosts, "--commit-interval", "-1"), "commit_interval"),
    ]
    for extra, needle in cases:
        code, out, err = await changebus(*base, *extra)
        assert code == 2, (extra, err)
        assert needle in err and "Traceback" not in err, (extra, err)
        assert out == ""
    code, _, err = await changebus(
        "replicate", "--relay", "http://127.0.0.1:1", "--sqlite", "x.db", "--buckets", "0",
        "--group", "g1", "--zookeeper", zk_hosts, "--partition", "p",
    )  # fmt: skip
    assert code == 2 and "buckets" in err and "Traceback" not in err


async def test_status_of_an_unknown_group_or_bad_name_exits_2(zk_hosts: str) -> None:
    code, out, err = await changebus("group", "status", group_name(), "--zookeeper", zk_hosts)
    assert code == 2 and out == ""
    assert "no group" in err and "Traceback" not in err
    code, _, err = await changebus("group", "status", "no/slash", "--zookeeper", zk_hosts)
    assert code == 2 and "not a valid group name" in err
    code, _, err = await changebus("group", "delete", group_name(), "--zookeeper", zk_hosts)
    assert code == 2 and "no group" in err


async def test_unreachable_zookeeper_is_one_line_not_a_traceback() -> None:
    hosts = f"127.0.0.1:{closed_port()}"
    for cmd in (("status", "g1"), ("list",), ("delete", "g1")):
        code, out, err = await changebus(
            "group", *cmd, "--zookeeper", hosts, "--timeout", "1", wait_s=30
        )
        assert code == 1, (cmd, err)
        assert err.startswith(f"changebus group {cmd[0]}: cannot reach ZooKeeper: "), err
        assert hosts in err and len(err.splitlines()) == 1, err
        assert out == ""


# -- a group tree made by GroupMember + ZkUnitStore ---------------------------------------


@asynccontextmanager
async def zk_session(zk_hosts: str) -> AsyncIterator[ZkSession]:
    session = ZkSession(ClusterConfig(zookeeper=zk_hosts, name="groups", session_timeout_s=4))
    await session.start()
    try:
        yield session
    finally:
        await session.stop()


@asynccontextmanager
async def registered(zk_hosts: str, cluster: str, url: str) -> AsyncIterator[None]:
    """``url`` registered as the leading relay of partition ``syn`` of ``cluster``."""
    config = ClusterConfig(
        zookeeper=zk_hosts, name=cluster, member_id="r1", advertised_url=url, session_timeout_s=4
    )
    session = ZkSession(config)
    await session.start()
    registry = Registry(session, "relay")
    try:
        await registry.start()
        registry.update({"syn": PartitionState("leader", 1, 1000, 1029)})
        await registry.flush()
        yield
    finally:
        await registry.stop()
        await session.stop()


async def test_status_list_delete_of_a_group_of_two_members(
    zk_hosts: str, zk_cluster: str, make_relay: MakeRelay
) -> None:
    group = group_name()
    async with (
        make_relay(max_windows=30) as relay,
        zk_session(zk_hosts) as s1,
        zk_session(zk_hosts) as s2,
    ):
        head = await relay_head(relay.url)
        assert head.max_scn >= 1000 and head.newest_timestamp_ns > 0
        m1 = GroupMember(s1, group, ["syn"], 4, name="alpha")
        m2 = GroupMember(s2, group, ["syn"], 4, name="beta")
        await m1.start()
        await m2.start()
        try:
            await wait_until(lambda: len(m1.target) == 2 and len(m2.target) == 2, 20, "targets")
            assert m1.target | m2.target == set(Unit.all_of(["syn"], 4))
            behind = Unit("syn", 3)  # this unit's checkpoint is 5 windows behind, 2 s older
            for member, session in ((m1, s1), (m2, s2)):
                store = ZkUnitStore(session)
                for unit in sorted(member.target):
                    await member.acquire(unit)
                    claim = await store.claim(group, unit, member.member_id)
                    assert claim.checkpoint is None and claim.generation == 1
                    scn, ts = head.max_scn, head.newest_timestamp_ns
                    if unit == behind:
                        scn, ts = scn - 5, ts - 2_000_000_000
                    result = await store.commit(
                        group, [UnitCommit(unit, ckpt(scn, ts), claim.token)]
                    )
                    assert not result.fenced
            owner = dict.fromkeys(m1.target, m1.member_id) | dict.fromkeys(m2.target, m2.member_id)

            base = ("--zookeeper", zk_hosts, "--relay", relay.url)
            code, out, err = await changebus("group", "status", group, *base, "--json")
            assert code == 0, err
            doc = json.loads(out)
            assert doc["group"] == group and doc["buckets"] == 4 and doc["partitions"] == ["syn"]
            assert doc["leader"] == min(m1.member_id, m2.member_id)
            assert {(m["id"], m["name"], m["units"], m["assigned"]) for m in doc["members"]} == {
                (m1.member_id, "alpha", 2, 2),
                (m2.member_id, "beta", 2, 2),
            }
            assert all(m["host"] and m["pid"] for m in doc["members"])
            assert doc["heads"]["syn"] == {
                "scn": head.max_scn,
                "timestamp_ns": head.newest_timestamp_ns,
            }
            units = {u["unit"]: u for u in doc["units"]}
            assert sorted(units) == ["syn.0", "syn.1", "syn.2", "syn.3"]
            for unit in Unit.all_of(["syn"], 4):
                row = units[str(unit)]
                assert row["owner"] == owner[unit] and row["state"] == "ok"
                assert row["generation"] == 1
                if unit == behind:
                    assert row["checkpoint_scn"] == head.max_scn - 5
                    assert row["lag_scn"] == 5 and row["lag_s"] == 2.0
                else:
                    assert row["checkpoint_scn"] == head.max_scn
                    assert row["lag_scn"] == 0 and row["lag_s"] == 0.0

            # the text form: one screen with both members and every unit
            code, out, err = await changebus("group", "status", group, *base)
            assert code == 0, err
            assert f"group {group}: 1 partition(s) x 4 bucket(s) = 4 unit(s)" in out
            for m in (m1, m2):
                assert m.member_id in out
            assert "alpha" in out and "beta" in out
            lines = {line.split()[0]: line.split() for line in out.splitlines() if line}
            assert lines["syn.3"] == [
                "syn.3", owner[behind], "ok", "1", str(head.max_scn - 5), "5", "2.0"
            ]  # fmt: skip
            assert lines["syn.0"][-2:] == ["0", "0.0"]
            assert lines[m1.member_id][:2] == [m1.member_id, "alpha"]

            # the relays of a relay cluster registered in the same ZooKeeper
            async with registered(zk_hosts, zk_cluster, relay.url):
                doc = await status_json(group, "--zookeeper", zk_hosts, "--cluster", zk_cluster)
            assert doc["heads"]["syn"]["scn"] == head.max_scn
            assert doc["relays"] == f"cluster {zk_cluster}"
            assert [u["lag_scn"] for u in doc["units"]] == [0, 0, 0, 5]

            # without relays: no lag, but everything else
            code, out, err = await changebus("group", "status", group, "--zookeeper", zk_hosts)
            assert code == 0 and "relay heads: not asked" in out

            code, out, err = await changebus("group", "list", "--zookeeper", zk_hosts, "--json")
            assert code == 0, err
            mine = [g for g in json.loads(out)["groups"] if g["group"] == group]
            assert mine == [
                {
                    "group": group,
                    "partitions": ["syn"],
                    "buckets": 4,
                    "members": 2,
                    "leader": min(m1.member_id, m2.member_id),
                }
            ]
            code, out, err = await changebus("group", "delete", group, "--zookeeper", zk_hosts)
            assert code == 1 and "live member" in err and "--force" in err
        finally:
            await m1.stop()
            await m2.stop()
        code, out, err = await changebus("group", "delete", group, "--zookeeper", zk_hosts)
        assert code == 0, err
        assert f"deleted group {group}" in out
        assert await s1.op("exists", f"/changebus/groups/{group}") is None
        code, _, err = await changebus("group", "status", group, "--zookeeper", zk_hosts)
        assert code == 2 and "no group" in err


def signal_masks(pid: int) -> str:
    """A process's ignored and caught signal masks (for a failure message)."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return ", ".join(x for x in lines if x.startswith(("SigIgn", "SigCgt", "SigBlk")))


async def test_status_reads_other_stores_watches_and_hides_dsn_passwords(
    zk_hosts: str, tmp_path: Path
) -> None:
    group = group_name()
    async with zk_session(zk_hosts) as session:
        member = GroupMember(session, group, ["p1", "p2"], 2, name="solo")
        await member.start()
        try:
            await wait_until(lambda: len(member.target) == 4, 20, "a target")
            store = FileUnitStore(tmp_path / "units")
            for n, unit in enumerate(sorted(member.target)):
                await member.acquire(unit)
                claim = await store.claim(group, unit, member.member_id)
                await store.commit(group, [UnitCommit(unit, ckpt(2000 + n), claim.token)])
            await store.close()
            base = ("group", "status", group, "--zookeeper", zk_hosts)
            code, out, err = await changebus(
                *base, "--store-dir", str(tmp_path / "units"), "--json"
            )
            assert code == 0, err
            doc = json.loads(out)
            assert [(u["unit"], u["checkpoint_scn"], u["owner"]) for u in doc["units"]] == [
                ("p1.0", 2000, member.member_id),
                ("p1.1", 2001, member.member_id),
                ("p2.0", 2002, member.member_id),
                ("p2.1", 2003, member.member_id),
            ]
            assert doc["heads"] == {} and doc["relays"] is None
            # the ZooKeeper store of the same group has no checkpoints
            code, out, err = await changebus(*base, "--json")
            assert code == 0 and {u["checkpoint_scn"] for u in json.loads(out)["units"]} == {None}

            # --watch prints again until interrupted (one JSON object per line)
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "changebus.schemas", *base, "--json", "--watch", "0.2",
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                env={**ENV, "PYTHONFAULTHANDLER": "1"},
            )  # fmt: skip
            assert proc.stdout is not None
            for _ in range(3):
                line = await asyncio.wait_for(proc.stdout.readline(), 20)
                assert json.loads(line)["group"] == group
            dispositions = signal_masks(proc.pid)
            proc.send_signal(signal.SIGINT)
            try:
                _, err_b = await asyncio.wait_for(proc.communicate(), 60)
            except TimeoutError:
                proc.send_signal(signal.SIGABRT)  # faulthandler prints every thread's stack
                _, err_b = await asyncio.wait_for(proc.communicate(), 20)
                pytest.fail(
                    f"SIGINT did not end --watch ({dispositions}):\n{err_b.decode()[-6000:]}"
                )
            assert proc.returncode == 0 and b"Traceback" not in err_b

            # a Postgres store that cannot be reached: one line, no password
            dsn = f"postgresql://someone:pw-{uuid.uuid4().hex}@127.0.0.1:{closed_port()}/db"
            code, out, err = await changebus(*base, "--store-dsn", dsn)
            assert code == 1 and out == ""
            assert "unit store" in err and "Traceback" not in err
            assert dsn.split(":")[2].split("@")[0] not in err
            env_code, _, env_err = await changebus_env(
                {"CHANGEBUS_STORE_DSN": dsn}, *base, "--store-dsn"
            )
            assert env_code == 1 and "pw-" not in env_err
        finally:
            await member.stop()


async def test_list_marks_a_damaged_group_and_lists_the_others(zk_hosts: str) -> None:
    """One group whose meta node is not JSON must not hide the other groups from ``list``."""
    from kazoo.client import KazooClient

    from changebus.cluster import group_root

    bad, good = group_name(), group_name()
    zk = KazooClient(hosts=zk_hosts)
    await asyncio.to_thread(zk.start, 10)
    try:
        await asyncio.to_thread(zk.create, f"{group_root(bad)}/meta", b"{not json", makepath=True)
        await asyncio.to_thread(
            zk.create,
            f"{group_root(good)}/meta",
            json.dumps({"v": 1, "partitions": ["syn"], "buckets": 4}).encode(),
            makepath=True,
        )
        code, out, err = await changebus("group", "list", "--zookeeper", zk_hosts, "--json")
        assert code == 0, err
        listed = {g["group"]: g for g in json.loads(out)["groups"]}
        assert "not JSON" in listed[bad]["error"] and listed[bad]["partitions"] is None
        assert "error" not in listed[good]
        code, out, err = await changebus("group", "list", "--zookeeper", zk_hosts)
        assert code == 0, err
        assert any(line.startswith(bad) and "unreadable" in line for line in out.splitlines())
    finally:
        for g in (bad, good):
            await asyncio.to_thread(zk.delete, group_root(g), recursive=True)
        await asyncio.to_thread(zk.stop)
        await asyncio.to_thread(zk.close)
