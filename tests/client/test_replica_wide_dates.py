"""Dates and times Python cannot hold reach a replica as the database's own values.

The decoder hands a BC date, a year-10000 timestamp or a 24:00:00 time as the
Avro int (days or microseconds since 1970-01-01, microseconds since
midnight). A Postgres replica bound the int to a date or time column, which
Postgres refused on every retry until the replica gave up; SQLite stored the
number (review). They are written as the text both databases read.
"""

from __future__ import annotations

import datetime
import sqlite3
from pathlib import Path

import pytest
from test_replica_widen import deliver, window

from changebus.client import PostgresReplica, SqliteReplica
from changebus.client._apply_wide import date_text
from changebus.schemas import MYSQL_ZERO_DATE_KEY, Column, TableSchema

SCHEMA = TableSchema(
    "app.dates",
    (
        Column("id", "long", nullable=False),
        Column("d", {"type": "int", "logicalType": "date"}),
        Column("t", {"type": "long", "logicalType": "time-micros"}),
        Column("ts", {"type": "long", "logicalType": "timestamp-micros"}),
        Column("lt", {"type": "long", "logicalType": "local-timestamp-micros"}),
    ),
    ("id",),
    1,
)
DAY_US = 86_400_000_000

# (the values as the decoder hands them: ints outside Python's range, else objects)
WIDE = {
    "id": 1,
    "d": -719_163,  # 0001-12-31 BC, the day before 0001-01-01, in days since 1970-01-01
    "t": DAY_US,  # 24:00:00
    "ts": 2_932_897 * DAY_US + 45_296_789_000,  # 10000-01-01 12:34:56.789 UTC
    "lt": -719_163 * DAY_US,  # 0001-12-31 00:00 BC
}
PLAIN = {
    "id": 2,
    "d": datetime.date(2026, 12, 1),
    "t": datetime.time(23, 59, 59),
    "ts": datetime.datetime(2026, 12, 1, 1, 2, 3, tzinfo=datetime.UTC),
    "lt": datetime.datetime(2026, 12, 1, 1, 2, 3),
}


def test_the_text_of_wide_dates() -> None:
    assert date_text(0) == "1970-01-01"
    assert date_text(-719_162) == "0001-01-01" and date_text(-719_163) == "0001-12-31 BC"
    assert date_text(2_932_897) == "10000-01-01"
    assert date_text(-719_163 - 366, "12:00:00", "+00") == "0002-12-31 12:00:00+00 BC"
    epoch = datetime.date(1970, 1, 1)
    for days in range(-719_162, 2_932_897, 7_919):  # Python's own calendar where it has one
        assert date_text(days) == (epoch + datetime.timedelta(days=days)).isoformat()


@pytest.mark.pg
async def test_a_postgres_replica_stores_wide_dates_and_times(pg_dsn: str) -> None:
    import psycopg

    replica = PostgresReplica(pg_dsn)
    try:
        await deliver(replica, window(10, SCHEMA, WIDE))
        await deliver(replica, window(11, SCHEMA, PLAIN))
    finally:
        await replica.close()
    with psycopg.connect(pg_dsn) as conn:
        # Postgres' own figures of the same values: the ints the decoder hands
        ints = conn.execute(
            "SELECT '0001-12-31 BC'::date - '1970-01-01'::date,"
            " (extract(epoch FROM '10000-01-01 12:34:56.789+00'::timestamptz) * 1e6)::bigint,"
            " (extract(epoch FROM '0001-12-31 00:00:00 BC'::timestamp) * 1e6)::bigint"
        ).fetchone()
        assert ints == (WIDE["d"], WIDE["ts"], WIDE["lt"])
        row = conn.execute(
            "SELECT d = '0001-12-31 BC'::date, t = '24:00:00'::time,"
            " ts = '10000-01-01 12:34:56.789+00'::timestamptz,"
            " lt = '0001-12-31 00:00:00 BC'::timestamp FROM app.dates WHERE id = 1"
        ).fetchone()
        assert row == (True, True, True, True)
        plain = conn.execute("SELECT d, t, lt FROM app.dates WHERE id = 2").fetchone()
        assert plain == (PLAIN["d"], PLAIN["t"], PLAIN["lt"])


async def test_a_sqlite_replica_stores_wide_dates_as_text(tmp_path: Path) -> None:
    replica = SqliteReplica(tmp_path / "r.db")
    zero_key = {**WIDE, "id": 3, "d": MYSQL_ZERO_DATE_KEY + 1}  # (left as it is)
    try:
        await deliver(replica, window(10, SCHEMA, WIDE))
        await deliver(replica, window(11, SCHEMA, zero_key))
    finally:
        await replica.close()
    with sqlite3.connect(tmp_path / "r.db") as conn:
        rows = conn.execute("SELECT id, d, t, ts, lt FROM app_dates ORDER BY id").fetchall()
    assert rows[0] == (
        1,
        "0001-12-31 BC",
        "24:00:00",
        "10000-01-01 12:34:56.789000+00",
        "0001-12-31 00:00:00.000000 BC",
    )
    assert int(rows[1][1]) == MYSQL_ZERO_DATE_KEY + 1  # (not made a date)
