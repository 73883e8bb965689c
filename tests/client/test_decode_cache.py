"""The client's schema cache: with ``resolve_latest`` a newer version of a table rebuilds
that table's decoders (to resolve to it), and only that table's; an add finds them by
name (a scan of every decoder made each add cost what the tables are many)."""

from __future__ import annotations

from changebus.client._decode import SchemaCache
from changebus.schemas import Column, TableSchema


def _table(name: str, version: int) -> TableSchema:
    cols = [Column("id", "long", nullable=False)]
    cols += [Column(f"c{i}", "string") for i in range(1, version)]
    return TableSchema(name, tuple(cols), ("id",), version)


def test_a_newer_version_rebuilds_only_its_tables_decoders() -> None:
    cache = SchemaCache(resolve_latest=True)
    for sid in range(1, 301):
        cache.add(sid, _table(f"s.t{sid}", 1))
    first = {sid: cache.decoder(sid, _table(f"s.t{sid}", 1)) for sid in range(1, 301)}
    cache.add(7, _table("s.t7", 2))
    again = {sid: cache.decoder(sid, _table(f"s.t{sid}", 1)) for sid in range(1, 301)}
    assert again[7] is not first[7]
    assert again[7].reader.version == 2 and first[7].reader.version == 1
    assert all(again[sid] is first[sid] for sid in range(1, 301) if sid != 7)
    assert len(cache._decoder_keys["s.t7"]) == 1
    cache.clear()
    assert not cache._decoder_keys and cache.latest("s.t7") is None


def test_a_reader_with_a_fixed_schema_refuses_rows_of_a_newer_shape() -> None:
    """The Spark source's executors decoded rows of a version newer than the driver
    planned with into the query's schema: the new columns were dropped, silently
    (review: a range whose start was evicted after planning comes from a snapshot at
    the newest versions). With ``refuse_newer`` such a row stops the read."""
    import pytest

    from changebus.schemas import SchemaChangedError

    v1, v2 = _table("s.t", 1), _table("s.t", 2)
    cache = SchemaCache({"s.t": v1}, refuse_newer=True)
    assert cache.decoder(1, v1).reader is v1  # its own version, and older ones: as before
    with pytest.raises(SchemaChangedError) as info:
        cache.decoder(1, v2)  # a column more
    assert info.value.retriable and info.value.details["writer_version"] == 2
    same = TableSchema("s.t", v1.columns, ("id",), 3)  # a newer version, same columns
    assert cache.decoder(1, same).reader is v1
    # without the option rows are resolved into the reader's shape, as before
    assert SchemaCache({"s.t": v1}).decoder(1, v2).reader is v1


def test_another_schema_under_a_known_id_and_version_replaces_its_decoder() -> None:
    """A relay whose registry was rebuilt numbers its tables afresh: the cache took the
    new schema under a known (source id, version) but kept the old decoder, which read
    the new rows with the old columns (review)."""
    cache = SchemaCache()
    first = _table("s.a", 3)
    cache.add(1, first)
    old = cache.decoder(1, first)
    other = TableSchema("s.b", (Column("key", "string", nullable=False),), ("key",), 3)
    cache.add(1, other)
    new = cache.decoder(1, other)
    assert new is not old and [c.name for c in new.writer.columns] == ["key"]
    cache.add(1, other)  # the same schema again: the decoder stays
    assert cache.decoder(1, other) is new


class _Registry:
    """A relay's registry as the cache sees it (the SchemaSource protocol): ``schemas``
    are its answers, ``asked`` counts the questions."""

    def __init__(
        self, schemas: dict[int, TableSchema], older: list[TableSchema] | None = None
    ) -> None:
        self.schemas = schemas
        self.older = older or []  # (earlier versions of the same source id)
        self.asked = 0

    async def source_names(self) -> dict[int, str]:
        self.asked += 1
        return {sid: s.name for sid, s in self.schemas.items()}

    async def source_schemas(self, name: str) -> list[tuple[int, TableSchema]]:
        self.asked += 1
        found = [(sid, s) for sid, s in self.schemas.items() if s.name == name]
        return [(sid, s) for sid, _ in found for s in self.older] + found


