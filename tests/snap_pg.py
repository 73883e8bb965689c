"""Helpers of the Postgres snapshot tests (issue 20): the source tables, writers,
markers, the relay's config, and the store's rows compared with the source's row by row.

``big`` (a one-column key) and ``pair`` (a composite key) in the test's throwaway
Postgres; the relay reads them with the postgres fetcher; the bootstrap server's SQLite
store is read back with the schemas it holds (``cb_schema``).
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import threading
from pathlib import Path
from typing import Any

import psycopg

from changebus.fetchers.postgres import message_scn
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.schemas import HEADER_SIZE, ChangeDecoder, TableSchema, decode_header
from waiting import wait_until

ROOT = Path(__file__).resolve().parents[1]
#: the environment of a daemon subprocess: the slices on its path
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(
        str(ROOT / s)
        for s in ("schemas", "cluster", "fetchers", "relay", "bootstrap", "client", "discovery")
    ),
}
Row = tuple[Any, ...]


def create_source(dsn: str, rows: int) -> None:
    """``big`` (``rows`` rows, one-column key) and ``pair`` (a composite key), analyzed."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE big (id int8 PRIMARY KEY, grp int4 NOT NULL, note text)")
        conn.execute(
            "INSERT INTO big SELECT i, i %% 7, 'row ' || i || repeat('x', i %% 50) "
            "FROM generate_series(1, %s) i",
            (rows,),
        )
        conn.execute("CREATE TABLE pair (a int8, b text, v text, PRIMARY KEY (a, b))")
        conn.execute("INSERT INTO pair SELECT i, 'k' || i, 'v' FROM generate_series(1, 20) i")
        conn.execute("ANALYZE big")
        conn.execute("ANALYZE pair")


def touch(dsn: str) -> None:
    """A change of each table: the relay learns their schemas."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE big SET note = note WHERE id = 1")
        conn.execute("UPDATE pair SET v = 'w' WHERE a = 1")


def sync_marker(dsn: str) -> int:
    """An SCN at or after every change committed so far."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_logical_emit_message(false, 'sync', 'x')::text").fetchone()
    assert row is not None
    return message_scn(row[0])


def writer(dsn: str, stop: threading.Event, rows: int, seed: int) -> int:
    """Updates, inserts and deletes of ``big`` until ``stop``; returns transactions done."""
    rnd = random.Random(seed)
    done = 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        while not stop.is_set():
            with conn.transaction():
                for _ in range(rnd.randint(1, 4)):
                    k = rnd.randint(1, rows + 500)
                    r = rnd.random()
                    if r < 0.6:
                        conn.execute(
                            "INSERT INTO big VALUES (%s, %s, %s) ON CONFLICT (id) DO UPDATE "
                            "SET grp = EXCLUDED.grp, note = EXCLUDED.note",
                            (k, rnd.randint(0, 99), f"w{done}"),
                        )
                    elif r < 0.8:
                        conn.execute("UPDATE big SET grp = grp + 1 WHERE id = %s", (k,))
                    else:
                        conn.execute("DELETE FROM big WHERE id = %s", (k,))
            done += 1
            stop.wait(0.005)
    return done


def source_rows(dsn: str) -> dict[int, Row]:
    with psycopg.connect(dsn) as conn:
        return {r[0]: tuple(r) for r in conn.execute("SELECT id, grp, note FROM big")}


def store_rows(path: Path, part: str, table: str) -> dict[int, Row]:
    """The live snapshot rows of ``table`` in a SQLite store, decoded with cb_schema."""
    conn = sqlite3.connect(path, timeout=10)
    try:
        schemas = {
            (sid, version): TableSchema.from_json(json.loads(text))
            for sid, version, text in conn.execute(
                "SELECT source_id, version, schema FROM cb_schema WHERE part = ? AND name = ?",
                (part, table),
            )
        }
        (sid,) = {s for s, _v in schemas}
        events = conn.execute(
            "SELECT event FROM cb_snap WHERE part = ? AND source_id = ? AND deleted = 0",
            (part, sid),
        ).fetchall()
    finally:
        conn.close()
    decoders = {k: ChangeDecoder(s) for k, s in schemas.items()}
    out: dict[int, Row] = {}
    for (event,) in events:
        ev = bytes(event)
        h = decode_header(ev)
        after = (
            decoders[(sid, h.schema_version)]
            .decode(memoryview(ev)[HEADER_SIZE + h.key_length :])
            .after
        )
        assert after is not None
        out[after["id"]] = (after["id"], after["grp"], after["note"])
    return out


def assert_same(got: dict[int, Row], want: dict[int, Row]) -> None:
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    wrong = sorted(k for k in set(got) & set(want) if got[k] != want[k])
    assert not (missing or extra or wrong), (
        f"missing {missing[:10]} ({len(missing)}), extra {extra[:10]} ({len(extra)}), "
        f"different {[(got[k], want[k]) for k in wrong[:5]]} ({len(wrong)})"
    )


def relay_config(tmp: Path, dsn: str) -> RelayConfig:
    return RelayConfig(
        data_dir=tmp / "relay",
        http=HttpConfig(port=0),
        partitions=(
            PartitionConfig(
                "pg",
                1,
                capacity_bytes=16 << 20,
                fetcher=FetcherConfig("postgres", {"dsn": dsn, "status_interval_s": 0.2}),
            ),
        ),
        flush_interval_s=0,
    )


async def relay_has(relay: Relay, marker: int) -> None:
    await wait_until(lambda: relay.hosts["pg"].buffer.meta.last_scn >= marker, 60, "the relay")
