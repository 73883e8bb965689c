"""The portable partition hash and the partition filters built on it.

Hash
====
``key_hash(key) = XXH3_64bits(key bytes)`` with seed 0 (the XXH3 64-bit
hash of the xxHash family, specified in its ``doc/xxhash_spec.md`` and
implemented for every common language). The key bytes are the Avro binary
encoding of the event's key record, so any client that can encode Avro and
compute XXH3 gets the same number. Control events carry hash 0 and pass
every filter.

Filters
=======
A filter selects data events by their ``key_hash``:

* ``mod:N:B[,B...]`` keeps ``key_hash % N`` in the bucket list; a bucket list
  item is a number or an inclusive range ``A-B`` (``mod:4:0,2-3``).
* ``range:LO:HI`` keeps ``LO <= key_hash < HI`` (decimal or ``0x`` hex;
  ``HI`` may be ``max`` for 2**64).
* ``slice:I/N`` is ``range`` over the I-th of N equal parts of the hash space
  (``LO = I * 2**64 // N``, ``HI = (I + 1) * 2**64 // N``): N consumers with
  slices 0..N-1 together see every event exactly once.

Both forms are evaluated on whole numpy arrays of hashes (:meth:`mask`), so a
relay filters thousands of headers without a Python loop.

Subscriptions
=============
:func:`event_mask` is the one definition of what a subscriber receives from a
block of event headers: every control event (op >= ``FIRST_CONTROL_OP``:
window ends, schema changes, heartbeats, ...) and the data events of the
subscribed sources whose key hash passes the filter. The relay, the bootstrap
server and the Spark source all select with it.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt
import xxhash

from ._envelope import FIRST_CONTROL_OP
from .errors import BadRequestError

__all__ = ["HASH_SPACE", "PartitionFilter", "event_mask", "key_hash", "source_table"]

HASH_SPACE: Final = 1 << 64
#: The 64-bit partition hash of encoded key bytes (XXH3-64, seed 0).
key_hash = xxhash.xxh3_64_intdigest


# bounded digit counts: a filter is a request parameter, and a 5,000-digit number
# must be a bad request, not a ValueError from int() deep inside
_NUM = r"(?:0x[0-9a-fA-F]{1,17}|[0-9]{1,21})"
_MOD_RE: Final = re.compile(r"mod:([0-9]{1,6}):([0-9,\-]{1,4096})")
_RANGE_RE: Final = re.compile(rf"range:({_NUM}):({_NUM}|max)")
_SLICE_RE: Final = re.compile(r"slice:([0-9]{1,6})/([0-9]{1,6})")


@dataclass(frozen=True)
class PartitionFilter:
    """A set of key hashes: ``mod`` buckets or a ``[lo, hi)`` range.

    ``modulus`` set (with ``buckets``) means a mod filter, else ``[lo, hi)``.
    Instances are immutable and safe to share between threads.
    """

    modulus: int | None = None
    buckets: frozenset[int] = frozenset()
    lo: int = 0
    hi: int = HASH_SPACE

    def __post_init__(self) -> None:
        if self.modulus is not None:
            if not 1 <= self.modulus <= 65536:
                raise BadRequestError(f"mod filter modulus must be 1..65536, got {self.modulus}")
            if not self.buckets or any(not 0 <= b < self.modulus for b in self.buckets):
                raise BadRequestError(
                    f"mod filter buckets must be within 0..{self.modulus - 1}, got {sorted(self.buckets)}"
                )
        elif not 0 <= self.lo < self.hi <= HASH_SPACE:
            raise BadRequestError(
                f"range filter needs 0 <= lo < hi <= 2**64, got [{self.lo}, {self.hi})"
            )

    # ---- constructors -------------------------------------------------

    @classmethod
    def mod(
        cls, modulus: int, buckets: int | set[int] | frozenset[int] | list[int]
    ) -> PartitionFilter:
        """Keep events whose ``key_hash % modulus`` is one of ``buckets``."""
        b = frozenset([buckets]) if isinstance(buckets, int) else frozenset(buckets)
        return cls(modulus=modulus, buckets=b)

    @classmethod
    def range(cls, lo: int, hi: int = HASH_SPACE) -> PartitionFilter:
        """Keep events whose key hash is in ``[lo, hi)``."""
        return cls(lo=lo, hi=hi)

    @classmethod
    def slice(cls, index: int, count: int) -> PartitionFilter:
        """The ``index``-th of ``count`` equal ranges of the hash space."""
        if not 0 <= index < count:
            raise BadRequestError(f"slice index must be within 0..{count - 1}, got {index}")
        return cls(lo=index * HASH_SPACE // count, hi=(index + 1) * HASH_SPACE // count)

    @classmethod
    def parse(cls, text: str) -> PartitionFilter:
        """Parse the text form (see the module docstring)."""
        t = text.strip()
        if len(t) > 4200:
            raise BadRequestError(f"partition filter too long ({len(t)} characters)")
        if m := _MOD_RE.fullmatch(t):
            modulus = int(m.group(1))
            buckets: set[int] = set()
            for item in m.group(2).split(","):
                a, sep, b = item.partition("-")
                if not a or (sep and not b):
                    raise BadRequestError(f"bad bucket list item {item!r} in filter {text!r}")
                lo, hi = int(a), int(b) if sep else int(a)
                if hi < lo or hi - lo > 65536:
                    raise BadRequestError(f"bad bucket range {item!r} in filter {text!r}")
                buckets.update(range(lo, hi + 1))
            return cls.mod(modulus, buckets)
        if m := _RANGE_RE.fullmatch(t):
            hi_text = m.group(2)
            return cls.range(
                int(m.group(1), 0), HASH_SPACE if hi_text == "max" else int(hi_text, 0)
            )
        if m := _SLICE_RE.fullmatch(t):
            return cls.slice(int(m.group(1)), int(m.group(2)))
        raise BadRequestError(
            f"bad partition filter {t[:80]!r}: expected mod:N:B[,B-B...], range:LO:HI or slice:I/N"
        )

    # ---- evaluation ---------------------------------------------------

    def matches(self, hash_value: int) -> bool:
        """Whether one key hash passes."""
        if self.modulus is not None:
            return hash_value % self.modulus in self.buckets
        return self.lo <= hash_value < self.hi

    def mask(self, hashes: npt.NDArray[np.uint64]) -> npt.NDArray[np.bool_]:
        """Vectorised :meth:`matches` over an array of key hashes."""
        h = np.asarray(hashes, dtype=np.uint64)
        if self.modulus is not None:
            rem = h % np.uint64(self.modulus)
            table = np.zeros(self.modulus, dtype=bool)
            table[list(self.buckets)] = True
            result: npt.NDArray[np.bool_] = table[rem.astype(np.intp)]
            return result
        lo_ok = h >= np.uint64(self.lo)
        if self.hi >= HASH_SPACE:
            return lo_ok
        return lo_ok & (h < np.uint64(self.hi))

    def __str__(self) -> str:
        if self.modulus is not None:
            return f"mod:{self.modulus}:{','.join(map(str, sorted(self.buckets)))}"
        hi = "max" if self.hi >= HASH_SPACE else f"0x{self.hi:016x}"
        return f"range:0x{self.lo:016x}:{hi}"


def source_table(source_ids: Collection[int]) -> npt.NDArray[np.bool_]:
    """A lookup table for :func:`event_mask`: ``table[source_id]`` is True when subscribed.

    Source ids are u16 in the event header, so the table has 65,536 entries;
    build it once per request and pass it for every block of headers.
    """
    table = np.zeros(1 << 16, dtype=bool)
    ids = sorted(source_ids)
    if ids and not (ids[0] >= 0 and ids[-1] < 1 << 16):
        raise BadRequestError(f"source ids must be within 0..65535, got {ids[0]}..{ids[-1]}")
    table[ids] = True
    return table


def event_mask(
    headers: npt.NDArray[np.void],
    key_filter: PartitionFilter | None = None,
    sources: npt.NDArray[np.bool_] | Collection[int] | None = None,
) -> npt.NDArray[np.bool_]:
    """Which of ``headers`` a subscriber receives (see "Subscriptions" above).

    ``headers`` is a structured array with at least ``op``, ``key_hash`` and
    ``source_id`` fields (the event header dtype or the relay's event table).
    ``sources`` is a :func:`source_table` or a collection of source ids;
    ``None`` subscribes to every source, and ``key_filter=None`` to every key.
    Control events are always kept: a consumer needs the window boundaries
    and schema changes whatever it filters.
    """
    ops = headers["op"]
    control: npt.NDArray[np.bool_] = ops >= FIRST_CONTROL_OP
    if key_filter is None and sources is None:
        return np.ones(ops.shape, dtype=bool)
    data = ~control
    if key_filter is not None:
        data &= key_filter.mask(headers["key_hash"])
    if sources is not None:
        table = sources if isinstance(sources, np.ndarray) else source_table(sources)
        data &= table[headers["source_id"]]
    return control | data