async def test_events_naming_another_schema_than_the_known_one_are_not_decoded_with_it() -> None:
    """An event header carries its writer's fingerprint (``schema_id``); the cache looked
    schemas up by (source id, version) alone, so rows written after a relay's registry
    was rebuilt (its tables numbered afresh) were read with the old columns (review)."""
    import pytest

    from changebus.client._assembler import RawWindow
    from changebus.client._decode import decode_window
    from changebus.schemas import (
        CorruptEventError,
        EndOfWindow,
        Op,
        RowEncoder,
        encode_control,
        parse_stream,
    )

    old = TableSchema("s.a", (Column("id", "long", nullable=False),), ("id",), 1)
    new = TableSchema(
        "s.b", (Column("k", "string", nullable=False), Column("n", "long")), ("k",), 1
    )
    enc = RowEncoder(new, source_id=1, partition=1)
    data = enc.encode(Op.INSERT, 50, 0, 7, {"k": "x", "n": 5}, None) + encode_control(
        EndOfWindow(1, "p"), 50, 1, 7, partition=1
    )
    offsets, headers = parse_stream(data)

    def raw() -> RawWindow:
        return RawWindow(50, 7, data, offsets, headers)

    cache = SchemaCache()
    cache.add(1, old)
    registry = _Registry({1: new})
    window = await decode_window(raw(), "p", cache, registry)
    assert registry.asked == 2  # asked again: names, then the versions
    (event,) = window.events
    assert event.table == "s.b" and event.after == {"k": "x", "n": 5}
    window = await decode_window(raw(), "p", cache, registry)  # known now: not asked again
    assert registry.asked == 2 and window.events[0].after == {"k": "x", "n": 5}
    # a registry that still answers with the old schema: refused, not read as its columns
    cache = SchemaCache()
    cache.add(1, old)
    with pytest.raises(CorruptEventError, match="name schema"):
        await decode_window(raw(), "p", cache, _Registry({1: old}))
    # the columnar path checks them the same way
    cache = SchemaCache()
    cache.add(1, old)
    with pytest.raises(CorruptEventError):
        await decode_window(raw(), "p", cache, _Registry({1: old}), columnar=True)


def test_resolve_latest_reads_an_incompatible_version_in_its_own_shape() -> None:
    """resolve_latest resolved every version to the newest without check_compatible: an
    int column that became text failed its old rows as corrupt, and a plain numeric that
    became numeric(10,2) came as bytes in old rows, as Decimal in new ones (review)."""
    v1 = TableSchema("s.t", (Column("id", "long", nullable=False), Column("n", "int")), ("id",), 1)
    v2 = TableSchema(
        "s.t", (Column("id", "long", nullable=False), Column("n", "string")), ("id",), 2
    )
    v3 = TableSchema(
        "s.t",
        (Column("id", "long", nullable=False), Column("n", "string"), Column("x", "long")),
        ("id",),
        3,
    )
    cache = SchemaCache(resolve_latest=True)
    for v in (v1, v2, v3):
        cache.add(1, v)
    assert cache.decoder(1, v1).reader is v1  # int cannot be read as string: its own shape
    assert cache.decoder(1, v2).reader is v3  # a column added: resolved as before


async def test_a_renumbered_registry_leaves_no_stale_newest_version() -> None:
    """After a registry was rebuilt and numbered afresh, the cache kept the old numbering's
    newest (v3) as the table's latest, and resolve_latest read the new v2's rows into it,
    dropping the column only the new v2 has (review)."""
    from changebus.client._assembler import RawWindow
    from changebus.client._decode import decode_window
    from changebus.schemas import EndOfWindow, Op, RowEncoder, encode_control, parse_stream

    def version(names: str, number: int) -> TableSchema:
        cols = [Column("id", "long", nullable=False)] + [Column(c, "string") for c in names]
        return TableSchema("s.t", tuple(cols), ("id",), number)

    cache = SchemaCache(resolve_latest=True)
    for number, names in ((1, "a"), (2, "ab"), (3, "abc")):
        cache.add(1, version(names, number))
    new_v1, new_v2 = version("abc", 1), version("abcd", 2)
    enc = RowEncoder(new_v2, source_id=1, partition=1)
    row = {"id": 1, "a": "A", "b": "B", "c": "C", "d": "D"}
    data = enc.encode(Op.INSERT, 50, 0, 7, row, None) + encode_control(
        EndOfWindow(1, "p"), 50, 1, 7, partition=1
    )
    offsets, headers = parse_stream(data)
    window = await decode_window(
        RawWindow(50, 7, data, offsets, headers), "p", cache, _Registry({1: new_v2}, [new_v1])
    )
    assert window.events[0].after == row
    latest = cache.latest("s.t")
    assert latest is not None and latest.fingerprint == new_v2.fingerprint
