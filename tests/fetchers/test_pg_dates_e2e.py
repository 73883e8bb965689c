"""Dates and timestamps outside Python's range, end to end: Postgres -> fetcher ->
relay buffer -> Avro -> decoded value.

BC dates, years after 9999 and +/-infinity must neither fail the partition nor
reach the consumer as an error. Expected values come from Postgres itself
(day and microsecond counts since 1970 computed by SQL), row by row:

* in Python's years 1-9999: ``date`` / ``datetime`` (aware for timestamptz);
* outside them: the Avro int, days or µs since 1970-01-01 (UTC);
* ``infinity`` / ``-infinity``: ``date.max`` / ``date.min``, ``datetime.max`` / ``.min``;
* a timestamp beyond an Avro long's microseconds (after 294247-01-10): not sent.
"""

from __future__ import annotations

import datetime
import decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest
from test_pg_fetcher import caught_up, wait_until

from changebus.fetchers.postgres import Assembler, TypeResolver, parse_message
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.schemas import ChangeDecoder, Op, event_at, parse_stream, verify_event

pytestmark = pytest.mark.pg

#: (id, d, ts, tz) as Postgres literals
ROWS = [
    (1, "2024-02-29", "2024-02-29 12:34:56.789012", "2024-02-29 12:34:56.789012+00"),
    (2, "0044-03-15 BC", "0044-03-15 10:00:00 BC", "0044-03-15 10:00:00+00 BC"),
    (3, "4713-01-01 BC", "4713-11-24 00:00:00 BC", "4713-11-24 00:00:00+00 BC"),
    (4, "10000-01-01", "10000-01-01 00:00:00.000001", "10000-01-01 00:00:00.000001+00"),
    (5, "5874897-12-31", "294246-12-31 23:59:59.999999", "294246-12-31 23:59:59.999999+00"),
    (6, "infinity", "infinity", "infinity"),
    (7, "-infinity", "-infinity", "-infinity"),
    (8, "0001-01-01", "0001-01-01 00:00:00", "0001-01-01 00:00:00+00"),
    (9, "9999-12-31", "9999-12-31 23:59:59.999999", "9999-12-31 23:59:59.999999+00"),
    (10, "0001-12-31 BC", "294276-12-31 23:59:59.999999", "294276-12-31 23:59:59.999999+00"),
]
TABLE = "id int8 PRIMARY KEY, d date, ts timestamp, tz timestamptz, da date[]"
LONG_MAX = 2**63 - 1


def insert_rows(conn: psycopg.Connection[Any]) -> None:
    for row in ROWS:
        conn.execute(
            "INSERT INTO dates VALUES (%s, %s::date, %s::timestamp, %s::timestamptz, "
            "ARRAY[%s::date, NULL, '2000-01-01'])",
            (*row, row[1]),
        )


def truth(conn: psycopg.Connection[Any]) -> dict[int, dict[str, Any]]:
    """Per row, what the consumer must get (from day / µs counts Postgres computes)."""
    out: dict[int, dict[str, Any]] = {}
    query = (
        "SELECT id, isfinite(d), d > '2000-01-01', CASE WHEN isfinite(d) THEN d - '1970-01-01'::date END, "
        "isfinite(ts), ts > '2000-01-01', "
        "CASE WHEN isfinite(ts) THEN extract(epoch FROM ts) * 1000000 END, "
        "isfinite(tz), tz > '2000-01-01', "
        "CASE WHEN isfinite(tz) THEN extract(epoch FROM tz) * 1000000 END FROM dates"
    )
    for id_, dfin, dpos, days, tsfin, tspos, tsus, tzfin, tzpos, tzus in conn.execute(query):
        out[id_] = {
            "d": want_date(dfin, dpos, days),
            "ts": want_ts(tsfin, tspos, tsus, aware=False),
            "tz": want_ts(tzfin, tzpos, tzus, aware=True),
        }
        out[id_]["da"] = [out[id_]["d"], None, datetime.date(2000, 1, 1)]
    return out


def want_date(finite: bool, positive: bool, days: int | None) -> Any:
    if not finite:
        return datetime.date.max if positive else datetime.date.min
    assert days is not None
    try:
        return datetime.date(1970, 1, 1) + datetime.timedelta(days=days)
    except OverflowError:
        return days  # outside Python's dates: the Avro int


