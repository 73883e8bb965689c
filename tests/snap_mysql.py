"""Helpers of the MariaDB snapshot tests (issue 20): servers, configs, row comparison.

The relay and bootstrap configurations for one database, the seed user's
DSN, the marker that ends a writer phase, and the source and store rows
compared row by row by :func:`assert_same`.
"""

from __future__ import annotations

import datetime
import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from changebus.bootstrap import (
    BootstrapConfig,
    HttpConfig as BootstrapHttp,
    SeedConfig,
    StoreConfig,
)
from changebus.fetchers.mysql import EmbeddedMariaDB
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.schemas import (
    ChangeDecoder,
    TableSchema,
    event_at,
    verify_event,
)
from fix_mysql import master_scn, mysql_execute

SEED_USER = "snapseed"
PASSWORD = "snap-Seed-pw-42"
ROWS = 8_000  # 40 chunks of 200: enough interleaving with the writers, ~25 s


def seed_dsn(server: EmbeddedMariaDB) -> str:
    """A user of the seed alone (its transactions are found by user in innodb_trx)."""
    mysql_execute(
        server,
        "mysql",
        f"CREATE USER IF NOT EXISTS '{SEED_USER}'@'127.0.0.1' IDENTIFIED BY '{PASSWORD}'",
        f"GRANT SELECT, BINLOG MONITOR ON *.* TO '{SEED_USER}'@'127.0.0.1'",
    )
    return f"mysql://{SEED_USER}:{PASSWORD}@127.0.0.1:{server.port}"


def relay_config(tmp: Path, server: EmbeddedMariaDB, db: str) -> RelayConfig:
    return RelayConfig(
        data_dir=tmp / "relay",
        http=HttpConfig(port=0),
        partitions=(
            PartitionConfig(
                "my",
                1,
                capacity_bytes=64 << 20,
                fetcher=FetcherConfig("mysql", server.options(databases=[db])),
            ),
        ),
        flush_interval_s=0,
    )


def boot_config(
    tmp: Path, relay: Relay, server: EmbeddedMariaDB, chunk_rows: int
) -> BootstrapConfig:
    return BootstrapConfig(
        relays=(relay.url,),
        data_dir=tmp / "boot",
        store=StoreConfig(kind="sqlite", path=tmp / "boot" / "b.db"),
        http=BootstrapHttp(port=0),
        seed=SeedConfig(
            kind="mysql",
            dsn=seed_dsn(server),
            on_start=True,
            chunk_rows=chunk_rows,
            log_every_chunks=25,
        ),
    )


def marker(server: EmbeddedMariaDB, db: str) -> int:
    """An SCN at or after every change committed so far (a captured marker change)."""
    mysql_execute(
        server,
        db,
        "CREATE TABLE IF NOT EXISTS marker (id int PRIMARY KEY, n bigint NOT NULL)",
        "INSERT INTO marker VALUES (1, 1) ON DUPLICATE KEY UPDATE n = n + 1",
    )
    return int(master_scn(server))


Row = tuple[Any, ...]


def source_rows(server: EmbeddedMariaDB, db: str, table: str, key: str) -> dict[Row, Row]:
    """``SELECT *`` of the source, by key (the key columns' values)."""
    conn = server.connect(db)
    try:
        with conn.cursor() as cur:
            cur.execute(f"SELECT * FROM `{table}` ORDER BY {key}")
            names = [d[0] for d in cur.description]
            at = [names.index(k.strip(" `")) for k in key.split(",")]
            return {tuple(r[i] for i in at): tuple(r) for r in cur.fetchall()}
    finally:
        conn.close()


def _plain(value: Any, want: Any) -> Any:
    """A decoded Avro value as the source's Python value (when the types differ)."""
    if value is None or type(value) is type(want):
        return value
    if isinstance(want, bytes) and isinstance(value, str):
        return value.encode()
    if isinstance(want, datetime.datetime) and isinstance(value, datetime.datetime):
        return value.replace(tzinfo=None)
    return value


@dataclass
class StoreRow:
    scn: int
    deleted: bool
    after: dict[str, Any]


def store_rows(path: Path, table: str) -> dict[bytes, StoreRow]:
    """The bootstrap store's snapshot rows of ``table`` by store key (decoded)."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        schemas = {
            (int(s), int(v)): TableSchema.from_json(json.loads(j))
            for s, v, j in conn.execute(
                "SELECT source_id, version, schema FROM cb_schema WHERE part = 'my' AND name = ?",
                (table,),
            )
        }
        sids = {s for s, _v in schemas}
        out: dict[bytes, StoreRow] = {}
        for sid, key, scn, deleted, event in conn.execute(
            "SELECT source_id, key, scn, deleted, event FROM cb_snap WHERE part = 'my'"
        ):
            if sid not in sids:
                continue
            h = verify_event(event, 0)
            change = ChangeDecoder(schemas[(sid, h.schema_version)]).decode(
                bytes(event_at(event, 0, h)[1])
            )
            image = change.after if change.after is not None else (change.before or {})
            out[bytes(key)] = StoreRow(int(scn), bool(deleted), dict(image))
        return out
    finally:
        conn.close()


def assert_same(
    store: dict[bytes, StoreRow], source: dict[Row, Row], names: list[str], key: list[str]
) -> None:
    """The store's live rows are the source's rows, row by row."""
    some_key = next(iter(source), None)
    got: dict[Row, Row] = {}
    for r in store.values():
        if r.deleted:
            continue
        k = tuple(r.after[c] for c in key)
        if some_key is not None:
            k = tuple(_plain(v, w) for v, w in zip(k, some_key, strict=True))
        row = tuple(r.after.get(c) for c in names)
        want = source.get(k)
        if want is not None:
            row = tuple(_plain(v, w) for v, w in zip(row, want, strict=True))
        got[k] = row
    bad = sorted((k for k in set(got) | set(source) if got.get(k) != source.get(k)), key=repr)
    detail = [(k, got.get(k), source.get(k)) for k in bad[:3]]
    assert not bad, f"{len(bad)} rows differ of {len(source)}: {detail}"


# ---- writers and the transaction sampler ------------------------------------------------
