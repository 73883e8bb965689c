"""Columnar decoding: data events straight into Arrow record batches.

:class:`ArrowDecoder` is the bulk counterpart of decoding windows into
:class:`~changebus.client.ChangeEvent` objects and feeding them to
:class:`~._arrow.BatchBuilder`: it hands the events' payloads to
:meth:`ChangeDecoder.decode_columns <changebus.schemas.ChangeDecoder.decode_columns>`
(a reader generated per schema that appends each value to its column's list,
no dict per row), turns each column into one Arrow array, and lays out the
rows with one ``take`` per column. The output is the Spark source's column
layout (see :mod:`._arrow`) and equals, value for value, what
:class:`~._arrow.BatchBuilder` makes of the same events
(``tests/client/test_spark_columns.py``).

How a batch is laid out: the payloads of ``n`` events of one writer schema
give, per column, ``n`` after-image values then ``n`` before-image values
(None where an image is absent), then the values of the few rows no image
holds (a delete without a before-image: its key; a truncate: an all-null
row). Each output row is an index into that: an insert its after-image, an
update its before-image (``update_preimage``, when wanted and present) and
its after-image, a delete its before-image or key row, a truncate the null
row. Columns of an update's after-image the source did not send (Postgres'
unchanged TOAST) index the before-image instead, when it has them. Per event
only the index and the metadata values are Python work; per value none
beyond the generated reader.

Not thread-safe: a decoder belongs to one thread (one Spark task).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, NamedTuple, TypeAlias

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from changebus.schemas import FIRST_CONTROL_OP, HEADER_SIZE, ChangeDecoder, Op

from .._consumer import Consumer
from .._model import RawEvents, Window
from ._arrow import META_NAMES, BatchBuilder, arrow_converter, column_array
from ._vecread import Fallback, padded_bytes, vector_reader

__all__ = ["ArrowDecoder", "DecoderFor", "arrow_batches"]

DecoderFor = Callable[[int, int], ChangeDecoder]
"""``(source_id, schema_version) -> ChangeDecoder``: the decoder of an event's writer schema."""

_INSERT, _UPDATE, _DELETE = int(Op.INSERT), int(Op.UPDATE), int(Op.DELETE)