def want_ts(finite: bool, positive: bool, micros: decimal.Decimal | None, *, aware: bool) -> Any:
    if not finite:
        value = datetime.datetime.max if positive else datetime.datetime.min
        return value.replace(tzinfo=datetime.UTC) if aware else value
    assert micros is not None and micros == int(micros)
    us = int(micros)
    if not -LONG_MAX - 1 <= us <= LONG_MAX:
        return "not sent"
    epoch = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC if aware else None)
    try:
        return epoch + datetime.timedelta(microseconds=us)
    except OverflowError:
        return us


async def test_out_of_range_dates_and_infinities_through_the_relay(
    tmp_path: Path, pg_dsn: str
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE dates ({TABLE})")
    cfg = RelayConfig(
        data_dir=tmp_path / "relay",
        http=HttpConfig(port=0),
        partitions=(
            PartitionConfig(
                "pg", 1, capacity_bytes=4 << 20, fetcher=FetcherConfig("postgres", {"dsn": pg_dsn})
            ),
        ),
        flush_interval_s=0,
    )
    async with Relay(cfg) as relay:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            insert_rows(conn)
            want = truth(conn)
        await caught_up(relay, pg_dsn)
        host = relay.hosts["pg"]
        assert host.state == "streaming"  # nothing failed the partition
        sel = host.buffer.select(-1, -1, 1 << 30)
        assert sel is not None
        data = b"".join(bytes(v) for v in sel.views)
        assert host.buffer.release(sel)
        registry = host.registry
    got: dict[int, dict[str, Any]] = {}
    offsets, _ = parse_stream(data)
    for off in offsets.tolist():
        h = verify_event(data, off)
        if h.op not in (Op.INSERT, Op.UPDATE):
            continue
        table = registry.get(registry.name_for_id(h.source_id), h.schema_version)
        decoder = ChangeDecoder(table)
        key, payload = event_at(data, off, h)
        change = decoder.decode(payload)
        assert change.after is not None
        assert decoder.decode_key(key) == {"id": change.after["id"]}
        row = dict(change.after)
        for name in change.after_not_sent:
            row[name] = "not sent"
        got[int(change.after["id"])] = row
    assert set(got) == set(want)
    for id_, row in want.items():
        for name, value in row.items():
            assert got[id_][name] == value, (id_, name, got[id_][name], value)
    # the cases this test is about all occurred
    assert isinstance(got[2]["d"], int) and got[2]["d"] < 0  # BC: days before 1970
    assert got[4]["ts"] == 253_402_300_800_000_001  # 10000-01-01 00:00:00.000001, in µs
    assert got[6]["d"] == datetime.date.max and got[7]["tz"] == datetime.datetime.min.replace(
        tzinfo=datetime.UTC
    )
    assert got[10]["ts"] == got[10]["tz"] == "not sent"


def test_out_of_range_dates_transcode_like_the_general_path(pg_dsn: str) -> None:
    """The transcoder hands these rows to the general path, which writes the same bytes."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE dates ({TABLE})")
        conn.execute("CREATE PUBLICATION pub FOR ALL TABLES")
        conn.execute("SELECT pg_create_logical_replication_slot('s', 'pgoutput')")
        insert_rows(conn)
        conn.execute("UPDATE dates SET d = '2000-01-01'")
        messages = [
            bytes(d)
            for (d,) in conn.execute(
                "SELECT data FROM pg_logical_slot_get_binary_changes('s', NULL, NULL, "
                "'proto_version', '1', 'publication_names', 'pub', 'binary', 'true')"
            )
        ]
        resolver = TypeResolver(conn)
        general = Assembler(1, resolver.resolve, primary_key=resolver.primary_key)
        fast = Assembler(1, resolver.resolve, primary_key=resolver.primary_key)
        want = [w for m in messages if (w := general.feed(parse_message(m))) is not None]
        got = [w for m in messages if (w := fast.feed_raw(m)) is not None]
    assert len(want) == len(got) == len(ROWS) + 1  # one transaction per insert, the update
    assert [w.data for w in want] == [w.data for w in got]
    assert [w.event_sizes for w in want] == [w.event_sizes for w in got]
    # rows 1, 8 and 9 and their updates were transcoded, the others handed back
    assert (fast.rows_transcoded, fast.rows_general) == (6, 14)
    assert fast.rows_transcoded == 6  # rows 1, 8, 9 and their updates
    assert fast.rows_general == 14
