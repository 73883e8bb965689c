"""Writer-schema cache and window decoding.

:class:`SchemaCache` maps ``(source_id, schema_version)`` -- what an event
header names -- to the writer's :class:`~changebus.schemas.TableSchema`.
It learns schemas two ways: from SCHEMA_CHANGE events in the stream (free),
and from the relay (``GET /v1/sources`` for id -> name, then
``GET /v1/schemas/{source}``) through a :class:`SchemaSource` when an event
names a version it has not seen (a consumer that starts after the
SCHEMA_CHANGE). Source ids are per relay partition, so the fetcher clears the
cache when it switches relays. Every group of events is checked against the
fingerprint its header carries (``schema_id``): a schema known under the same
numbers but with another fingerprint is asked for again, and a stream that
still disagrees is refused (:meth:`SchemaCache.writer`).

Decoders (:class:`~changebus.schemas.ChangeDecoder`) are cached by writer
and reader: with a reader schema (``ConsumerConfig.reader_schemas``, checked
with :func:`~changebus.schemas.check_compatible` once per writer version, or
the newest version with ``resolve_latest``, which asks the relay for every
version of a source once) rows come out in the
reader's shape under Avro resolution rules.

:func:`decode_window` turns a :class:`~._assembler.RawWindow` into a
:class:`~._model.Window`: data events grouped by writer version and decoded
in one pass per group, control events decoded into the window's signals.

Not thread-safe: owned by one fetcher task.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any, Protocol

from changebus.schemas import (
    FIRST_CONTROL_OP,
    HEADER_SIZE,
    ChangeDecoder,
    CheckpointMarker,
    CorruptEventError,
    DataLoss,
    EndOfWindow,
    Heartbeat,
    IncompatibleSchemaError,
    LogicalMessage,
    SchemaChange,
    SchemaChangedError,
    TableSchema,
    UnknownSchemaError,
    check_compatible,
    decode_control,
    same_column_type,
)

from ._assembler import RawWindow
from ._model import _FROM_OP, ChangeEvent, RawEvents, Window, _EventTwin

__all__ = ["SchemaCache", "SchemaSource", "decode_window", "same_columns"]

log = logging.getLogger(__name__)


class SchemaSource(Protocol):
    """Where the cache fetches what the stream did not tell it (a relay)."""

    async def source_names(self) -> dict[int, str]:
        """``{source_id: name}`` of the partition."""
        ...

    async def source_schemas(self, name: str) -> list[tuple[int, TableSchema]]:
        """Every version of source ``name`` as ``(source_id, schema)``."""
        ...


class SchemaCache:
    """Writer schemas by ``(source_id, version)``, and decoders (module docstring)."""

    def __init__(
        self,
        readers: Mapping[str, TableSchema] | None = None,
        *,
        resolve_latest: bool = False,
        refuse_newer: bool = False,
    ) -> None:
        self._readers = dict(readers or {})
        self._resolve_latest = resolve_latest
        self._refuse_newer = refuse_newer
        self._schemas: dict[tuple[int, int], TableSchema] = {}
        self._names: dict[int, str] = {}
        self._latest: dict[str, TableSchema] = {}
        self._decoders: dict[tuple[int, int], ChangeDecoder] = {}
        #: the keys of ``_decoders`` by writer table name (to drop a table's at once)
        self._decoder_keys: dict[str, list[tuple[int, int]]] = {}
        self._complete: set[str] = set()  # sources whose versions were all fetched
        self.fetches = 0

    @classmethod
    def for_config(cls, config: Any) -> SchemaCache:
        """The cache a consumer's ``config`` (a :class:`~._config.ConsumerConfig`) asks for."""
        return cls(
            config.reader_schemas,
            resolve_latest=config.resolve_latest,
            refuse_newer=config.refuse_newer_writers,
        )

    def clear(self) -> None:
        """Forget everything (source ids differ between relays)."""
        self._schemas.clear()
        self._names.clear()
        self._latest.clear()
        self._decoders.clear()
        self._decoder_keys.clear()
        self._complete.clear()

    def add(self, source_id: int, schema: TableSchema) -> None:
        """Record one writer schema version.

        A different schema under a known ``(source_id, version)`` (a relay whose
        registry was rebuilt and numbered afresh) replaces it and its decoder: the
        decoder kept decoded the new bytes with the old columns (found by review).
        """
        key = (source_id, schema.version)
        known = self._schemas.get(key)
        if known is not None and known.fingerprint != schema.fingerprint:
            self._decoders.pop(key, None)
        self._schemas[key] = schema
        self._names[source_id] = schema.name
        newest = self._latest.get(schema.name)
        if newest is None or schema.version > newest.version:
            self._latest[schema.name] = schema
            if self._resolve_latest:
                # decoders resolving to the previous newest must be rebuilt (found by
                # name: a scan of every decoder made each add cost what the tables are many)
                for k in self._decoder_keys.pop(schema.name, ()):
                    self._decoders.pop(k, None)

    def learn(self, change: SchemaChange) -> None:
        """Record the schema a SCHEMA_CHANGE event carries."""
        schema = TableSchema.from_json(json.loads(change.schema))
        if schema.version != change.version or schema.name != change.source:
            schema = schema.with_version(change.version)
        self.add(change.source_id, schema)

    async def writer(
        self, source_id: int, version: int, source: SchemaSource, schema_id: int | None = None
    ) -> TableSchema:
        """The writer schema an event names, fetched from ``source`` when unknown.

        ``schema_id``: the fingerprint the event's header carries. A schema known
        under ``(source_id, version)`` with another fingerprint is asked for again
        once (the relay's registry was rebuilt and numbered afresh since it was
        learnt); a :class:`CorruptEventError` when the answer does not match it
        either: decoding with it would read the row's bytes as other columns.
        """
        key = (source_id, version)
        found = self._schemas.get(key)
        if found is not None and schema_id is not None and found.fingerprint != schema_id:
            log.info(
                "source id %d v%d: events name another schema than the one known; asking again",
                source_id,
                version,
            )
            self._forget(found.name)
            self._names.pop(source_id, None)
            found = None
        if found is not None:
            if self._resolve_latest and found.name not in self._complete:
                await self._fetch_versions(found.name, source)  # to know the newest
            return found
        name = self._names.get(source_id)
        if name is None:
            self.fetches += 1
            self._names.update(await source.source_names())
            name = self._names.get(source_id)
            if name is None:
                raise UnknownSchemaError(f"the relay knows no source with id {source_id}")
        await self._fetch_versions(name, source)
        found = self._schemas.get(key)
        if found is None:
            raise UnknownSchemaError(f"the relay has no version {version} of source {name!r}")
        if schema_id is not None and found.fingerprint != schema_id:
            raise CorruptEventError(
                f"events of source {name!r} (id {source_id}) version {version} name schema"
                f" {schema_id:016x}, but the relay's version {version} is {found.fingerprint:016x}"
            )
        log.debug("fetched writer schema %s v%d", name, version)
        return found

    def _forget(self, name: str) -> None:
        """Drop every version of table ``name``, its newest and its decoders (a registry
        rebuilt and numbered afresh: the newest kept could be a number the new one has
        not reached, and ``resolve_latest`` resolved to it, dropping new columns)."""
        for key in [k for k, s in self._schemas.items() if s.name == name]:
            del self._schemas[key]
            self._decoders.pop(key, None)
        for key in self._decoder_keys.pop(name, ()):
            self._decoders.pop(key, None)
        self._latest.pop(name, None)
        self._complete.discard(name)

    async def _fetch_versions(self, name: str, source: SchemaSource) -> None:
        self.fetches += 1
        for sid, schema in await source.source_schemas(name):
            self.add(sid, schema)
        self._complete.add(name)

    def latest(self, name: str) -> TableSchema | None:
        """The newest version of ``name`` seen so far."""
        return self._latest.get(name)

    def decoder(self, source_id: int, writer: TableSchema) -> ChangeDecoder:
        """A decoder from ``writer`` to this consumer's reader schema for its table."""
        key = (source_id, writer.version)
        dec = self._decoders.get(key)
        if dec is not None:
            return dec
        reader = self._readers.get(writer.name)
        if reader is not None:
            if (
                self._refuse_newer
                and writer.version > reader.version
                and not same_columns(reader, writer)
            ):
                raise SchemaChangedError(
                    f"a row of {writer.name} has schema version {writer.version}, newer than"
                    f" the reader's {reader.version}, with other columns: reading it into the"
                    " reader's shape would lose them; start again with the new schema",
                    table=writer.name,
                    reader_version=reader.version,
                    writer_version=writer.version,
                )
            check_compatible(writer, reader)
        elif self._resolve_latest:
            reader = self._latest.get(writer.name)
            if reader is not None and reader.version == writer.version:
                reader = None
            if reader is not None:
                try:
                    check_compatible(writer, reader)
                except IncompatibleSchemaError as exc:
                    # (resolved anyway, its rows failed as corrupt, or came with another
                    # type: a numeric read as bytes; found by review) its own shape instead
                    log.warning(
                        "%s v%d cannot be read as v%d (%s): its rows come in their own shape",
                        writer.name,
                        writer.version,
                        reader.version,
                        exc.message,
                    )
                    reader = None
        dec = self._decoders[key] = ChangeDecoder(writer, reader)
        self._decoder_keys.setdefault(writer.name, []).append(key)
        return dec