class ArrowDecoder:
    """Decodes data events column-wise into record batches of ``schema`` (module docstring).

    ``schema`` may hold any subset of the data and metadata columns (as for
    :class:`~._arrow.BatchBuilder`); data columns a table lacks are null.
    ``include_preimage`` adds an ``update_preimage`` row before each update
    that carries a before-image. Events are gathered by :meth:`add_window`,
    :meth:`add` or :meth:`add_events` and come out, in the order added, from
    :meth:`flush`. Relay windows are decoded in bulk: their events wait until
    ``drain_events`` of them are gathered (or :meth:`flush`), then each writer
    schema's events are decoded in one pass, whatever windows they came in
    (or ``drain_bytes`` of their wire bytes: wide rows). Not thread-safe.
    """

    def __init__(
        self,
        schema: pa.Schema,
        *,
        include_preimage: bool = True,
        drain_events: int = 16_384,
        drain_bytes: int = 32 << 20,
    ) -> None:
        self.schema = schema
        self.include_preimage = include_preimage
        self._convs = {f.name: arrow_converter(f.type) for f in schema if f.name not in META_NAMES}
        self._parts: list[pa.RecordBatch] = []
        self._rows: BatchBuilder | None = None
        self._decoded = 0
        #: relay windows not decoded yet: (events, partition, commit time)
        self._pending: list[tuple[RawEvents, str, int]] = []
        self._pending_events = 0
        self._pending_bytes = 0
        self._drain_at = drain_events
        self._drain_bytes = drain_bytes

    @property
    def rows(self) -> int:
        """Rows gathered so far; events not decoded yet count one row each."""
        return self._decoded + self._pending_events

    def add_window(self, window: Window) -> None:
        """Append the rows of ``window``: its ``raw_events`` decoded column-wise,
        or its decoded ``events`` (a snapshot page, a row consumer) as
        :class:`~._arrow.BatchBuilder` lays them out."""
        raw = window.raw_events
        if raw is not None:
            if len(raw):
                self._pending.append((raw, window.partition, window.timestamp_ns))
                self._pending_events += len(raw)
                self._pending_bytes += window.nbytes
                if (
                    self._pending_events >= self._drain_at
                    or self._pending_bytes >= self._drain_bytes
                ):
                    self._drain()
        elif window.events:
            self._drain()
            rows = self._rows
            if rows is None:
                rows = self._rows = BatchBuilder(
                    self.schema, include_preimage=self.include_preimage
                )
            rows.add_window(window)
            n = rows.rows
            self._parts.append(rows.flush())
            self._decoded += n

    def _drain(self) -> None:
        """Decode the pending relay windows' events, one pass per writer schema."""
        pending, self._pending = self._pending, []
        self._pending_events = self._pending_bytes = 0
        if not pending:
            return
        k = len(pending)
        counts: list[int] = []
        sizes: list[int] = []
        bodies: list[bytes] = []
        offs: list[npt.NDArray[np.int64]] = []
        heads: list[bytes] = []
        names: set[str] = set()
        # the writer-schema decoder of every event (decoders are per window: by identity)
        decoders: list[ChangeDecoder] = []
        slot: dict[int, int] = {}
        gids: list[int] = []
        multi: list[tuple[int, RawEvents]] = []  # windows of several writer schemas
        for w, (raw, part, _) in enumerate(pending):
            counts.append(len(raw))
            sizes.append(len(raw.body))
            bodies.append(raw.body)
            offs.append(raw.offsets)
            heads.append(raw.headers.tobytes())  # (a structured concatenation is slow)
            names.add(part)
            if len(raw.decoders) != 1:
                multi.append((w, raw))
                gids.append(0)
                continue
            dec = next(iter(raw.decoders.values()))
            g = slot.setdefault(id(dec), len(slot))
            if g == len(decoders):
                decoders.append(dec)
            gids.append(g)
        n_of = np.array(counts, np.int64)
        body = bodies[0] if k == 1 else b"".join(bodies)
        offsets = np.concatenate(offs).astype(np.int64)
        if k > 1:
            size = np.array(sizes, np.int64)
            offsets += np.repeat(np.cumsum(size) - size, n_of)
        headers = np.frombuffer(b"".join(heads), pending[0][0].headers.dtype)
        times = np.repeat(np.array([t for _, _, t in pending], np.int64), n_of)
        group = np.repeat(np.array(gids, np.int32), n_of)
        firsts = np.cumsum(n_of) - n_of
        for w, raw in multi:
            h = raw.headers
            key = h["source_id"].astype(np.int64) << 16 | h["schema_version"]
            ids = np.zeros(len(raw), np.int32)
            for (sid, version), dec in raw.decoders.items():
                g = slot.setdefault(id(dec), len(slot))
                if g == len(decoders):
                    decoders.append(dec)
                ids[key == (sid << 16 | version)] = g
            group[firsts[w] : firsts[w] + len(raw)] = ids
        partition: str | npt.NDArray[Any] = (
            next(iter(names))
            if len(names) == 1
            else np.repeat(np.array([p for _, p, _ in pending], object), n_of)
        )
        self._decode_grouped(body, offsets, headers, decoders, group, times, partition)

    def _decode_grouped(
        self,
        buf: bytes,
        offsets: npt.NDArray[np.int64],
        headers: npt.NDArray[Any],
        decoders: Sequence[ChangeDecoder],
        group: npt.NDArray[np.int32],
        times: npt.NDArray[np.int64],
        partition: str | npt.NDArray[Any],
    ) -> None:
        """Data events of several writer schemas: one pass each, rows in the events' order."""
        ks = offsets + HEADER_SIZE
        starts = ks + headers["key_length"]
        stops = offsets + headers["total_length"]
        ops = headers["op"].astype(np.int64)
        seqs = headers["seq"].astype(np.int64)
        scns = headers["scn"].astype(np.int64)
        batches: list[pa.RecordBatch] = []
        order: list[npt.NDArray[np.int64]] = []
        # several schemas: the buffer padded once (the vectorised reader pads it per call
        # otherwise: a copy of the whole body per schema), the events of each found by one
        # stable sort (a comparison of every event per schema before)
        padded: npt.NDArray[np.uint8] | None = None
        by_group = bounds = np.zeros(0, np.int64)
        if len(decoders) > 1:
            padded = padded_bytes(buf)
            by_group = np.argsort(group, kind="stable")
            bounds = np.searchsorted(group[by_group], np.arange(len(decoders) + 1))
        for g, decoder in enumerate(decoders):
            sel = (
                None if len(decoders) == 1 else by_group[bounds[g] : bounds[g + 1]].astype(np.int64)
            )

            def pick(a: npt.NDArray[Any], sel: npt.NDArray[np.int64] | None = sel) -> Any:
                return a if sel is None else a[sel]

            part = partition if isinstance(partition, str) else pick(partition)
            batch, src = self._decode(
                decoder, buf, pick(starts), pick(stops), pick(ops), pick(seqs), pick(scns),
                pick(times), part, pick(ks), padded,
            )  # fmt: skip
            batches.append(batch)
            order.append(src if sel is None else sel[src])
        if len(batches) == 1:
            self._append(batches[0])
            return
        events = np.concatenate(order)
        rows = pa.concat_batches(batches)
        self._append(rows.take(pa.array(np.argsort(events, kind="stable"))))

    def _append(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows:
            self._parts.append(batch)
            self._decoded += batch.num_rows

    def add(
        self,
        decoder: ChangeDecoder,
        buf: bytes,
        starts: Sequence[int],
        stops: Sequence[int],
        *,
        ops: Sequence[int],
        seqs: Sequence[int],
        scns: Sequence[int],
        timestamps_ns: Sequence[int],
        partitions: Sequence[str],
        key_starts: Sequence[int] | None = None,
    ) -> None:
        """Decode the data events whose payloads are ``buf[starts[i]:stops[i]]``.

        All are of ``decoder``'s writer schema; ``ops`` are their envelope ops
        (:class:`~changebus.schemas.Op`), the other sequences their metadata.
        ``key_starts[i]`` is where event ``i``'s key bytes start (they end
        where its payload starts): needed only for a delete without a
        before-image, whose row is its key.
        """
        if not len(starts):
            return
        self._drain()
        names = set(partitions)
        part: str | npt.NDArray[Any] = (
            next(iter(names)) if len(names) == 1 else np.array(list(partitions), object)
        )
        batch, _ = self._decode(
            decoder, buf, np.asarray(starts, np.int64), np.asarray(stops, np.int64),
            np.asarray(ops, np.int64), np.asarray(seqs, np.int64), np.asarray(scns, np.int64),
            np.asarray(timestamps_ns, np.int64), part,
            None if key_starts is None else np.asarray(key_starts, np.int64),
        )  # fmt: skip
        self._append(batch)

    def _decode(
        self,
        decoder: ChangeDecoder,
        buf: bytes,
        starts: npt.NDArray[np.int64],
        stops: npt.NDArray[np.int64],
        ops: npt.NDArray[np.int64],
        seqs: npt.NDArray[np.int64],
        scns: npt.NDArray[np.int64],
        times: npt.NDArray[np.int64],
        partition: str | npt.NDArray[Any],
        key_starts: npt.NDArray[np.int64] | None,
        padded: npt.NDArray[np.uint8] | None = None,
    ) -> tuple[pa.RecordBatch, npt.NDArray[np.int64]]:
        """One writer schema's events as a batch, and the event of each of its rows
        (``padded``: ``buf`` as :func:`._vecread.padded_bytes` gives it, when the caller
        has it)."""
        n = len(starts)
        start_list = starts.tolist()
        images = _images(decoder, buf, starts, stops, padded)
        present = images[2]
        not_sent = images[3]
        lay = _layout(ops, np.asarray(present, np.int64), self.include_preimage)
        extra: list[dict[str, Any] | None] = []  # rows no image holds, at 2n + j
        for i in np.flatnonzero(lay.extra).tolist():
            if ops[i] == _DELETE:
                ks = None if key_starts is None else int(key_starts[i])
                extra.append(_key_row(decoder, buf, start_list[i], ks))
            else:
                extra.append(None)  # a truncate: no row at all
        # not-sent values of a post-image: the before-image's, where it has them
        patches: dict[str, list[tuple[int, int]]] = {}
        known = set(decoder.columns)
        for i, after_ns, before_ns in not_sent:
            if ops[i] != _UPDATE or present[i] != 3:
                continue
            row = int(lay.post_row[i])
            for name in after_ns:
                if name in known and name not in before_ns:
                    patches.setdefault(name, []).append((row, n + i))
        src = lay.src
        rows = len(src)
        position = {name: j for j, name in enumerate(decoder.columns)}
        arrays: list[pa.Array] = []
        for f in self.schema:
            name = f.name
            if name in META_NAMES:
                arrays.append(_meta(name, f.type, lay, seqs, scns, times, partition,
                                    decoder.reader.name))  # fmt: skip
                continue
            j = position.get(name)
            if j is None:
                arrays.append(pa.nulls(rows, f.type))
                continue
            conv = self._convs[name]
            after, before = images[0][j], images[1][j]
            if lay.identity and name not in patches:
                # (a patched column takes values from the before-images below)
                arrays.append(_as_array(after, n, f.type, conv))
                continue
            pieces = [_as_array(after, n, f.type, conv), _as_array(before, n, f.type, conv)]
            if extra:
                values = [None if row is None else row.get(name) for row in extra]
                pieces.append(column_array(values, f.type, conv))
            where = lay.idx
            if name in patches:
                where = lay.idx.copy()
                for row, source in patches[name]:
                    where[row] = source
            arrays.append(pa.concat_arrays(pieces).take(pa.array(where)))
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema), src

    def add_events(
        self,
        buf: bytes,
        offsets: Sequence[int] | npt.NDArray[np.int64],
        headers: npt.NDArray[Any],
        decoder_for: DecoderFor,
        partition: str,
        *,
        timestamps_ns: Sequence[int] | None = None,
    ) -> None:
        """Decode the data events of a buffer of whole events (what a relay serves).

        ``offsets`` and ``headers`` are what :func:`~changebus.schemas.parse_stream`
        returns for ``buf``; control events are skipped; the events of one
        writer schema are decoded in one pass, the rows kept in the events'
        order. ``timestamps_ns`` (per event) replaces the headers' commit
        timestamps (a consumer stamps a window's events with the window's).
        """
        self._drain()
        offs = np.asarray(offsets, np.int64)
        sel = np.flatnonzero(headers["op"] < FIRST_CONTROL_OP)
        if not sel.size:
            return
        h = headers[sel]
        times = (
            h["timestamp_ns"].astype(np.int64)
            if timestamps_ns is None
            else np.asarray(timestamps_ns, np.int64)[sel]
        )
        key = h["source_id"].astype(np.int64) << 16 | h["schema_version"]
        kinds, group = np.unique(key, return_inverse=True)
        decoders = [decoder_for(int(k) >> 16, int(k) & 0xFFFF) for k in kinds.tolist()]
        self._decode_grouped(buf, offs[sel], h, decoders, group.astype(np.int32), times, partition)

    def flush(self) -> pa.RecordBatch:
        """The rows gathered so far as one batch of :attr:`schema` (and start a new one)."""
        self._drain()
        parts, self._parts = self._parts, []
        self._decoded = 0
        if not parts:
            return pa.RecordBatch.from_arrays(
                [pa.array([], type=f.type) for f in self.schema], schema=self.schema
            )
        if len(parts) == 1:
            return parts[0]
        return pa.concat_batches(parts)


