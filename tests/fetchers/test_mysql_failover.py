"""The mysql fetcher after a failover: a primary, a GTID replica promoted, one relay buffer.

Two real MariaDB servers on loopback: a primary (server id 1) and a replica
(server id 2, ``log_slave_updates``, GTID replication). A relay reads the
primary during a workload and stops; more is committed on the primary (the
replica applies it, the relay has not read it); the primary stops; the replica
is promoted; the relay is started again with its fetcher pointed at the
replica (a config change) and goes on. Every change must arrive exactly once
in commit order, SCNs strictly increasing in the one buffer, and the rebuilt
tables must equal the new primary's row by row.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_mysql_fetcher import execute, relay_config, replay, source_rows, wait_until
from test_mysql_fetcher_ops import make_tables, workload

from changebus.bootstrap import SeedProgress, SeedRequest, seed_mysql
from changebus.fetchers.mysql import EmbeddedMariaDB, parse_position
from changebus.relay import Relay
from changebus.schemas import DataLoss, EndOfWindow, Op, binlog_file_number, binlog_to_scn

pytestmark = pytest.mark.mysql


@pytest.fixture
def pair() -> Iterator[tuple[EmbeddedMariaDB, EmbeddedMariaDB]]:
    """A primary and its GTID replica (log_slave_updates), stopped by pid afterwards."""
    primary = EmbeddedMariaDB.start(Path(tempfile.mkdtemp(prefix="changebus-primary-")))
    replica = None
    try:
        replica = EmbeddedMariaDB.start(
            Path(tempfile.mkdtemp(prefix="changebus-replica-")),
            settings={"server-id": "2", "log-slave-updates": ""},
        )
        execute(
            replica,
            "mysql",
            f"CHANGE MASTER TO MASTER_HOST='127.0.0.1', MASTER_PORT={primary.port}, "
            "MASTER_USER='root', MASTER_PASSWORD='', MASTER_USE_GTID=slave_pos",
            "START SLAVE",
        )
        yield primary, replica
    finally:
        for server in (replica, primary):
            if server is not None:
                server.stop()
                shutil.rmtree(server.directory, ignore_errors=True)


def query(server: EmbeddedMariaDB, sql: str) -> Any:
    conn = server.connect()
    try:
        with conn.cursor() as cur:
            cur.execute(sql)
            return cur.fetchone()
    finally:
        conn.close()


def wait_replicated(primary: EmbeddedMariaDB, replica: EmbeddedMariaDB) -> None:
    target = query(primary, "SELECT @@gtid_binlog_pos")[0]
    deadline = time.monotonic() + 30
    while query(replica, "SELECT @@gtid_slave_pos")[0] != target:
        assert time.monotonic() < deadline, "the replica did not catch up"
        time.sleep(0.05)


def raw_scn(server: EmbeddedMariaDB) -> int:
    file, pos = query(server, "SHOW MASTER STATUS")[:2]
    return binlog_to_scn(binlog_file_number(file), int(pos))


async def caught_up(relay: Relay, server: EmbeddedMariaDB, db: str) -> None:
    """Until the relay holds all committed so far on ``server`` (SCN base included)."""
    execute(
        server,
        db,
        "CREATE TABLE IF NOT EXISTS marker (id int PRIMARY KEY, n bigint NOT NULL)",
        "INSERT INTO marker VALUES (1, 1) ON DUPLICATE KEY UPDATE n = n + 1",
    )
    host = relay.hosts["my"]
    await wait_until(lambda: host.state == "streaming" and "fetcher" in host.status())
    target = host.status()["fetcher"]["scn_base"] + raw_scn(server)
    await wait_until(lambda: host.buffer.meta.last_scn >= target)


def check(relay: Relay, server: EmbeddedMariaDB, db: str) -> list[str]:
    """Exactly once, in order, state equal to ``server``'s; returns the windows' GTIDs."""
    rows, scns, events = replay(relay, "acct")
    assert scns == sorted(set(scns))  # strictly increasing: no duplicate window
    assert rows == source_rows(server, db, "acct")
    logged = [
        p[1].after["id"]
        for op, p in events
        if op == Op.INSERT and p[0].endswith(".log") and p[1].after is not None
    ]
    # the log table only grows (auto-increment): every insert exactly once, in commit order
    assert logged == list(range(1, len(logged) + 1))
    assert logged == sorted(source_rows(server, db, "log"))
    return [
        parse_position(p.source_position)["gtid"]
        for op, p in events
        if op == Op.END_OF_WINDOW and isinstance(p, EndOfWindow) and p.event_count
    ]


async def test_resume_on_a_promoted_replica(
    tmp_path: Path, pair: tuple[EmbeddedMariaDB, EmbeddedMariaDB]
) -> None:
    primary, replica = pair
    db = "fo"
    execute(primary, "mysql", f"CREATE DATABASE {db}")
    make_tables(primary, db)
    # the primary's binlog file numbers run ahead of the replica's: read naively, SCNs
    # on the replica would go backwards
    for _ in range(3):
        execute(primary, db, "FLUSH BINARY LOGS")
    cfg = relay_config(tmp_path, primary, db)
    async with Relay(cfg) as relay:
        await wait_until(lambda: relay.hosts["my"].state == "streaming")
        writer = asyncio.create_task(asyncio.to_thread(workload, primary, db, 1, 60))
        await writer
        await caught_up(relay, primary, db)
        last_on_primary = relay.hosts["my"].buffer.meta.last_scn
        check(relay, primary, db)
    # committed on the primary while the relay is down: only the replica has it now
    await asyncio.to_thread(workload, primary, db, 2, 25)
    await asyncio.to_thread(wait_replicated, primary, replica)
    await asyncio.to_thread(primary.stop)
    execute(replica, "mysql", "STOP SLAVE", "RESET SLAVE ALL")
    assert raw_scn(replica) < last_on_primary

    failover = relay_config(tmp_path, replica, db)  # the same relay, pointed at the replica
    async with Relay(failover) as relay:
        await asyncio.to_thread(workload, replica, db, 3, 25)
        await caught_up(relay, replica, db)
        status = relay.hosts["my"].status()["fetcher"]
        assert status["mysql_server_id"] == 2 and status["scn_base"] > 0
        gtids = check(relay, replica, db)
        # a bootstrap seed from the new primary is aligned with the relay's SCNs (base)
        host = relay.hosts["my"]
        request = SeedRequest(
            f"mysql://root:@127.0.0.1:{replica.port}",
            1,
            (f"{db}.acct",),
            schemas=((host.registry.source_id(f"{db}.acct"), host.registry.latest(f"{db}.acct")),),
            relay_fetcher=status,
        )
        seed_scn = await asyncio.to_thread(
            seed_mysql, request, lambda _t, _events, _scn: None, SeedProgress()
        )
        assert seed_scn >= host.buffer.meta.last_scn  # everything the relay holds is in it
        await caught_up(relay, replica, db)  # one more transaction: after the seed
        assert host.buffer.meta.last_scn > seed_scn
    # GTIDs of the old primary, then the new primary's own: none missing, none twice
    assert len(gtids) == len(set(gtids))
    assert any(g.startswith("0-1-") for g in gtids) and any(g.startswith("0-2-") for g in gtids)

    # a restart on the new primary goes on with the same SCN base (its own positions)
    await asyncio.to_thread(workload, replica, db, 4, 10)
    async with Relay(failover) as relay:
        await caught_up(relay, replica, db)
        assert relay.hosts["my"].status()["fetcher"]["scn_base"] == status["scn_base"]
        assert relay.hosts["my"].stats["fetcher_restarts"] == 0
        check(relay, replica, db)


async def test_a_divergent_server_is_refused(
    tmp_path: Path, pair: tuple[EmbeddedMariaDB, EmbeddedMariaDB]
) -> None:
    """The relay's last GTID is not on the new server (it replicated nothing): refused."""
    primary, replica = pair
    execute(replica, "mysql", "STOP SLAVE", "RESET SLAVE ALL")  # never gets the primary's
    db = "dv"
    for server in (primary, replica):
        execute(server, "mysql", f"CREATE DATABASE {db}")
        make_tables(server, db)
        await asyncio.to_thread(workload, server, db, 5, 30)  # the same GTID numbers, 0-S-N
    async with Relay(relay_config(tmp_path, primary, db)) as relay:
        await wait_until(lambda: relay.hosts["my"].state == "streaming")
        await asyncio.to_thread(workload, primary, db, 6, 5)
        await caught_up(relay, primary, db)
        _, before, _ = replay(relay, "acct")
    async with Relay(relay_config(tmp_path, replica, db)) as relay:
        await wait_until(lambda: relay.hosts["my"].state == "failed")
        error = relay.hosts["my"].last_error
        assert "is not in this server's binlog (server id 2)" in error
        assert "diverged" in error
        _, after, _ = replay(relay, "acct")
    assert after == before  # nothing read from the wrong server
    # or, if configured, a data-loss event and on from the new server's binlog end
    lenient = relay_config(tmp_path, replica, db, on_divergent_server="data_loss")
    async with Relay(lenient) as relay:
        await wait_until(lambda: relay.hosts["my"].state == "streaming")
        execute(replica, db, "INSERT INTO acct VALUES (5000, 1, 'new')")
        await caught_up(relay, replica, db)
        _, scns, events = replay(relay, "acct")
    assert scns == sorted(set(scns)) and scns[: len(before)] == before
    losses = [p for op, p in events if op == Op.DATA_LOSS and isinstance(p, DataLoss)]
    assert len(losses) == 1 and losses[0].to_scn == before[-1] + 1
    assert "diverged" in losses[0].reason
    assert scns[len(before)] == before[-1] + 1 and len(scns) > len(before) + 1
    new_rows = [p[1].after for op, p in events if op == Op.INSERT and p[1].after["id"] == 5000]
    assert new_rows == [{"id": 5000, "bal": 1, "name": "new"}]