def same_columns(a: TableSchema, b: TableSchema) -> bool:
    """Whether rows of ``b`` read into ``a`` by Avro resolution come out exactly as written
    (the same column names, types and nullability, in order). Types that differ only in
    annotations (:func:`~changebus.schemas.same_column_type`: the ``changebus.kind`` a
    Postgres fetcher began to record) are the same: such a version stopped every Spark
    stream reading the table once (review)."""
    return len(a.columns) == len(b.columns) and all(
        x.name == y.name and x.nullable == y.nullable and same_column_type(x.type, y.type)
        for x, y in zip(a.columns, b.columns, strict=True)
    )


async def decode_window(
    raw: RawWindow,
    partition: str,
    cache: SchemaCache,
    source: SchemaSource,
    *,
    columnar: bool = False,
) -> Window:
    """Decode a validated raw window (see the module docstring).

    With ``columnar`` the data events are not decoded: the window carries
    them as :class:`~._model.RawEvents`, with the decoder of each writer
    schema they name (fetched like the row path fetches them).

    The header columns are taken out of numpy once as Python lists: a window
    holds a handful of events, and per-window numpy calls (each ~1 us) would
    cost more than the events themselves.
    """
    headers = raw.headers
    ops = headers["op"].tolist()
    offs = raw.offsets.tolist()
    totals = headers["total_length"].tolist()
    body = raw.body
    mv = memoryview(body)
    schema_changes: list[SchemaChange] = []
    messages: list[LogicalMessage] = []
    data_loss: DataLoss | None = None
    source_position = ""
    data_idx: list[int] = []
    for i, op in enumerate(ops):
        if op < FIRST_CONTROL_OP:
            data_idx.append(i)
            continue
        off = offs[i]
        control = decode_control(op, mv[off + HEADER_SIZE : off + totals[i]])
        if isinstance(control, SchemaChange):
            cache.learn(control)
            schema_changes.append(control)
        elif isinstance(control, EndOfWindow | Heartbeat):
            source_position = control.source_position or source_position
        elif isinstance(control, DataLoss):
            data_loss = control
        elif isinstance(control, LogicalMessage):
            messages.append(control)
        elif isinstance(control, CheckpointMarker):
            pass  # bootstrap progress markers mean nothing online
    events: list[ChangeEvent] = []
    raw_events: RawEvents | None = None
    if data_idx and columnar:
        raw_events = await _raw_events(raw, data_idx, cache, source)
    elif data_idx:
        events = await _decode_data(raw, data_idx, ops, offs, totals, cache, source)
    return Window(
        scn=raw.scn,
        timestamp_ns=raw.timestamp_ns,
        partition=partition,
        events=tuple(events),
        source_position=source_position,
        schema_changes=tuple(schema_changes),
        messages=tuple(messages),
        data_loss=data_loss,
        nbytes=raw.nbytes,
        raw_events=raw_events,
    )


