"""Fixed-size circular tables in memory-mapped files, addressed virtually.

A :class:`CircularTable` holds ``slots`` records of a numpy dtype in a file
mapped with ``numpy.memmap``. Records are addressed by a *virtual* number
that only grows (event 0, 1, 2, ... ever written); record ``n`` lives in slot
``n % slots``. The owner keeps the live range ``[head, tail)`` and guarantees
``tail - head <= slots``; the table itself holds no state but the mapping,
so it is as safe to share between threads as the owner's locking makes it.

Two tables are used per buffer:

* the **event table** (:data:`EVENT_DTYPE`, 32 bytes per event): the virtual
  byte position of each event in the ring plus the header fields the relay
  filters on, so selection is vectorised and never touches the ring;
* the **SCN index** (:data:`INDEX_DTYPE`, 16 bytes per entry): one entry per
  ring block in which a window starts (the first such window), mapping its
  SCN to its first event number. Lookup is a binary search in the index
  followed by a short vectorised scan of the event table (see :mod:`._index`).
"""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from changebus.schemas.files import reserve_file

__all__ = ["EVENT_DTYPE", "INDEX_DTYPE", "CircularTable"]

EVENT_DTYPE: Final = np.dtype(
    [
        ("pos", "<u8"),  # virtual byte position of the event in the ring
        ("scn", "<u8"),
        ("key_hash", "<u8"),
        ("length", "<u4"),
        ("op", "u1"),
        ("_pad", "u1"),
        ("source_id", "<u2"),
    ]
)
assert EVENT_DTYPE.itemsize == 32

INDEX_DTYPE: Final = np.dtype([("scn", "<u8"), ("event", "<u8")])

#: :meth:`CircularTable.searchsorted_many` bisects up to this many values one by one
_BISECT_MAX: Final = 1024


class CircularTable:
    """``slots`` records of ``dtype`` in a memory-mapped file."""

    def __init__(self, path: Path, dtype: np.dtype[np.void], slots: int, *, create: bool) -> None:
        self.path = path
        self.slots = slots
        self._mm = np.memmap(path, dtype=dtype, mode="w+" if create else "r+", shape=(slots,))
        reserve_file(path, slots * dtype.itemsize)  # no page-fault block allocation, no SIGBUS
        # a plain ndarray view: np.memmap's Python-level __getitem__ costs
        # microseconds per slice, and this table is sliced on every request
        self.data: npt.NDArray[Any] = self._mm.view(np.ndarray)

    def _spans(self, start: int, stop: int) -> list[tuple[int, int]]:
        """Physical ``[a, b)`` slot spans covering virtual ``[start, stop)``."""
        if stop <= start:
            return []
        a = start % self.slots
        n = stop - start
        if a + n <= self.slots:
            return [(a, a + n)]
        return [(a, self.slots), (0, n - (self.slots - a))]

    def get(self, start: int, stop: int, field: str | None = None) -> npt.NDArray[Any]:
        """Records (or one field) of virtual ``[start, stop)``; a copy only when wrapping."""
        spans = self._spans(start, stop)
        src = self.data if field is None else self.data[field]
        if not spans:
            return src[0:0]
        if len(spans) == 1:
            a, b = spans[0]
            return src[a:b]
        return np.concatenate([src[a:b] for a, b in spans])

    def searchsorted(
        self, start: int, stop: int, field: str, value: int, side: str = "left"
    ) -> int:
        """Binary search of ``value`` in ``field`` over virtual ``[start, stop)`` (sorted there).

        Returns a virtual number. The search bisects the (at most two)
        physical spans in place, in O(log n) element reads: a field of a
        structured record is a strided view, and ``numpy.searchsorted``
        copies a strided array whole before it searches (O(n): 1.5 ms for a
        million events, which the writer paid on every eviction).
        """
        spans = self._spans(start, stop)
        if not spans:
            return start
        col = self.data[field]
        find = bisect.bisect_left if side == "left" else bisect.bisect_right
        a, b = spans[0]
        i = find(col, value, a, b) - a
        if i < b - a or len(spans) == 1:
            return start + i
        c, d = spans[1]
        return start + (b - a) + find(col, value, c, d) - c

    def searchsorted_many(
        self, start: int, stop: int, field: str, values: npt.NDArray[np.int64], side: str = "left"
    ) -> npt.NDArray[np.int64]:
        """:meth:`searchsorted` of every one of ``values`` (virtual numbers).

        A few values are bisected one by one in place; many (more than
        :data:`_BISECT_MAX`) in one vectorised search, which copies the
        field's range once.
        """
        if len(values) <= _BISECT_MAX:
            return np.array(
                [self.searchsorted(start, stop, field, int(v), side) for v in values],
                dtype=np.int64,
            )
        spans = self._spans(start, stop)
        if not spans:
            return np.full(len(values), start, dtype=np.int64)
        col = self.data[field]
        a, b = spans[0]
        found: npt.NDArray[np.int64] = np.searchsorted(col[a:b], values, side=side).astype(  # type: ignore[call-overload]
            np.int64
        )
        if len(spans) == 2:
            past = found == b - a
            c, d = spans[1]
            found[past] = (b - a) + np.searchsorted(col[c:d], values[past], side=side)  # type: ignore[call-overload]
        return np.asarray(found + start, dtype=np.int64)

    def put(self, start: int, records: npt.NDArray[Any]) -> None:
        """Store ``records`` at virtual numbers ``start, start + 1, ...``."""
        done = 0
        for a, b in self._spans(start, start + len(records)):
            self.data[a:b] = records[done : done + (b - a)]
            done += b - a

    def at(self, n: int) -> Any:
        """The record with virtual number ``n`` (a numpy structured scalar)."""
        return self.data[n % self.slots]

    def mapping(self) -> tuple[int, int]:
        """``(address, bytes)`` of the whole mapping (the syncer msyncs ranges of it)."""
        return int(self.data.ctypes.data), int(self.data.nbytes)

    def flush(self) -> None:
        self._mm.flush()

    def close(self) -> None:
        self.flush()
        del self.data
        mm = getattr(self._mm, "_mmap", None)
        del self._mm
        if mm is not None:
            mm.close()