_Column: TypeAlias = "list[Any] | pa.Array | None"


def _images(
    decoder: ChangeDecoder,
    buf: bytes,
    starts: npt.NDArray[np.int64],
    stops: npt.NDArray[np.int64],
    padded: npt.NDArray[np.uint8] | None = None,
) -> tuple[list[_Column], list[_Column], Sequence[int] | npt.NDArray[np.int64], list[Any]]:
    """Both images of every record, column by column: ``(after, before, present, not_sent)``.

    Vectorised (:mod:`._vecread`, Arrow arrays, None for a column no record
    holds) when the schema and the batch allow, else the generated column
    reader (one list of values per column).
    """
    vec = vector_reader(decoder)
    if vec is not None:
        try:
            a, b, present, not_sent = vec.read(buf, starts, stops, padded)
            return list(a), list(b), present, not_sent
        except Fallback:
            pass
    ncols = len(decoder.columns)
    after: list[list[Any]] = [[] for _ in range(ncols)]
    before: list[list[Any]] = [[] for _ in range(ncols)]
    present_list, not_sent = decoder.decode_columns(
        buf, starts.tolist(), stops.tolist(), after, before
    )
    return list(after), list(before), present_list, not_sent


def _as_array(
    values: _Column, n: int, t: pa.DataType, conv: Callable[[Any], Any] | None
) -> pa.Array:
    """One image's column as an Arrow array of type ``t`` (``n`` nulls for None)."""
    if values is None:
        return pa.nulls(n, t)
    if isinstance(values, list):
        return column_array(values, t, conv)
    return values if values.type == t else values.cast(t)