def test_locate_gtid_pages_through_a_binlog_and_across_files(
    mysql_server: EmbeddedMariaDB, mysql_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where each transaction ends, by GTID, equals the position BINLOG_GTID_POS agrees with,
    with pages of a few events (the page boundary falls inside transactions)."""
    from changebus.fetchers.mysql import _failover

    make_tables(mysql_server, mysql_db)
    ends: dict[str, tuple[str, int]] = {}
    conn = mysql_server.connect(mysql_db)
    try:
        with conn.cursor() as cur:
            for i in range(12):
                if i == 6:
                    cur.execute("FLUSH BINARY LOGS")
                cur.execute("INSERT INTO log (acct, delta) VALUES (%s, 1)", (i,))
                cur.execute("SELECT @@last_gtid")
                gtid = str(cur.fetchone()[0])
                cur.execute("SHOW MASTER STATUS")
                file, pos = cur.fetchone()[:2]
                ends[gtid] = (str(file), int(pos))
            cur.execute("SHOW BINARY LOGS")
            logs = [str(r[0]) for r in cur.fetchall()]
            monkeypatch.setattr(_failover, "_PAGE", 3)
            for gtid, end in ends.items():
                assert _failover.locate_gtid(cur, logs, gtid) == end
            assert _failover.locate_gtid(cur, logs, "0-77-5") is None  # never there
            assert _failover.locate_gtid(cur, logs, "not-a-gtid") is None
    finally:
        conn.close()
