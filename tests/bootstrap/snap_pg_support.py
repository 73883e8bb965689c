"""What the chunked Postgres snapshot tests (test_snapshot_pg.py) use.

The table rows of the source and of the bootstrap's SQLite store (decoded with
the schemas it holds) and their comparison; a probe sampling the seeder's
longest open transaction (``pg_stat_activity``); writer threads of short
transactions; starting a seed and waiting for it, a :class:`SeedRequest` with
the relay's schemas, a bootstrap config that seeds; snapshot sinks that keep
every chunk in memory (one resuming from a stored job); and the key bytes of a
row in the relay's stream.
"""

from __future__ import annotations

import dataclasses
import json
import random
import sqlite3
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import psycopg
from boot_e2e import bootstrap_config, relay_config

from changebus.bootstrap import BootstrapServer, SeedConfig, SeedRequest
from changebus.bootstrap._chunks import Chunk, JobState, SnapshotScope
from changebus.relay import Relay
from changebus.schemas import (
    HEADER_SIZE,
    ChangeDecoder,
    Op,
    TableSchema,
    decode_header,
    event_at,
    parse_stream,
    verify_event,
)
from fix_pg import caught_up, writer_txn
from waiting import wait_until


def norm(v: Any) -> Any:
    return str(v) if isinstance(v, uuid.UUID) else v


def source_rows(dsn: str, table: str, cols: list[str]) -> set[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(f"SELECT {', '.join(cols)} FROM {table}").fetchall()
    return {tuple(norm(v) for v in r) for r in rows}


def store_rows(db: Path, table: str, cols: list[str]) -> set[tuple[Any, ...]]:
    """The live snapshot rows of ``table`` in the bootstrap's SQLite store, decoded."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        schemas = conn.execute(
            "SELECT source_id, version, schema FROM cb_schema WHERE part = 'pg' AND name = ?",
            (table,),
        ).fetchall()
        assert schemas, f"no schema of {table} in the store"
        sid = int(schemas[0][0])
        decoders = {
            int(v): ChangeDecoder(TableSchema.from_json(json.loads(j))) for _s, v, j in schemas
        }
        events = conn.execute(
            "SELECT event FROM cb_snap WHERE part = 'pg' AND source_id = ? AND deleted = 0", (sid,)
        ).fetchall()
    finally:
        conn.close()
    out = set()
    for (event,) in events:
        ev = bytes(event)
        h = verify_event(ev, 0)
        change = decoders[h.schema_version].decode(bytes(event_at(ev, 0, h)[1]))
        assert change.after is not None
        out.add(tuple(norm(change.after[c]) for c in cols))
    return out


def assert_same(got: set[tuple[Any, ...]], want: set[tuple[Any, ...]], what: str) -> None:
    extra, missing = sorted(got - want, key=repr), sorted(want - got, key=repr)
    assert not extra and not missing, (
        f"{what}: {len(extra)} rows only in the store {extra[:3]}, "
        f"{len(missing)} only in the source {missing[:3]} (of {len(want)})"
    )


class LongestTxn:
    """Samples the seeder's open transactions every ~20 ms (pg_stat_activity)."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.longest = 0.0
        self.samples = 0
        self.seen = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self._stop.is_set():
                row = conn.execute(
                    "SELECT count(*), max(EXTRACT(epoch FROM clock_timestamp() - xact_start)) "
                    "FROM pg_stat_activity WHERE application_name = 'changebus-seed' "
                    "AND xact_start IS NOT NULL"
                ).fetchone()
                assert row is not None
                self.samples += 1
                self.seen += int(row[0])
                if row[1] is not None:
                    self.longest = max(self.longest, float(row[1]))
                time.sleep(0.02)

    def __enter__(self) -> LongestTxn:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class Writers:
    """``n`` threads of short transactions (insert, update, delete) on ``table`` until stopped."""

    def __init__(
        self, dsn: str, n: int, step: Callable[[psycopg.Connection[Any], random.Random], None]
    ):
        self.dsn, self.step = dsn, step
        self.txns = 0
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)
        ]
        self.errors: list[BaseException] = []

    def _run(self, i: int) -> None:
        rnd = random.Random(i)
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                while not self._stop.is_set():
                    if writer_txn(conn, lambda: self.step(conn, rnd)):
                        self.txns += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.errors.append(exc)

    def __enter__(self) -> Writers:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()
        assert not self.errors, self.errors

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def seed_and_wait(
    boot: BootstrapServer, tables: list[str], scope: SnapshotScope | None = None
) -> Any:
    w = boot.service.workers["pg"]
    boot.service.start_seed("pg", tables, again=True, scope=scope)
    await wait_until(lambda: w.seed.state in ("done", "failed"), 180, "the seed")
    assert w.seed.state == "done", w.seed.error
    return w.seed