class _Layout(NamedTuple):
    """Where each output row of a batch of events comes from (:func:`_layout`)."""

    src: npt.NDArray[np.int64]  # the event of each row
    idx: npt.NDArray[np.int64]  # its values: after-image i, before-image n + i, extra 2n + j
    code: npt.NDArray[np.int8]  # its _change_type (an index into _change_names())
    post_row: npt.NDArray[np.int64]  # per event: its last row (an update's post-image)
    extra: npt.NDArray[np.bool_]  # per event: its row is an extra one (key row, truncate)
    identity: bool  # one row per event, each its after-image


@functools.cache
def _change_names() -> pa.Array:
    """``_change_type`` values by change code, made on first use: any ``pa.array`` call makes
    pyarrow import pandas, half a second that Spark's planning process need not pay."""
    return pa.array(["insert", "update_preimage", "update_postimage", "delete", "truncate"])


def _layout(
    ops: npt.NDArray[np.int64], present: npt.NDArray[np.int64], include_preimage: bool
) -> _Layout:
    """The output rows of ``n`` events (module docstring), computed with numpy."""
    n = len(ops)
    events = np.arange(n, dtype=np.int64)
    has_before = (present & 2) != 0
    insert, update, delete = ops == _INSERT, ops == _UPDATE, ops == _DELETE
    other = ~(insert | update | delete)
    extra = (delete & ~has_before) | other
    pre = update & has_before if include_preimage else np.zeros(n, np.bool_)
    main = np.where(insert | update, events, n + events)
    if extra.any():
        main[extra] = 2 * n + np.arange(int(extra.sum()), dtype=np.int64)
    code = np.select([insert, update, delete], [0, 2, 3], 4).astype(np.int8)
    if not pre.any():
        identity = not (extra.any() or (delete & has_before).any())
        return _Layout(events, main, code, events, extra, identity)
    counts = 1 + pre.astype(np.int64)
    src = np.repeat(events, counts)
    post_row = np.cumsum(counts) - 1
    first = post_row[pre] - 1  # the pre-image rows
    idx = main[src]
    idx[first] = n + events[pre]
    row_code = code[src]
    row_code[first] = 1
    return _Layout(src, idx, row_code, post_row, extra, False)


