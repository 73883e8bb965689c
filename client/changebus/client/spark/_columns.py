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
import itertools
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from changebus.schemas import FIRST_CONTROL_OP, HEADER_SIZE, ChangeDecoder, Op

from .._consumer import Consumer
from .._model import Window
from ._arrow import META_NAMES, BatchBuilder, arrow_converter, column_array

__all__ = ["ArrowDecoder", "DecoderFor", "arrow_batches"]

DecoderFor = Callable[[int, int], ChangeDecoder]
"""``(source_id, schema_version) -> ChangeDecoder``: the decoder of an event's writer schema."""

_INSERT, _UPDATE, _DELETE = int(Op.INSERT), int(Op.UPDATE), int(Op.DELETE)


class ArrowDecoder:
    """Decodes data events column-wise into record batches of ``schema`` (module docstring).

    ``schema`` may hold any subset of the data and metadata columns (as for
    :class:`~._arrow.BatchBuilder`); data columns a table lacks are null.
    ``include_preimage`` adds an ``update_preimage`` row before each update
    that carries a before-image. Events are gathered by :meth:`add` (or
    :meth:`add_events`) and come out, in the order added, from
    :meth:`flush`. Not thread-safe.
    """

    def __init__(self, schema: pa.Schema, *, include_preimage: bool = True) -> None:
        self.schema = schema
        self.include_preimage = include_preimage
        self._convs = {f.name: arrow_converter(f.type) for f in schema if f.name not in META_NAMES}
        self._parts: list[pa.RecordBatch] = []
        self._rows: BatchBuilder | None = None
        self.rows = 0

    def add_window(self, window: Window) -> None:
        """Append the rows of ``window``: its ``raw_events`` decoded column-wise,
        or its decoded ``events`` (a snapshot page, a row consumer) as
        :class:`~._arrow.BatchBuilder` lays them out."""
        raw = window.raw_events
        if raw is not None:
            decoders = raw.decoders
            self.add_events(
                raw.body,
                raw.offsets,
                raw.headers,
                lambda sid, version: decoders[(sid, version)],
                window.partition,
                timestamps_ns=[window.timestamp_ns] * len(raw),
            )
        elif window.events:
            rows = self._rows
            if rows is None:
                rows = self._rows = BatchBuilder(
                    self.schema, include_preimage=self.include_preimage
                )
            rows.add_window(window)
            n = rows.rows
            self._parts.append(rows.flush())
            self.rows += n

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
        n = len(starts)
        if not n:
            return
        ncols = len(decoder.columns)
        after: list[list[Any]] = [[] for _ in range(ncols)]
        before: list[list[Any]] = [[] for _ in range(ncols)]
        present, not_sent = decoder.decode_columns(buf, starts, stops, after, before)
        extra: list[dict[str, Any] | None] = []  # rows no image holds, at 2n + j
        idx: list[int] = []
        change: list[str] = []
        src: list[int] = []  # the event of each output row
        pre = self.include_preimage
        patch_at: dict[int, int] = {}  # event -> its post-image row, for not-sent events
        ns_events = {i for i, _, _ in not_sent}
        for i, (op, p) in enumerate(zip(ops, present, strict=True)):
            if op == _INSERT:
                idx.append(i)
                change.append("insert")
                src.append(i)
            elif op == _UPDATE:
                if pre and p & 2:
                    idx.append(n + i)
                    change.append("update_preimage")
                    src.append(i)
                if i in ns_events:
                    patch_at[i] = len(idx)
                idx.append(i)
                change.append("update_postimage")
                src.append(i)
            elif op == _DELETE:
                if p & 2:
                    idx.append(n + i)
                else:
                    idx.append(2 * n + len(extra))
                    extra.append(_key_row(decoder, buf, starts, key_starts, i))
                change.append("delete")
                src.append(i)
            else:
                idx.append(2 * n + len(extra))
                extra.append(None)
                change.append("truncate")
                src.append(i)
        # not-sent values of a post-image: the before-image's, where it has them
        patches: dict[str, list[tuple[int, int]]] = {}
        names = decoder.columns
        known = set(names)
        for i, after_ns, before_ns in not_sent:
            row = patch_at.get(i)
            if row is None or present[i] != 3:
                continue
            for name in after_ns:
                if name in known and name not in before_ns:
                    patches.setdefault(name, []).append((row, n + i))
        self._parts.append(
            self._batch(
                decoder, after, before, extra, idx, patches, change, src,
                seqs, scns, timestamps_ns, partitions,
            )
        )  # fmt: skip
        self.rows += len(idx)

    def _batch(
        self,
        decoder: ChangeDecoder,
        after: list[list[Any]],
        before: list[list[Any]],
        extra: list[dict[str, Any] | None],
        idx: list[int],
        patches: dict[str, list[tuple[int, int]]],
        change: list[str],
        src: list[int],
        seqs: Sequence[int],
        scns: Sequence[int],
        timestamps_ns: Sequence[int],
        partitions: Sequence[str],
    ) -> pa.RecordBatch:
        n = len(after[0]) if after else 0
        rows = len(idx)
        identity = rows == n and idx == list(range(n))  # every event one row, in order
        take: npt.NDArray[np.int64] | None = None if identity else np.asarray(idx, np.int64)
        position = {name: j for j, name in enumerate(decoder.columns)}
        table = decoder.reader.name
        arrays: list[pa.Array] = []
        for f in self.schema:
            name = f.name
            if name in META_NAMES:
                arrays.append(_meta(name, f.type, change, src, seqs, scns, timestamps_ns,
                                    partitions, table))  # fmt: skip
                continue
            j = position.get(name)
            if j is None:
                arrays.append(pa.nulls(rows, f.type))
                continue
            if identity:
                arrays.append(column_array(after[j], f.type, self._convs[name]))
                continue
            values = after[j] + before[j]
            if extra:
                values.extend(None if row is None else row.get(name) for row in extra)
            arr = column_array(values, f.type, self._convs[name])
            where = take
            if name in patches:
                where = np.array(idx, np.int64)
                for row, source in patches[name]:
                    where[row] = source
            arrays.append(arr.take(pa.array(where)))
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)

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
        returns for ``buf``; control events are skipped; runs of events of one
        writer schema are decoded in one pass each, the rows kept in the
        events' order. ``timestamps_ns`` (per event) replaces the headers'
        commit timestamps (a consumer stamps a window's events with the
        window's).
        """
        offs = np.asarray(offsets, np.int64)
        sel = np.flatnonzero(headers["op"] < FIRST_CONTROL_OP)
        if not sel.size:
            return
        h = headers[sel]
        o = offs[sel]
        ks = o + HEADER_SIZE
        starts = (ks + h["key_length"]).tolist()
        stops = (o + h["total_length"]).tolist()
        ts = (
            h["timestamp_ns"].tolist()
            if timestamps_ns is None
            else [timestamps_ns[i] for i in sel.tolist()]
        )
        ops, seqs, scns = h["op"].tolist(), h["seq"].tolist(), h["scn"].tolist()
        kstarts = ks.tolist()
        schema_of = h["source_id"].astype(np.int64) << 16 | h["schema_version"]
        cuts = [0, *(np.flatnonzero(np.diff(schema_of)) + 1).tolist(), len(sel)]
        sids, versions = h["source_id"].tolist(), h["schema_version"].tolist()
        for a, b in itertools.pairwise(cuts):
            self.add(
                decoder_for(sids[a], versions[a]),
                buf,
                starts[a:b],
                stops[a:b],
                ops=ops[a:b],
                seqs=seqs[a:b],
                scns=scns[a:b],
                timestamps_ns=ts[a:b],
                partitions=[partition] * (b - a),
                key_starts=kstarts[a:b],
            )

    def flush(self) -> pa.RecordBatch:
        """The rows gathered so far as one batch of :attr:`schema` (and start a new one)."""
        parts, self._parts = self._parts, []
        self.rows = 0
        if not parts:
            return pa.RecordBatch.from_arrays(
                [pa.array([], type=f.type) for f in self.schema], schema=self.schema
            )
        if len(parts) == 1:
            return parts[0]
        return pa.concat_batches(parts)


def _key_row(
    decoder: ChangeDecoder,
    buf: bytes,
    starts: Sequence[int],
    key_starts: Sequence[int] | None,
    i: int,
) -> dict[str, Any]:
    """The key of event ``i`` (its bytes run from ``key_starts[i]`` to its payload)."""
    if key_starts is None or key_starts[i] >= starts[i]:
        return {}
    return decoder.decode_key(memoryview(buf)[key_starts[i] : starts[i]])


def _meta(
    name: str,
    t: pa.DataType,
    change: list[str],
    src: list[int],
    seqs: Sequence[int],
    scns: Sequence[int],
    timestamps_ns: Sequence[int],
    partitions: Sequence[str],
    table: str,
) -> pa.Array:
    """One metadata column: per output row, a value of its event (``src``)."""
    if name == "_change_type":
        return pa.array(change, type=t)
    if name == "_source":
        return pa.array([table] * len(src), type=t)
    values: Sequence[Any]
    if name == "_commit_scn":
        values = scns
    elif name == "_commit_timestamp":
        values = [v // 1000 for v in timestamps_ns]
    elif name == "_txn_seq":
        values = seqs
    else:
        values = partitions
    if len(src) == len(values) and src == list(range(len(src))):
        return pa.array(values, type=t)
    return pa.array([values[i] for i in src], type=t)


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
    straight into columns; a row consumer works too, slower) and
    ``auto_commit=False``, and call :meth:`Consumer.commit` after a batch is
    processed: that commits every window in it (with ``auto_commit`` the
    iterator would commit windows whose rows are still in an unyielded
    batch). Not thread-safe, like the consumer.
    """
    dec = ArrowDecoder(schema, include_preimage=include_preimage)
    it = aiter(consumer)
    loop = asyncio.get_running_loop()
    deadline: float | None = None
    # the next window is awaited in a task that a linger timeout leaves running
    # (never cancelled half-way through the consumer's step)
    pending: asyncio.Future[Window] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(it))
            timeout = None if deadline is None else max(0.0, deadline - loop.time())
            done, _ = await asyncio.wait({pending}, timeout=timeout)
            if not done:
                deadline = None
                yield dec.flush()
                continue
            step, pending = pending, None
            try:
                window = step.result()
            except StopAsyncIteration:
                break
            dec.add_window(window)
            if dec.rows >= max_rows:
                deadline = None
                yield dec.flush()
            elif dec.rows and deadline is None:
                deadline = loop.time() + linger_s
        if dec.rows:
            yield dec.flush()
    finally:
        if pending is not None:
            pending.cancel()
