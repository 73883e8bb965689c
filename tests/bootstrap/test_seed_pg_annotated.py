"""A Postgres seed of a table whose relay version predates the type annotations.

Since the postgres fetcher records ``changebus.kind`` / ``changebus.bound``
in the Avro types of composite and range (multirange) columns, the seed's
Assembler made them too: a schema other than the relay's newest version (a
relay not upgraded yet, or one that has seen no change of the table since),
and the seed failed, retriably, for ever, with "changed since the relay's
newest schema version" (review). The annotations change no value: the seed
is written under the relay's version, the same bytes, and the bootstrap
store equals the source row by row.

The relay's registry is made to hold such a version at its newest: the one
the relay registered, its annotations stripped, registered again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest
from boot_e2e import bootstrap_caught_up, sync_marker
from snap_pg_support import (
    RecordingSink,
    assert_same,
    boot_config,
    relay_request,
    seed_and_wait,
    store_rows,
    streaming_relay,
)

from changebus.bootstrap import BootstrapServer, SeedProgress, seed_postgres
from changebus.schemas import (
    ChangeDecoder,
    Column,
    TableSchema,
    decode_header,
    event_at,
    verify_event,
)

pytestmark = [pytest.mark.pg, pytest.mark.usefixtures("no_blocking")]

_NOTES = ("changebus.kind", "changebus.bound")
_COLS = ["id", "r", "c", "rs", "m", "v"]
#: (the store's rows are compared without the array: snap_pg_support.store_rows takes none)
_STORE_COLS = ["id", "r", "c", "m", "v"]


def _stripped(t: Any) -> Any:
    """An Avro type as a fetcher before the annotations registered it."""
    if isinstance(t, list):
        return [_stripped(b) for b in t]
    if not isinstance(t, dict):
        return t
    out = {k: _stripped(v) for k, v in t.items() if k not in _NOTES}
    return out


def _annotated(schema: TableSchema) -> bool:
    return any(n in repr(c.type) for c in schema.columns for n in _NOTES)


def _source(dsn: str, cols: list[str]) -> set[tuple[Any, ...]]:
    """The source's rows in ``cols``, each value as the stream gives it (the text of a
    range or composite, a list of texts)."""
    text = {
        "rs": "(SELECT array_agg(x::text ORDER BY o) FROM unnest(rs) WITH ORDINALITY u(x, o))",
        "r": "r::text",
        "c": "c::text",
        "m": "m::text",
    }
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(f"SELECT {', '.join(text.get(c, c) for c in cols)} FROM rc").fetchall()
    return _plain(rows)


def _plain(rows: Iterable[Sequence[Any]]) -> set[tuple[Any, ...]]:
    """``rows`` as a set of tuples (lists as tuples)."""
    return {tuple(tuple(x) if isinstance(x, list) else x for x in r) for r in rows}


async def test_a_relay_version_without_annotations_is_seeded_under_it(
    tmp_path: Path, pg_dsn: str
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TYPE pair AS (a int4, b text)")
        conn.execute(
            "CREATE TABLE rc (id int8 PRIMARY KEY, r int4range, c pair, rs int4range[], "
            "m int4multirange, v text)"
        )
        conn.execute(
            "INSERT INTO rc SELECT g, CASE WHEN g % 5 = 0 THEN NULL WHEN g % 7 = 0 THEN "
            "'empty'::int4range ELSE int4range(g, g + 10) END, ROW(g, 'x,' || g)::pair, "
            "ARRAY[int4range(g, NULL), int4range(NULL, g)], "
            "int4multirange(int4range(1, g), int4range(g + 5, g + 9)), 'v' || g "
            "FROM generate_series(1, 60) g"
        )
    store_db = tmp_path / "boot" / "b.db"
    async with streaming_relay(tmp_path, pg_dsn, "UPDATE rc SET v = v WHERE id = 1") as relay:
        reg = relay.hosts["pg"].registry
        annotated = reg.latest("public.rc")
        assert _annotated(annotated)  # (else this test tests nothing)
        # the relay's newest version as a fetcher before the annotations made it
        old = reg.register(
            TableSchema(
                annotated.name,
                tuple(
                    Column(c.name, _stripped(c.type), c.nullable, c.source_type, c.policy)
                    for c in annotated.columns
                ),
                annotated.key,
                nullable_key=annotated.nullable_key,
            )
        )
        assert old.version == annotated.version + 1 and not _annotated(old)
        versions = len(reg.versions("public.rc"))

        # the seed alone: it finishes, every event of the relay's version, byte for byte
        sink = RecordingSink()
        await asyncio.to_thread(
            seed_postgres,
            relay_request(relay, pg_dsn, "public.rc", chunk_rows=7),
            lambda *_: None,
            SeedProgress(),
            sink=sink,
        )
        assert sink.finished and len(sink.chunks) >= 8
        events = [ev for c in sink.chunks for ev in c.events]
        assert len(events) == 60
        decoder = ChangeDecoder(old)
        seeded: list[list[Any]] = []
        for ev in events:
            h = decode_header(ev)
            assert (h.schema_version, h.schema_id) == (old.version, old.fingerprint)
            change = decoder.decode(bytes(event_at(ev, 0, verify_event(ev, 0))[1]))
            assert change.after is not None
            seeded.append([change.after[k] for k in _COLS])
        assert_same(_plain(seeded), _source(pg_dsn, _COLS), "seeded rows")
        assert len(reg.versions("public.rc")) == versions  # no version made

        # the bootstrap server's seed: done, and its store equals the source
        async with BootstrapServer(boot_config(tmp_path, relay.url, pg_dsn, 9)) as boot:
            await bootstrap_caught_up(boot, sync_marker(pg_dsn))
            seed = await seed_and_wait(boot, ["public.rc"])
            assert seed.tables_done == 1
            await bootstrap_caught_up(boot, sync_marker(pg_dsn))
            got = store_rows(store_db, "public.rc", _STORE_COLS)
            assert_same(got, _source(pg_dsn, _STORE_COLS), "store")
            assert len(got) == 60
        assert len(reg.versions("public.rc")) == versions
