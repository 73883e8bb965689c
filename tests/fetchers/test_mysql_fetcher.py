"""The mysql fetcher feeding a real relay: every type, every op, DDL, rotation, restarts."""

from __future__ import annotations

import datetime
import decimal
import json
import re
import struct
import uuid
from pathlib import Path
from typing import Any

import pytest

from changebus.fetchers.mysql import EmbeddedMariaDB
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.schemas import (
    ChangeDecoder,
    Op,
    SchemaChange,
    SchemaRegistry,
    TableSchema,
    binlog_file_number,
    binlog_to_scn,
    decode_control,
    event_at,
    parse_stream,
    verify_event,
)
from fix_mysql import master_scn, mysql_execute as execute
from waiting import wait_until

pytestmark = pytest.mark.mysql


def relay_config(tmp: Path, server: EmbeddedMariaDB, db: str, **options: Any) -> RelayConfig:
    return RelayConfig(
        data_dir=tmp / "relay",
        http=HttpConfig(port=0),
        partitions=(
            PartitionConfig(
                "my",
                1,
                capacity_bytes=16 << 20,
                fetcher=FetcherConfig("mysql", server.options(databases=[db], **options)),
            ),
        ),
        flush_interval_s=0,
    )


async def caught_up(relay: Relay, server: EmbeddedMariaDB, db: str) -> None:
    """Wait until the relay holds everything committed so far (a marker transaction)."""
    # the marker must change a row: a no-op statement writes nothing to the binlog, and
    # the target position would then lie past the last window the relay can ever hold
    execute(
        server,
        db,
        "CREATE TABLE IF NOT EXISTS marker (id int PRIMARY KEY, n bigint NOT NULL)",
        "INSERT INTO marker VALUES (1, 1) ON DUPLICATE KEY UPDATE n = n + 1",
    )
    # the binlog's end, or the marker's GTID: MariaDB may write a binlog checkpoint event
    # after the last transaction (a FLUSH BINARY LOGS under load), a position no window
    # has; and a fetcher that started after the marker holds the end as its start
    target = master_scn(server)
    conn = server.connect()
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT @@gtid_binlog_pos")
            gtids = str(cur.fetchone()[0])
    finally:
        conn.close()
    domain = gtids.split(",")[0].rsplit("-", 2)
    target_seq = int(domain[2])
    host = relay.hosts["my"]

    def reached() -> bool:
        if host.buffer.meta.last_scn >= target:
            return True
        position = str((host.status().get("fetcher") or {}).get("source_position", ""))
        found = re.search(r"gtid=(\d+)-\d+-(\d+);file=([^;]+);pos=(\d+)", position)
        if found is None or found.group(1) != domain[0] or int(found.group(2)) < target_seq:
            return False
        scn = binlog_to_scn(binlog_file_number(found.group(3)), int(found.group(4)))
        base = int(host.status()["fetcher"].get("scn_base", 0))
        return bool(host.buffer.meta.last_scn >= scn + base)

    await wait_until(reached)


def buffer_bytes(relay: Relay) -> bytes:
    host = relay.hosts["my"]
    sel = host.buffer.select(-1, -1, 1 << 30)
    assert sel is not None
    data = b"".join(bytes(v) for v in sel.views)
    assert host.buffer.release(sel)
    return data


def replay(
    relay: Relay, table: str
) -> tuple[dict[Any, dict[str, Any]], list[int], list[tuple[Op, Any]]]:
    """Rows of ``table`` rebuilt from the buffer, window SCNs, and (op, payload) of every event."""
    data = buffer_bytes(relay)
    registry: SchemaRegistry = relay.hosts["my"].registry
    rows: dict[Any, dict[str, Any]] = {}
    scns: list[int] = []
    events: list[tuple[Op, Any]] = []
    offsets, _ = parse_stream(data)
    for off in offsets.tolist():
        h = verify_event(data, off)
        if h.op == Op.END_OF_WINDOW:
            scns.append(h.scn)
        if h.op.is_control:
            events.append((h.op, decode_control(h.op, event_at(data, off, h)[1])))
            continue
        name = registry.name_for_id(h.source_id)
        schema: TableSchema = registry.get(name, h.schema_version)
        change = ChangeDecoder(schema).decode(event_at(data, off, h)[1])
        events.append((h.op, (name, change)))
        if not name.endswith("." + table):
            continue
        if h.op == Op.TRUNCATE:
            rows.clear()
        elif h.op == Op.DELETE:
            assert change.before is not None
            rows.pop(change.before["id"], None)
        else:
            assert change.after is not None
            if h.op == Op.UPDATE:
                assert change.before is not None
                rows.pop(change.before["id"], None)
            rows[change.after["id"]] = change.after
    return rows, scns, events


