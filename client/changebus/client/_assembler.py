"""From response bytes to validated raw windows (sans-IO: no sockets, no loop).

Two small state machines, fed by the fetcher:

* :class:`EventSplitter` cuts a byte stream (follow-mode chunks) at event
  boundaries: :meth:`~EventSplitter.push` returns the longest prefix made of
  whole events and keeps the rest (a partial event) for the next chunk.
* :class:`WindowAssembler` validates events and groups them into windows.
  Every event is checked (magic, version, op, lengths, header and payload
  CRCs: :func:`~changebus.schemas.parse_stream`), then the window structure:
  all events of a window share its SCN, ``seq`` increases inside it, an
  END_OF_WINDOW closes it, and window SCNs strictly increase. A violation
  raises :class:`~changebus.schemas.CorruptEventError` marked *retriable*
  (bytes damaged on the way; another attempt, maybe on another server, may
  get them whole); the reader then drops the partial window
  (:meth:`~WindowAssembler.reset`) and asks again from its position.

Invariant: ``last_scn`` is the SCN of the last window returned complete
(-1 before any); ``pending`` holds the events of at most one unfinished
window, all with SCN ``> last_scn``. The assembler does not own the
reader's position: :class:`~._stream.RelayStream` resets it to its position
whenever it (re)starts a window, so ``last_scn`` is only the watermark of
the order checks.

Not thread-safe: one reader task owns each instance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from changebus.schemas import (
    CorruptEventError,
    Op,
    ProtocolError,
    headers_at,
    parse_small,
    parse_stream,
    scan_offsets,
)

__all__ = ["DEFAULT_MAX_WINDOW_BYTES", "EventSplitter", "RawWindow", "WindowAssembler", "too_large"]

_EOW: Final = int(Op.END_OF_WINDOW)
#: one header field of a response's events: a list, or a numpy column
_Column = Sequence[int] | npt.NDArray[Any]
#: responses of at most this many events are checked event by event (see _feed_small)
SMALL_EVENTS: Final = 64


def _not_closed(scn: int) -> CorruptEventError:
    return CorruptEventError(
        f"window {scn} is not closed before events of another SCN", retriable=True
    )


def _seq_back(scn: int) -> CorruptEventError:
    return CorruptEventError(f"event seq numbers do not increase in window {scn}", retriable=True)


def _damaged(exc: CorruptEventError) -> CorruptEventError:
    """``exc`` as a retriable error (received bytes, not a bug of ours)."""
    return exc if exc.retriable else CorruptEventError(exc.message, retriable=True)


@dataclass(frozen=True, slots=True)
class RawWindow:
    """One complete, validated window: its events back to back in ``body``.

    ``offsets`` are the event starts in ``body`` and ``headers`` their
    :data:`~changebus.schemas.HEADER_DTYPE` records (END_OF_WINDOW last).
    """

    scn: int
    timestamp_ns: int
    body: bytes
    offsets: npt.NDArray[np.int64]
    headers: npt.NDArray[Any]

    @property
    def nbytes(self) -> int:
        return len(self.body)


#: the default bound on an answer, window or event a client holds (``max_window_bytes``)
DEFAULT_MAX_WINDOW_BYTES: Final = 512 << 20


def too_large(what: str, limit: int) -> ProtocolError:
    """The error of an answer, window or event past ``max_window_bytes``."""
    return ProtocolError(
        f"{what} is larger than max_window_bytes ({limit} bytes): a server sending "
        "that much is refused rather than held in memory; raise max_window_bytes "
        "for larger transactions"
    )


class EventSplitter:
    """Splits a byte stream into whole events (see the module docstring).

    ``max_event_bytes`` (0: no bound) bounds the partial event it holds: an
    event declaring more raises a non-retriable :class:`ProtocolError`
    before its bytes are gathered.
    """

    def __init__(self, max_event_bytes: int = 0) -> None:
        self._buf = bytearray()
        self._limit = max_event_bytes

    @property
    def leftover(self) -> int:
        """Bytes of an event not yet complete."""
        return len(self._buf)

    def push(self, chunk: bytes) -> bytes:
        """Append ``chunk``; return the complete events now available (maybe ``b""``)."""
        return self.split(chunk)[0]

    def split(self, chunk: bytes) -> tuple[bytes, npt.NDArray[np.int64]]:
        """:meth:`push`, also returning the offsets of the events it returns.

        Hand both to :meth:`WindowAssembler.feed` so the events are not
        scanned for a second time.
        """
        if not self._buf:
            data: bytes | bytearray = chunk
        else:
            self._buf += chunk
            data = self._buf
        try:
            offsets = scan_offsets(data)
        except CorruptEventError as exc:
            raise _damaged(exc) from exc
        if offsets.size == 0:
            self._check_partial(data, 0)
            if data is chunk:
                self._buf = bytearray(chunk)
            return b"", offsets
        last = int(offsets[-1])
        end = last + int.from_bytes(data[last + 4 : last + 8], "little")
        if end == len(data) and data is chunk:
            return chunk, offsets  # the common case: the chunk ends at an event's end
        self._check_partial(data, end)
        out = bytes(memoryview(data)[:end])
        self._buf = bytearray(memoryview(data)[end:])
        return out, offsets

    def _check_partial(self, data: bytes | bytearray, start: int) -> None:
        """Refuse a partial event at ``start`` declaring more than the bound."""
        if self._limit and len(data) >= start + 8:
            total = int.from_bytes(data[start + 4 : start + 8], "little")
            if total > self._limit:
                raise too_large(f"an event of {total} bytes", self._limit)

    def reset(self) -> None:
        self._buf.clear()


class WindowAssembler:
    """Validates events and groups them into windows (see the module docstring)."""

    def __init__(self, last_scn: int = -1, max_window_bytes: int = 0) -> None:
        self.last_scn = last_scn
        #: the bound on an unfinished window's bytes (0: none; see :func:`too_large`)
        self.max_window_bytes = max_window_bytes
        self._pending_bytes = 0
        self._pending: list[bytes] = []
        self._pending_scn = -1
        self._pending_seq = -1
        #: events in the data of the last :meth:`feed`
        self.fed_events = 0

    @property
    def in_window(self) -> bool:
        """Whether events of an unfinished window are held."""
        return bool(self._pending)

    @property
    def pending_scn(self) -> int:
        """The SCN of the unfinished window held (-1: none)."""
        return self._pending_scn if self._pending else -1

    def reset(self, last_scn: int | None = None) -> None:
        """Drop the unfinished window (and optionally move ``last_scn``)."""
        self._pending.clear()
        self._pending_bytes = 0
        self._pending_scn = -1
        self._pending_seq = -1
        if last_scn is not None:
            self.last_scn = last_scn

    def feed(self, data: bytes, offsets: npt.NDArray[np.int64] | None = None) -> list[RawWindow]:
        """Validate whole events ``data``; return the windows they complete.

        The order checks run once over the whole response (vectorised): inside
        a window the SCN stays the same and seq numbers increase; only the
        first piece of each window is checked against what came before.
        ``offsets``: the event offsets :meth:`EventSplitter.split` found.
        """
        if not data:
            self.fed_events = 0
            return []
        if offsets is None:
            try:
                offsets = scan_offsets(data)
            except CorruptEventError as exc:
                raise _damaged(exc) from exc
        self.fed_events = len(offsets)
        if len(offsets) <= SMALL_EVENTS:
            return self._feed_small(data, offsets.tolist())
        try:
            offsets, headers = parse_stream(data, offsets=offsets)
        except CorruptEventError as exc:
            raise _damaged(exc) from exc
        ops = headers["op"]
        scns = headers["scn"]
        seqs = headers["seq"].astype(np.int64)
        is_end = ops == _EOW
        ends = np.flatnonzero(is_end).tolist()
        # pairs (i, i + 1) inside one window: i is not an END_OF_WINDOW
        inside = ~is_end[:-1]
        bad_scn = np.flatnonzero(inside & (scns[1:] != scns[:-1]))
        if bad_scn.size:
            raise _not_closed(int(scns[bad_scn[0]]))
        bad_seq = np.flatnonzero(inside & (seqs[1:] <= seqs[:-1]))
        if bad_seq.size:
            raise _seq_back(int(scns[bad_seq[0]]))
        return self._assemble(
            data,
            offsets,
            headers,
            ends,
            offsets.tolist(),
            headers["total_length"].tolist(),
            scns,
            seqs,
            headers["timestamp_ns"],
        )

    def _feed_small(self, data: bytes, offs: list[int]) -> list[RawWindow]:
        """:meth:`feed` for a response of a few events (a window as it commits).

        The same checks and errors, and the same windows, over the headers
        unpacked as tuples (:func:`~changebus.schemas.parse_small`): the
        vectorised path's few dozen numpy calls cost more than such a window's
        events (``tests/client/test_assembler_small.py`` compares the two).
        """
        try:
            offsets, headers, rows = parse_small(data, offs)
        except CorruptEventError as exc:
            raise _damaged(exc) from exc
        # fields of a header tuple: 2 op, 3 total_length, 4 scn, 5 timestamp_ns, 10 seq
        for a, b in pairwise(rows):
            if a[2] != _EOW and b[4] != a[4]:
                raise _not_closed(a[4])
        for a, b in pairwise(rows):
            if a[2] != _EOW and b[10] <= a[10]:
                raise _seq_back(a[4])
        return self._assemble(
            data,
            offsets,
            headers,
            [i for i, row in enumerate(rows) if row[2] == _EOW],
            offs,
            [row[3] for row in rows],
            [row[4] for row in rows],
            [row[10] for row in rows],
            [row[5] for row in rows],
        )

    def _assemble(
        self,
        data: bytes,
        offsets: npt.NDArray[np.int64],
        headers: npt.NDArray[Any],
        ends: list[int],
        starts: list[int],
        totals: list[int],
        scns: _Column,
        seqs: _Column,
        timestamps: _Column,
    ) -> list[RawWindow]:
        """Group checked events into windows (``ends``: the END_OF_WINDOW indexes).

        A window wholly in this response reuses what was parsed; the pieces
        of one that spans responses wait in ``_pending`` until it closes. The
        per-event columns are lists or numpy arrays, read once per window.
        """
        out: list[RawWindow] = []
        start = 0
        last = len(starts) - 1
        bounds = ends if ends and ends[-1] == last else [*ends, last]
        for i, end in enumerate(bounds):
            closed = i < len(ends)  # only an extra last bound leaves a window open
            scn = int(scns[start])
            self._accept(scn, int(seqs[start]))
            lo = starts[start]
            hi = starts[end] + totals[end]
            if closed and not self._pending:
                out.append(
                    RawWindow(
                        scn,
                        int(timestamps[end]),
                        data[lo:hi],
                        offsets[start : end + 1] - lo,
                        headers[start : end + 1],
                    )
                )
                self.last_scn = scn
                self._pending_scn = -1
                self._pending_seq = -1
            else:
                self._pending_bytes += hi - lo
                if self.max_window_bytes and self._pending_bytes > self.max_window_bytes:
                    raise too_large(f"window {scn}", self.max_window_bytes)
                self._pending.append(data[lo:hi])
                self._pending_seq = int(seqs[end])
                if closed:
                    out.append(self._close(scn, int(timestamps[end])))
            start = end + 1
        return out

    def _accept(self, scn: int, first_seq: int) -> None:
        """Check that events of window ``scn`` starting at ``first_seq`` may come now."""
        if self._pending:
            if scn != self._pending_scn:
                raise CorruptEventError(
                    f"window {self._pending_scn} is not closed before window {scn}",
                    retriable=True,
                )
            if first_seq <= self._pending_seq:
                raise CorruptEventError(
                    f"event seq numbers go back in window {scn}", retriable=True
                )
            return
        if scn <= self.last_scn:
            raise CorruptEventError(
                f"window {scn} arrives after window {self.last_scn}: SCNs must increase",
                retriable=True,
            )
        self._pending_scn = scn

    def _close(self, scn: int, timestamp_ns: int) -> RawWindow:
        body = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
        offsets = scan_offsets(body)  # already verified in feed(): no CRCs again
        headers = headers_at(body, offsets)
        self.reset(scn)
        return RawWindow(scn, timestamp_ns, body, offsets, headers)