def _key_row(
    decoder: ChangeDecoder, buf: bytes, payload_start: int, key_start: int | None
) -> dict[str, Any]:
    """The key of an event whose key bytes run from ``key_start`` to its payload."""
    if key_start is None or key_start >= payload_start:
        return {}
    return decoder.decode_key(memoryview(buf)[key_start:payload_start])


def _meta(
    name: str,
    t: pa.DataType,
    lay: _Layout,
    seqs: npt.NDArray[np.int64],
    scns: npt.NDArray[np.int64],
    times: npt.NDArray[np.int64],
    partition: str | npt.NDArray[Any],
    table: str,
) -> pa.Array:
    """One metadata column: per output row, a value of its event (``lay.src``)."""
    src = None if len(lay.src) == len(seqs) else lay.src
    if name == "_change_type":
        return _change_names().take(pa.array(lay.code)).cast(t)
    if name == "_source":
        return pa.repeat(pa.scalar(table, t), len(lay.src))
    if name == "_partition":
        if isinstance(partition, str):
            return pa.repeat(pa.scalar(partition, t), len(lay.src))
        return pa.array((partition if src is None else partition[src]).tolist(), type=t)
    values = {"_commit_scn": scns, "_txn_seq": seqs}.get(name)
    if values is None:  # _commit_timestamp
        values = times // 1000
    return pa.array(values if src is None else values[src], type=t)