def source_rows(server: EmbeddedMariaDB, db: str, table: str) -> dict[Any, dict[str, Any]]:
    import pymysql

    conn = server.connect(db, cursorclass=pymysql.cursors.DictCursor)
    try:
        with conn.cursor() as cur:
            cur.execute(f"SELECT * FROM `{table}`")
            return {r["id"]: dict(r) for r in cur.fetchall()}
    finally:
        conn.close()


# ---- every type --------------------------------------------------------------

TYPES = {
    "ti": ("tinyint", ["-128", "127"]),
    "tiu": ("tinyint unsigned", ["255", "0"]),
    "b1": ("tinyint(1)", ["1", "0"]),
    "si": ("smallint", ["-32768", "32767"]),
    "mi": ("mediumint", ["-8388608", "8388607"]),
    "miu": ("mediumint unsigned", ["16777215", "1"]),
    "i": ("int", ["-2147483648", "2147483647"]),
    "iu": ("int unsigned", ["4294967295", "0"]),
    "bi": ("bigint", ["-9223372036854775808", "9223372036854775807"]),
    "biu": ("bigint unsigned", ["18446744073709551615", "0"]),
    "de": ("decimal(20,6)", ["-12345678901234.567891", "0.000001"]),
    "de0": ("decimal(5,0)", ["-99999", "7"]),
    "de9": ("decimal(30,12)", ["123456789012345678.123456789012", "-0.5"]),
    "fl": ("float", ["0.1", "-3.25e38"]),
    "db": ("double", ["1.5e300", "-0.25"]),
    "bt": ("bit(5)", ["b'10101'", "b'0'"]),
    "bt64": (
        "bit(64)",
        ["b'1111111111111111111111111111111111111111111111111111111111111111'", "b'1'"],
    ),
    "en": ("enum('x','y','z z')", ["'z z'", "'x'"]),
    "st": ("set('a','b','c')", ["'a,c'", "''"]),
    "js": ("json", ['\'{"a": [1, "é"]}\'', "'null'"]),
    "uu": (
        "uuid",
        ["'123e4567-e89b-12d3-a456-426614174000'", "'00000000-0000-0000-0000-000000000001'"],
    ),
    "i6": ("inet6", ["'2001:db8::1'", "'::ffff:1.2.3.4'"]),
    "i4": ("inet4", ["'10.0.0.255'", "'0.0.0.0'"]),
    "da": ("date", ["'2024-02-29'", "'1000-01-01'"]),
    "tm": ("time(3)", ["'-838:59:59.000'", "'12:34:56.789'"]),
    "tm0": ("time", ["'-00:00:01'", "'23:59:59'"]),
    "dt": ("datetime(6)", ["'2024-01-02 03:04:05.123456'", "'1000-01-01 00:00:00'"]),
    "dt2": ("datetime(2)", ["'9999-12-31 23:59:59.99'", "'1970-01-01 00:00:00.01'"]),
    "ts": ("timestamp(6) NULL", ["'2038-01-19 03:14:07.999999'", "'1970-01-01 00:00:01'"]),
    "yr": ("year", ["2155", "1901"]),
    "ch": ("char(4)", ["'ab'", "''"]),
    "vc": ("varchar(300)", ["'héllo 🙂'", "REPEAT('x', 300)"]),
    # MySQL's latin1 holds 0x81, 0x8D, 0x8F, 0x90, 0x9D (Python's cp1252 refused them:
    # the partition stalled on the row); koi8r had no codec under its MySQL name
    "l1": ("varchar(64) CHARACTER SET latin1", ["x'4181428D8F909DE9'", "x'80FF'"]),
    "k8": ("varchar(16) CHARACTER SET koi8r", ["x'C1C2D7'", "''"]),
    "tx": ("mediumtext", ["REPEAT('ü', 20000)", "''"]),
    "bn": ("binary(4)", ["x'01020000'", "x'00'"]),
    "vb": ("varbinary(10)", ["x'00ff'", "x''"]),
    "bl": ("longblob", ["x'deadbeef'", "REPEAT(x'00', 70000)"]),
    "gm": ("point", ["ST_GeomFromText('POINT(1 2)')", "ST_GeomFromText('POINT(-1 0.5)')"]),
}


