"""MariaDB seeds of tables keyed by zero dates (``0000-00-00``, ``2024-05-00``).

The live stream gives a zero date in a key column the key value of
:func:`~changebus.schemas.mysql_zero_date_key` (docs/mysql.md, Types), one
per zero date. The seed read the same rows with a null key column: the
table's seed failed ("cannot encode the key"), and a seeded row's key would
not have matched the key of its later changes. Now the seed writes the
stream's key values, chunk bounds may fall on zero dates, and the snapshot
equals the source row by row after changes to those rows.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
from pathlib import Path
from typing import Any

import pytest

from changebus.bootstrap import BootstrapServer
from changebus.fetchers.mysql import EmbeddedMariaDB
from changebus.relay import Relay
from changebus.schemas import mysql_zero_date_key
from fix_mysql import mysql_execute
from snap_mysql import boot_config, marker, relay_config, store_rows
from waiting import wait_until

pytestmark = pytest.mark.mysql

ZERO_OK = "SET SESSION sql_mode = ''"
_EPOCH = datetime.date(1970, 1, 1)


def _zero_key_texts(n: int) -> list[str]:
    zeros = ["0000-00-00", "2024-05-00", "2024-00-00", "1999-00-31"]
    return [zeros[i % len(zeros)] for i in range(n)]


def _fill(server: EmbeddedMariaDB, db: str) -> None:
    d_rows = [(t, i, i) for i, t in enumerate(_zero_key_texts(12))]
    d_rows += [(str(_EPOCH + datetime.timedelta(days=400 * i)), i, 100 + i) for i in range(8)]
    dt_rows = [("0000-00-00 00:00:00", 1), ("2024-05-00 10:00:00.500", 2)]
    dt_rows += [(f"2024-05-0{i} 10:00:00.250", 10 + i) for i in range(1, 8)]
    mysql_execute(
        server,
        db,
        "CREATE TABLE d (k date NOT NULL, n int NOT NULL, v int, PRIMARY KEY (k, n))",
        "CREATE TABLE dt (k datetime(3) NOT NULL PRIMARY KEY, v int)",
        ZERO_OK,
        *[("INSERT INTO d VALUES (%s, %s, %s)", r) for r in d_rows],
        *[("INSERT INTO dt VALUES (%s, %s)", r) for r in dt_rows],
    )


def _source(server: EmbeddedMariaDB, db: str, sql: str) -> set[tuple[Any, ...]]:
    conn = server.connect(db)
    try:
        with conn.cursor() as cur:
            cur.execute(sql)
            return {tuple(r) for r in cur.fetchall()}
    finally:
        conn.close()


def _key_of(text: str, with_time: bool) -> int:
    """A key column's value in the stream's keys: days (micros) or the zero-date value."""
    if text[:4] == "0000" or "-00" in text[:10]:
        return mysql_zero_date_key(text, with_time=with_time)
    if not with_time:
        return (datetime.date.fromisoformat(text) - _EPOCH).days
    at = datetime.datetime.fromisoformat(text) - datetime.datetime(1970, 1, 1)
    return (at.days * 86400 + at.seconds) * 1_000_000 + at.microseconds


async def test_tables_keyed_by_zero_dates_seed_and_follow_their_changes(
    tmp_path: Path, mysql_server: EmbeddedMariaDB, mysql_db: str
) -> None:
    server, db = mysql_server, mysql_db
    await asyncio.to_thread(_fill, server, db)
    async with Relay(relay_config(tmp_path, server, db)) as relay:
        host = relay.hosts["my"]
        await wait_until(lambda: host.state == "streaming")
        mysql_execute(  # (the relay registers both tables' schemas)
            server, db, "UPDATE d SET v = -1 WHERE v = 107", "UPDATE dt SET v = -1 WHERE v = 17"
        )
        names = {f"{db}.d", f"{db}.dt"}
        await wait_until(lambda: names <= {n for _s, n in host.registry.sources()}, 30)
        cfg = boot_config(tmp_path, relay, server, 3)  # chunk bounds on zero dates
        cfg = dataclasses.replace(cfg, seed=dataclasses.replace(cfg.seed, tables=tuple(names)))
        async with BootstrapServer(cfg) as boot:
            w = boot.service.workers["my"]
            await wait_until(lambda: w.seed.state in ("done", "failed"), 120, "the seed")
            assert w.seed.state == "done", w.seed.error
            assert w.seed.chunks >= 7
            # changes to seeded rows keyed by zero dates: they must replace those rows
            mysql_execute(
                server,
                db,
                ZERO_OK,
                "UPDATE d SET v = v + 1000 WHERE k = '2024-05-00'",
                "DELETE FROM d WHERE k = '0000-00-00' AND n = 4",
                "INSERT INTO d VALUES ('0000-00-00', 99, 99)",
                "UPDATE dt SET v = 7 WHERE k = '2024-05-00 10:00:00.500'",
                "DELETE FROM dt WHERE k = '0000-00-00 00:00:00'",
            )
            m = await asyncio.to_thread(marker, server, db)
            await wait_until(lambda: w.applier_scn >= m, 60, "the bootstrap applier")
            path = tmp_path / "boot" / "b.db"
            got_d = await asyncio.to_thread(store_rows, path, f"{db}.d")
            got_dt = await asyncio.to_thread(store_rows, path, f"{db}.dt")
    want_d = _source(server, db, "SELECT CAST(k AS CHAR), n, v FROM d")
    want_dt = _source(server, db, "SELECT CAST(k AS CHAR), v FROM dt")
    live_d = [r for r in got_d.values() if not r.deleted]
    live_dt = [r for r in got_dt.values() if not r.deleted]
    # row by row: one live row per source row (no stale seeded twin), the same values
    assert len(live_d) == len(want_d) == 20
    assert {(r.after["n"], r.after["v"]) for r in live_d} == {(n, v) for _k, n, v in want_d}
    assert len(live_dt) == len(want_dt) == 8
    assert {r.after["v"] for r in live_dt} == {v for _k, v in want_dt}

    # the store's keys are the stream's keys: Avro of (k, n) / (k)
    def zigzag(x: int) -> bytes:
        z, out = (x << 1) ^ (x >> 63), bytearray()
        while z > 0x7F:
            out.append((z & 0x7F) | 0x80)
            z >>= 7
        out.append(z)
        return bytes(out)

    assert {k for k, r in got_d.items() if not r.deleted} == {
        zigzag(_key_of(k, False)) + zigzag(n) for k, n, _v in want_d
    }
    assert {k for k, r in got_dt.items() if not r.deleted} == {
        zigzag(_key_of(k, True)) for k, _v in want_dt
    }
    zero_rows = [r for r in live_d if r.after["k"] is None]
    assert len(zero_rows) == 12  # 12 zero dates, one deleted, one inserted