@asynccontextmanager
async def streaming_relay(
    tmp: Path, dsn: str, *statements: str, capacity: int = 64 << 20
) -> AsyncIterator[Relay]:
    """A relay on ``dsn``, streaming, that has seen ``statements`` (run once it streams:
    changes that make it learn the tables' schemas)."""
    async with Relay(relay_config(tmp, dsn, capacity)) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        with psycopg.connect(dsn, autocommit=True) as conn:
            for statement in statements:
                conn.execute(statement)
        await caught_up(relay, dsn)
        yield relay


def relay_request(relay: Relay, dsn: str, table: str, **kw: Any) -> SeedRequest:
    host = relay.hosts["pg"]
    reg = host.registry
    schemas = tuple((sid, s) for sid, name in reg.sources() for s in reg.versions(name))
    return SeedRequest(dsn, 1, (table,), schemas=schemas, **kw)


@dataclasses.dataclass
class RecordingSink:
    """A SnapshotSink keeping every chunk (and the finish) in memory."""

    chunks: list[Chunk] = dataclasses.field(default_factory=list)
    finished: list[JobState] = dataclasses.field(default_factory=list)

    def resume(self, scope: SnapshotScope) -> JobState | None:
        return None

    def chunk(self, scope: SnapshotScope, job: JobState, chunk: Chunk) -> None:
        self.chunks.append(chunk)

    def unfilled(
        self, scope: SnapshotScope, upto: int, stop: threading.Event, *, exact: bool
    ) -> list[tuple[bytes, tuple[Any, ...], int]]:
        return []

    def refill(self, scope: SnapshotScope, chunk: Chunk, skipped: list[bytes]) -> None:
        self.chunks.append(chunk)

    def finish(self, scope: SnapshotScope, job: JobState, stop: threading.Event) -> None:
        self.finished.append(job)

    def rows(self, relay: Relay, table: str, cols: list[str]) -> set[tuple[Any, ...]]:
        decoder = ChangeDecoder(relay.hosts["pg"].registry.latest(table))
        out = set()
        for c in self.chunks:
            for ev in c.events:
                change = decoder.decode(bytes(event_at(ev, 0, verify_event(ev, 0))[1]))
                assert change.after is not None
                out.add(tuple(norm(change.after[k]) for k in cols))
        return out


def boot_config(tmp: Path, relay_url: str, dsn: str, chunk_rows: int) -> Any:
    return dataclasses.replace(
        bootstrap_config(tmp, relay_url, "sqlite"),
        seed=SeedConfig(dsn=dsn, chunk_rows=chunk_rows, log_every_chunks=20),
    )


def streamed_key(relay: Relay, table: str, key: int) -> bytes:
    """The key bytes of the relay's INSERT event of ``key``."""
    host = relay.hosts["pg"]
    sel = host.buffer.select(-1, -1, 1 << 30)
    assert sel is not None
    data = b"".join(bytes(v) for v in sel.views)
    assert host.buffer.release(sel)
    decoder = ChangeDecoder(host.registry.latest(table))
    for off in parse_stream(data)[0].tolist():
        h = verify_event(data, off)
        if h.op == Op.INSERT and host.registry.name_for_id(h.source_id) == table:
            ev = data[off : off + h.total_length]
            change = decoder.decode(bytes(event_at(data, off, h)[1]))
            if change.after is not None and change.after["id"] == key:
                return ev[HEADER_SIZE : HEADER_SIZE + decode_header(ev).key_length]
    raise AssertionError(f"no INSERT of {key} in the relay")


@dataclasses.dataclass
class ResumingSink(RecordingSink):
    """A RecordingSink that resumes from ``stored`` and may act after each chunk."""

    stored: JobState | None = None
    after_chunk: Callable[[int], None] | None = None

    def resume(self, scope: SnapshotScope) -> JobState | None:
        return self.stored

    def chunk(self, scope: SnapshotScope, job: JobState, chunk: Chunk) -> None:
        super().chunk(scope, job, chunk)
        self.jobs.append(job)
        if self.after_chunk is not None:
            self.after_chunk(len(self.chunks))

    jobs: list[JobState] = dataclasses.field(default_factory=list)