def expected(name: str, value: Any) -> Any:
    """What a value read back over SQL looks like after the Avro round trip."""
    if value is None:
        return None
    t = TYPES[name][0]
    if t == "float":
        return struct.unpack("<f", struct.pack("<f", value))[0]
    if t.startswith("bit"):
        n = int.from_bytes(value, "big")
        return n - (1 << 64) if n >= 1 << 63 else n
    if t.startswith("set"):
        return sorted(v for v in value.split(",") if v) if isinstance(value, str) else sorted(value)
    if t == "uuid":
        return uuid.UUID(value)
    if t.startswith("time") and not t.startswith("timestamp"):
        return (value.days * 86400 + value.seconds) * 1_000_000 + value.microseconds
    if t.startswith("timestamp"):
        return value.replace(tzinfo=datetime.UTC)
    if t == "bigint unsigned":
        return decimal.Decimal(value)
    if t == "point":
        return value  # MariaDB's internal form: SRID + WKB, same over SQL and binlog
    if isinstance(value, str) and t.startswith("binary"):
        return value.encode()
    return value


async def test_every_type_through_the_relay(
    tmp_path: Path, mysql_server: EmbeddedMariaDB, mysql_db: str
) -> None:
    cols = ", ".join(f"`{n}` {t}" for n, (t, _) in TYPES.items())
    execute(mysql_server, mysql_db, f"CREATE TABLE ty (id int PRIMARY KEY, {cols})")
    async with Relay(relay_config(tmp_path, mysql_server, mysql_db)) as relay:
        await wait_until(lambda: relay.hosts["my"].state == "streaming")
        names = ", ".join(f"`{n}`" for n in TYPES)
        for row in range(2):
            values = ", ".join(v[row] for _, v in TYPES.values())
            execute(
                mysql_server, mysql_db, f"INSERT INTO ty (id, {names}) VALUES ({row + 1}, {values})"
            )
        execute(mysql_server, mysql_db, "INSERT INTO ty (id) VALUES (3)")  # every column NULL
        await caught_up(relay, mysql_server, mysql_db)
        rows, _, events = replay(relay, "ty")
    conn = mysql_server.connect(mysql_db)
    try:
        with conn.cursor() as cur:
            cur.execute("SET time_zone = '+00:00'")
            cur.execute(f"SELECT id, {', '.join(f'`{n}`' for n in TYPES)} FROM ty ORDER BY id")
            server = {r[0]: dict(zip(TYPES, r[1:], strict=True)) for r in cur.fetchall()}
    finally:
        conn.close()
    assert sorted(rows) == [1, 2, 3]
    for key, srow in server.items():
        got = rows[key]
        for name, value in srow.items():
            assert got[name] == expected(name, value), (key, name, got[name], value)
    schema_events = [
        p for op, p in events if op == Op.SCHEMA_CHANGE and isinstance(p, SchemaChange)
    ]
    ty = [s for s in schema_events if s.source.endswith(".ty")]
    assert len(ty) == 1
    columns = {c["name"]: c for c in json.loads(ty[0].schema)["columns"]}
    assert columns["uu"]["source_type"] == "uuid" and columns["js"]["source_type"] == "json", (
        columns["uu"]
    )


def _connect(**settings: Any) -> Any:
    import pymysql

    if "db" in settings:  # PyMySQL deprecates the name mysql-replication uses
        settings["database"] = settings.pop("db")
    return pymysql.connect(**settings)