async def arrow_batches(
    consumer: Consumer,
    schema: pa.Schema,
    *,
    max_rows: int = 65_536,
    linger_s: float = 1.0,
    include_preimage: bool = True,
) -> AsyncIterator[pa.RecordBatch]:
    """The bulk API: a consumer's windows as Arrow record batches of ``schema``.

    ``schema`` is the Spark source's layout (build it with
    :func:`~._arrow.union_schema` from the tables' schemas, or take a subset
    of its columns). A batch is yielded once it holds ``max_rows`` rows, or
    ``linger_s`` after its first row arrived, or when the stream ends (a
    consumer with ``follow=False`` at the relay's end): whole windows only.
    Configure the consumer with ``columnar=True`` (data events decoded
    straight into columns; a row consumer works too, slower) and call
    :meth:`Consumer.commit` after a batch is processed: that commits every
    window of the batches handed out so far, and never one still in a batch
    not handed out (windows are read ahead while the application works). With
    ``auto_commit`` a batch is committed when the next one is asked for. Empty
    windows go with the batch they came in. Not thread-safe, like the consumer.
    """
    dec = ArrowDecoder(schema, include_preimage=include_preimage)
    loop = asyncio.get_running_loop()
    deadline: float | None = None
    # the next window is awaited in a task that a linger timeout leaves running
    # (never cancelled half-way through the consumer's step)
    pending: asyncio.Future[Window] | None = None
    last: Window | None = None  # the last window in the batch being filled

    async def hand_out() -> pa.RecordBatch:
        nonlocal last
        if last is not None:
            consumer._handed_out(last)
            last = None
        return dec.flush()

    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(consumer._next_unmarked())
            timeout = None if deadline is None else max(0.0, deadline - loop.time())
            done, _ = await asyncio.wait({pending}, timeout=timeout)
            if not done:
                deadline = None
                yield await hand_out()
                if consumer.config.auto_commit:
                    await consumer.commit()
                continue
            step, pending = pending, None
            try:
                window = step.result()
            except StopAsyncIteration:
                break
            dec.add_window(window)
            last = window
            if dec.rows >= max_rows:
                deadline = None
                yield await hand_out()
                if consumer.config.auto_commit:
                    await consumer.commit()
            elif dec.rows and deadline is None:
                deadline = loop.time() + linger_s
        if dec.rows or last is not None:
            yield await hand_out()
            if consumer.config.auto_commit:
                await consumer.commit()
    finally:
        if pending is not None:
            pending.cancel()