async def _raw_events(
    raw: RawWindow, idx: list[int], cache: SchemaCache, source: SchemaSource
) -> RawEvents:
    """The data events ``idx`` of ``raw`` undecoded, with their writers' decoders."""
    if len(idx) == len(raw.offsets):
        headers, offsets = raw.headers, raw.offsets
    elif idx[-1] - idx[0] + 1 == len(idx):  # one run (the usual case): views, no copies
        headers, offsets = raw.headers[idx[0] : idx[-1] + 1], raw.offsets[idx[0] : idx[-1] + 1]
    else:
        headers, offsets = raw.headers[idx], raw.offsets[idx]
    decoders: dict[tuple[int, int], ChangeDecoder] = {}
    for sid, version, schema_id in set(
        zip(
            headers["source_id"].tolist(),
            headers["schema_version"].tolist(),
            headers["schema_id"].tolist(),
            strict=True,
        )
    ):
        writer = await cache.writer(sid, version, source, schema_id)
        decoders[(sid, version)] = cache.decoder(sid, writer)
    return RawEvents(raw.body, offsets, headers, decoders)


def _key_bytes(dec: ChangeDecoder, mv: memoryview, off: int, klen: int) -> dict[str, Any]:
    return dec.decode_key(mv[off + HEADER_SIZE : off + HEADER_SIZE + klen])


