"""Zero dates (``0000-00-00``, ``2024-05-00``) in key columns, through a real relay.

A zero date has no Avro value: in a row image it is null and listed as not
sent (as in any other column), and in the key it is a value no real date
has, one per zero date (docs/mysql.md, Types), so rows stay distinct.
"""

from __future__ import annotations

import datetime
import io
from pathlib import Path
from typing import Any

import fastavro
import pytest
from test_mysql_fetcher import buffer_bytes, caught_up, execute, relay_config

from changebus.fetchers.mysql import EmbeddedMariaDB
from changebus.relay import Relay
from changebus.schemas import (
    ChangeDecoder,
    Op,
    event_at,
    mysql_zero_date_key,
    parse_stream,
    verify_event,
)

pytestmark = pytest.mark.mysql

ZERO_OK = "SET SESSION sql_mode = ''"


class Change:
    """One data event: its op, key bytes, decoded key record and decoded change."""

    def __init__(self, op: Op, raw_key: bytes, key: dict[str, Any], change: Any) -> None:
        self.op, self.raw_key, self.key = op, raw_key, key
        self.after, self.before = change.after, change.before
        self.after_not_sent = list(change.after_not_sent)


def plain(schema: Any) -> Any:
    """``schema`` without logical types (the key's numbers as they are encoded)."""
    if isinstance(schema, dict):
        return {k: plain(v) for k, v in schema.items() if k != "logicalType"}
    if isinstance(schema, list):
        return [plain(v) for v in schema]
    return schema


def changes(relay: Relay, table: str) -> list[Change]:
    """The data events of ``table`` in the relay's buffer, in order."""
    data = buffer_bytes(relay)
    registry = relay.hosts["my"].registry
    out = []
    offsets, _ = parse_stream(data)
    for off in offsets.tolist():
        h = verify_event(data, off)
        if h.op.is_control:
            continue
        name = registry.name_for_id(h.source_id)
        if not name.endswith("." + table):
            continue
        schema = registry.get(name, h.schema_version)
        raw_key, payload = event_at(data, off, h)
        key = fastavro.schemaless_reader(io.BytesIO(bytes(raw_key)), plain(schema.key_schema), None)
        assert isinstance(key, dict)
        change = ChangeDecoder(schema).decode(payload)
        out.append(Change(h.op, bytes(raw_key), key, change))
    return out


@pytest.mark.parametrize("decode_workers", [0, 1])
async def test_zero_dates_in_keys_are_distinct_rows(
    tmp_path: Path, mysql_server: EmbeddedMariaDB, mysql_db: str, decode_workers: int
) -> None:
    execute(
        mysql_server,
        mysql_db,
        "CREATE TABLE d (k date NOT NULL, n int NOT NULL, PRIMARY KEY (k, n))",
        "CREATE TABLE dt (k datetime(3) NOT NULL PRIMARY KEY, v int)",
        "CREATE TABLE ts (k timestamp NOT NULL DEFAULT 0 PRIMARY KEY, v int)",
    )
    cfg = relay_config(tmp_path, mysql_server, mysql_db, decode_workers=decode_workers)
    async with Relay(cfg) as relay:
        await caught_up(relay, mysql_server, mysql_db)
        execute(
            mysql_server,
            mysql_db,
            ZERO_OK,
            # the first row of its rows event is a zero date; then zero and real dates
            "INSERT INTO d VALUES ('0000-00-00', 1), ('2024-05-01', 1), ('0000-00-00', 2), "
            "('2024-05-00', 1), ('2024-00-00', 1), ('1970-01-01', 1)",
            "INSERT INTO dt VALUES ('0000-00-00 00:00:00', 1), ('2024-05-00 10:00:00.5', 2), "
            "('2024-05-01 10:00:00.5', 3), ('1970-01-01 00:00:00', 4)",
            "INSERT INTO ts VALUES (0, 1), ('2024-05-01 10:00:00', 2)",
            "UPDATE d SET n = 3 WHERE k = '2024-05-00'",
            "DELETE FROM dt WHERE k = '2024-05-00 10:00:00.5'",
        )
        await caught_up(relay, mysql_server, mysql_db)
        d, dt, ts = changes(relay, "d"), changes(relay, "dt"), changes(relay, "ts")
    inserts = [c for c in d if c.op == Op.INSERT]
    assert len(inserts) == 6
    # '0000-00-00'/1 and /2, '2024-05-00', '2024-00-00' and the real dates: distinct keys
    assert len({c.raw_key for c in inserts}) == 6
    zero = [c for c in inserts if c.after["k"] is None]
    assert len(zero) == 4 and all(c.after_not_sent == ["k"] for c in zero)
    # the documented values (docs/mysql.md, Types), as the seeder's helper computes them
    texts = ["0000-00-00", "0000-00-00", "2024-05-00", "2024-00-00"]
    assert [c.key["k"] for c in zero] == [mysql_zero_date_key(t, with_time=False) for t in texts]
    real = [c for c in inserts if c.after["k"] is not None]
    epoch = datetime.date(1970, 1, 1)
    assert [c.key["k"] for c in real] == [(c.after["k"] - epoch).days for c in real]
    assert len({c.key["k"] for c in zero} | {c.key["k"] for c in real}) == 5
    (update,) = [c for c in d if c.op == Op.UPDATE]
    assert update.after["n"] == 3 and update.after_not_sent == ["k"]
    assert update.key == {"k": mysql_zero_date_key("2024-05-00", with_time=False), "n": 3}
    dt_inserts = [c for c in dt if c.op == Op.INSERT]
    assert len({c.raw_key for c in dt_inserts}) == 4
    assert [c.key["k"] for c in dt_inserts[:2]] == [
        mysql_zero_date_key(t, with_time=True)
        for t in ("0000-00-00 00:00:00", "2024-05-00 10:00:00.500")
    ]
    (deleted,) = [c for c in dt if c.op == Op.DELETE]
    assert deleted.raw_key == dt_inserts[1].raw_key and deleted.before["v"] == 2
    ts_inserts = [c for c in ts if c.op == Op.INSERT]
    assert [c.after["v"] for c in ts_inserts] == [1, 2]
    assert ts_inserts[0].raw_key != ts_inserts[1].raw_key
    assert ts_inserts[0].after_not_sent == ["k"]
    assert ts_inserts[0].key["k"] == mysql_zero_date_key("0000-00-00 00:00:00", with_time=True)
