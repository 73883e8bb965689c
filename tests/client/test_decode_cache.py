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