def test_transcoder_writes_the_bytes_fastavro_writes(
    mysql_server: EmbeddedMariaDB, mysql_db: str
) -> None:
    """The fetcher's binlog-to-Avro transcoder against its decoder + RowEncoder (fastavro)."""
    from pymysqlreplication import BinLogStreamReader
    from pymysqlreplication.row_event import (
        DeleteRowsEvent,
        TableMapEvent,
        UpdateRowsEvent,
        WriteRowsEvent,
    )

    from changebus.fetchers.mysql import compile_decoder, compile_transcoder, layout_from_table_map
    from changebus.schemas import RowEncoder

    cols = ", ".join(f"`{n}` {t}" for n, (t, _) in TYPES.items())
    start = master_scn(mysql_server)
    execute(mysql_server, mysql_db, f"CREATE TABLE ty (id int PRIMARY KEY, {cols})")
    names = ", ".join(f"`{n}`" for n in TYPES)
    for row in range(2):
        values = ", ".join(v[row] for _, v in TYPES.values())
        execute(
            mysql_server, mysql_db, f"INSERT INTO ty (id, {names}) VALUES ({row + 1}, {values})"
        )
    execute(
        mysql_server,
        mysql_db,
        "INSERT INTO ty (id) VALUES (3)",
        "INSERT INTO ty (id, de, de9, da, dt) VALUES (4, -0.000001, -1.000000000001, '0000-00-00', "
        "'0000-00-00 00:00:00')",
        "UPDATE ty SET de = de * -3, bi = bi DIV 2, id = id + 10",
        "DELETE FROM ty WHERE id = 12",
    )
    number, pos = start >> 32, start & 0xFFFFFFFF
    reader = BinLogStreamReader(
        connection_settings={"host": "127.0.0.1", "port": mysql_server.port, "user": "root"},
        server_id=4711,
        blocking=False,
        resume_stream=True,
        log_file=f"mysql-bin.{number:06d}",
        log_pos=pos,
        is_mariadb=False,
        only_events=[TableMapEvent, WriteRowsEvent, UpdateRowsEvent, DeleteRowsEvent],
        only_schemas=[mysql_db],
        pymysql_wrapper=_connect,
    )
    declared = {n: t for n, (t, _) in TYPES.items()}
    checked = 0
    try:
        table = None
        for event in reader:
            if isinstance(event, TableMapEvent):
                layout = layout_from_table_map(event, declared)
                schema = SchemaRegistry().register(layout.table_schema())
                encoder = RowEncoder(schema, source_id=1, partition=1)
                table = (layout, compile_decoder(layout), compile_transcoder(layout))
                continue
            assert table is not None
            layout, decode, transcode = table
            packet = event.packet.packet
            raw, lo, hi = packet._data, packet._position, len(packet._data) - 4
            decoded = decode(raw, lo, hi, 1)
            coded = transcode(raw, lo, hi)
            assert len(decoded) == len(coded)
            old: list[tuple[Any, ...]]
            new: list[tuple[Any, ...]]
            if isinstance(event, UpdateRowsEvent):
                old = [
                    (2, a, b, ans or (), bns or ())
                    for (b, bns), (a, ans) in zip(decoded[0::2], decoded[1::2], strict=True)
                ]
                new = [
                    (2, ak, a, b, ans or (), bns or ())
                    for (_, b, bns), (ak, a, ans) in zip(coded[0::2], coded[1::2], strict=True)
                ]
            elif isinstance(event, DeleteRowsEvent):
                old = [(3, None, r, (), ns or ()) for r, ns in decoded]
                new = [(3, k, None, r, (), ns or ()) for k, r, ns in coded]
            else:
                old = [(1, r, None, ns or (), ()) for r, ns in decoded]
                new = [(1, k, r, None, ns or (), ()) for k, r, ns in coded]
            assert encoder.encode_many_encoded(new, 7, 9) == encoder.encode_many(old, 7, 9)
            checked += len(old)
    finally:
        reader.close()
    assert checked == 4 + 4 + 1  # inserts, updates, delete