async def _decode_data(
    raw: RawWindow,
    idx: list[int],
    ops: list[int],
    offs: list[int],
    totals: list[int],
    cache: SchemaCache,
    source: SchemaSource,
) -> list[ChangeEvent]:
    """The data events ``idx`` of ``raw``, decoded in one pass per writer schema."""
    h = raw.headers
    klens = h["key_length"].tolist()
    sids = h["source_id"].tolist()
    versions = h["schema_version"].tolist()
    seqs = h["seq"].tolist()
    first = idx[0]
    sid0, version0 = sids[first], versions[first]
    groups: dict[tuple[int, int], list[int]]
    if all(sids[i] == sid0 and versions[i] == version0 for i in idx):
        groups = {(sid0, version0): idx}  # the common case: one table, one version
    else:
        groups = {}
        for i in idx:
            groups.setdefault((sids[i], versions[i]), []).append(i)
    events: dict[int, ChangeEvent] = {}
    body = raw.body
    mv = memoryview(body)
    scn, ts = raw.scn, raw.timestamp_ns
    twin = _EventTwin
    from_op = _FROM_OP
    schema_ids = h["schema_id"]
    for (sid, version), members in groups.items():
        # (the group's first event's fingerprint: a rebuilt registry renumbers whole
        # tables; one event's own bytes are the CRC's business)
        writer = await cache.writer(sid, version, source, int(schema_ids[members[0]]))
        dec = cache.decoder(sid, writer)
        starts = [offs[i] + HEADER_SIZE + klens[i] for i in members]
        stops = [offs[i] + totals[i] for i in members]
        changes = dec.decode_many(body, starts, stops)
        key_cols = writer.key
        single = key_cols[0] if len(key_cols) == 1 else None
        shape = dec.reader
        name = shape.name
        for i, (after, before, after_ns, before_ns) in zip(members, changes, strict=True):
            # the key columns are in the row image (after; before for a delete):
            # taking them from there saves decoding the key bytes a second time
            key: dict[str, Any] | None = None
            if after is not None:
                image = None if after_ns else after
            else:
                image = before
            if image is not None:
                if single is not None:
                    value = image.get(single)
                    if value is not None:
                        key = {single: value}
                elif all(image.get(k) is not None for k in key_cols):
                    key = {k: image[k] for k in key_cols}
            if key is None:
                key = _key_bytes(dec, mv, offs[i], klens[i]) if klens[i] else {}
            # a ChangeEvent built through its mutable twin (see _model._EventTwin)
            event: Any = twin(
                scn,
                seqs[i],
                from_op[ops[i]],
                name,
                key,
                after,
                before,
                after_ns,
                before_ns,
                ts,
                sid,
                version,
                shape,
            )
            event.__class__ = ChangeEvent
            events[i] = event
    if len(groups) == 1:
        return list(events.values())
    return [events[i] for i in idx]
