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

Limits (a filter is a request parameter): at most 4,200 characters, numbers
of at most 20 digits (:data:`~changebus.schemas.server.MAX_DIGITS`), a
modulus of at most 65,536 and at most 1,024 bucket list items; parsing the
largest filter costs milliseconds.

Both forms are evaluated on whole numpy arrays of hashes (:meth:`mask`), so a
relay filters thousands of headers without a Python loop.

Subscriptions
=============
:func:`event_mask` is the one definition of what a subscriber receives from a
block of event headers: the control events (op >= ``FIRST_CONTROL_OP``:
window ends, heartbeats, data-loss markers, ...) and the data events of the
subscribed sources whose key hash passes the filter. Two kinds of control
event belong to sources and follow the source subscription (never the key
filter): a schema change (its header's source id is its table's) and a
logical message (source id :data:`UNATTACHED`, 0: no table). A source
table that includes 0 passes messages (and schema changes written before
they carried their table's id); the servers include it for a consumer's own
``sources=`` choice but not for a principal granted only some sources, who
must not read application messages or other tables' definitions. The relay,
the bootstrap server and the Spark source all select with it.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass, field
from functools import cached_property
from typing import Final

import numpy as np
import numpy.typing as npt
import xxhash

from ._envelope import FIRST_CONTROL_OP, Op
from ._server_query import MAX_DIGITS
from .errors import BadRequestError

__all__ = [
    "HASH_SPACE",
    "UNATTACHED",
    "PartitionFilter",
    "event_mask",
    "key_hash",
    "source_table",
]

#: the source id of control events that belong to no table (logical messages); in a
#: source subscription, it stands for "messages too" (see "Subscriptions" above)
UNATTACHED: Final = 0

_SCHEMA_CHANGE: Final = int(Op.SCHEMA_CHANGE)
_MESSAGE: Final = int(Op.MESSAGE)
_TRUNCATE: Final = int(Op.TRUNCATE)

HASH_SPACE: Final = 1 << 64
#: The 64-bit partition hash of encoded key bytes (XXH3-64, seed 0).
key_hash = xxhash.xxh3_64_intdigest


# Bounded sizes: a filter is a request parameter, so parsing one must cost the
# server little whatever it says. Every number has at most MAX_DIGITS digits
# (checked before int(): a 5,000-digit number is a bad request, never a
# ValueError or a quadratic conversion), a mod filter's bucket list has at most
# MAX_BUCKET_ITEMS items, and the bucket table is built with numpy slices (one
# per item), never one Python step per bucket.
_MOD_RE: Final = re.compile(r"mod:([0-9]+):([0-9,\-]*)")
_ITEM_RE: Final = re.compile(r"([0-9]+)(?:-([0-9]+))?")
_RANGE_RE: Final = re.compile(r"range:(0x[0-9a-fA-F]+|[0-9]+):(0x[0-9a-fA-F]+|[0-9]+|max)")
_SLICE_RE: Final = re.compile(r"slice:([0-9]+)/([0-9]+)")
#: the largest modulus of a mod filter
MAX_MODULUS: Final = 65536
#: the most items (numbers or ranges) in a mod filter's bucket list
MAX_BUCKET_ITEMS: Final = 1024
#: the longest filter text accepted
MAX_FILTER_TEXT: Final = 4200


def _number(text: str, what: str, hi: int) -> int:
    """``text`` (decimal, or hex with ``0x``) as an int within ``0..hi``, else a bad request."""
    digits = text[2:] if text.startswith("0x") else text
    if len(digits) > MAX_DIGITS:
        raise BadRequestError(f"{what} must be within 0..{hi}, got a {len(digits)}-digit number")
    value = int(text, 0) if text.startswith("0x") else int(text)
    if value > hi:
        raise BadRequestError(f"{what} must be within 0..{hi}, got {value}")
    return value


@dataclass(frozen=True)
class PartitionFilter:
    """A set of key hashes: ``mod`` buckets or a ``[lo, hi)`` range.

    ``modulus`` set means a mod filter, else ``[lo, hi)``. A mod filter is
    its lookup table (``modulus`` booleans, at most 64 KiB: ``table[b]`` is
    true for every kept bucket ``b``), which :meth:`mask` indexes with
    ``hash % modulus``; it is also what makes two filters equal.
    :attr:`buckets` is built only when asked for: a filter is a request
    parameter, and ``mod:65536:0-65534`` as a set of ints is 4 MB (found by
    review). Instances are immutable and safe to share between threads.
    """

    modulus: int | None = None
    table: bytes = field(default=b"", repr=False)
    lo: int = 0
    hi: int = HASH_SPACE

    def __post_init__(self) -> None:
        if self.modulus is not None:
            if not 1 <= self.modulus <= MAX_MODULUS:
                raise BadRequestError(
                    f"mod filter modulus must be 1..{MAX_MODULUS}, got {self.modulus}"
                )
            if len(self.table) != self.modulus or not any(self.table):
                raise BadRequestError("a mod filter needs a bucket table of its modulus, not empty")
        elif not 0 <= self.lo < self.hi <= HASH_SPACE:
            raise BadRequestError(
                f"range filter needs 0 <= lo < hi <= 2**64, got [{self.lo}, {self.hi})"
            )

    def __repr__(self) -> str:
        return f"PartitionFilter({str(self)!r})"

    @cached_property
    def _table(self) -> npt.NDArray[np.bool_]:
        """:attr:`table` as a numpy view (mod filters only)."""
        return np.frombuffer(self.table, dtype=bool)

    @cached_property
    def buckets(self) -> frozenset[int]:
        """The kept buckets of a mod filter (empty for a range filter)."""
        if self.modulus is None:
            return frozenset()
        return frozenset(np.flatnonzero(self._table).tolist())

    # ---- constructors -------------------------------------------------

    @classmethod
    def mod(
        cls, modulus: int, buckets: int | set[int] | frozenset[int] | list[int]
    ) -> PartitionFilter:
        """Keep events whose ``key_hash % modulus`` is one of ``buckets``."""
        b = [buckets] if isinstance(buckets, int) else sorted(buckets)
        if not 1 <= modulus <= MAX_MODULUS:
            raise BadRequestError(f"mod filter modulus must be 1..{MAX_MODULUS}, got {modulus}")
        if not b or b[0] < 0 or b[-1] >= modulus:
            shown = f"{b[0]}..{b[-1]}" if b else "none"
            raise BadRequestError(
                f"mod filter buckets must be within 0..{modulus - 1}, got {shown}"
            )
        table = np.zeros(modulus, dtype=bool)
        table[b] = True
        return cls(modulus=modulus, table=table.tobytes())

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
        """Parse the text form (see the module docstring).

        Any text costs at most a few milliseconds (see the size limits
        above); anything malformed or out of range is a
        :class:`BadRequestError` with a short message.
        """
        t = text.strip()
        if len(t) > MAX_FILTER_TEXT:
            raise BadRequestError(f"partition filter too long ({len(t)} characters)")
        if m := _MOD_RE.fullmatch(t):
            return cls._parse_mod(m.group(1), m.group(2))
        if m := _RANGE_RE.fullmatch(t):
            lo = _number(m.group(1), "range filter lo", HASH_SPACE)
            hi_text = m.group(2)
            hi = HASH_SPACE if hi_text == "max" else _number(hi_text, "range filter hi", HASH_SPACE)
            return cls.range(lo, hi)
        if m := _SLICE_RE.fullmatch(t):
            count = _number(m.group(2), "slice count", HASH_SPACE)
            return cls.slice(_number(m.group(1), "slice index", HASH_SPACE), count)
        raise BadRequestError(
            f"bad partition filter {t[:80]!r}: expected mod:N:B[,B-B...], range:LO:HI or slice:I/N"
        )

    @classmethod
    def _parse_mod(cls, modulus_text: str, bucket_text: str) -> PartitionFilter:
        modulus = _number(modulus_text, "mod filter modulus", MAX_MODULUS)
        if modulus < 1:
            raise BadRequestError(f"mod filter modulus must be 1..{MAX_MODULUS}, got 0")
        items = bucket_text.split(",")
        if len(items) > MAX_BUCKET_ITEMS:
            raise BadRequestError(
                f"mod filter bucket list has {len(items)} items; at most {MAX_BUCKET_ITEMS}"
            )
        top = modulus - 1
        runs: list[tuple[int, int]] = []
        for item in items:
            im = _ITEM_RE.fullmatch(item)
            if im is None:
                raise BadRequestError(f"bad bucket list item {item[:40]!r} in a mod filter")
            lo = _number(im.group(1), "mod filter bucket", top)
            hi = lo if im.group(2) is None else _number(im.group(2), "mod filter bucket", top)
            if hi < lo:
                raise BadRequestError(f"bad bucket range {item!r} in a mod filter")
            runs.append((lo, hi))
        table = np.zeros(modulus, dtype=bool)
        end = -1  # overlapping runs are merged first: each table byte is set once
        for lo, hi in sorted(runs):
            if hi > end:
                table[max(lo, end + 1) : hi + 1] = True
                end = hi
        return cls(modulus=modulus, table=table.tobytes())

    # ---- evaluation ---------------------------------------------------

    def matches(self, hash_value: int) -> bool:
        """Whether one key hash passes."""
        if self.modulus is not None:
            return self.table[hash_value % self.modulus] != 0
        return self.lo <= hash_value < self.hi

    def mask(self, hashes: npt.NDArray[np.uint64]) -> npt.NDArray[np.bool_]:
        """Vectorised :meth:`matches` over an array of key hashes."""
        h = np.asarray(hashes, dtype=np.uint64)
        if self.modulus is not None:
            rem = h % np.uint64(self.modulus)
            result: npt.NDArray[np.bool_] = self._table[rem.astype(np.intp)]
            return result
        lo_ok = h >= np.uint64(self.lo)
        if self.hi >= HASH_SPACE:
            return lo_ok
        return lo_ok & (h < np.uint64(self.hi))

    def __str__(self) -> str:
        if self.modulus is not None:
            return f"mod:{self.modulus}:{_bucket_list(self._table)}"
        hi = "max" if self.hi >= HASH_SPACE else f"0x{self.hi:016x}"
        return f"range:0x{self.lo:016x}:{hi}"


def _bucket_list(table: npt.NDArray[np.bool_]) -> str:
    """The shortest bucket list text for a bucket table: runs become ``A-B``."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], table.view(np.int8), [0]))))
    starts, stops = edges[0::2], edges[1::2] - 1
    return ",".join(
        str(a) if a == b else f"{a}-{b}"
        for a, b in zip(starts.tolist(), stops.tolist(), strict=True)
    )


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
    Control events pass the key filter (a consumer needs the window boundaries
    whatever it filters), and so do TRUNCATE events (they have no key, and
    empty the table for every share of its keys); schema changes and messages
    follow ``sources``.
    """
    ops = headers["op"]
    control: npt.NDArray[np.bool_] = ops >= FIRST_CONTROL_OP
    if key_filter is None and sources is None:
        return np.ones(ops.shape, dtype=bool)
    data = ~control
    if key_filter is not None:
        # a TRUNCATE has no key (its hash is the empty key's): it empties the table
        # for every share of the keys, so every subscriber gets it
        data &= key_filter.mask(headers["key_hash"]) | (ops == _TRUNCATE)
    if sources is not None:
        table = sources if isinstance(sources, np.ndarray) else source_table(sources)
        subscribed = table[headers["source_id"]]
        data &= subscribed
        attached = (ops == _SCHEMA_CHANGE) | (ops == _MESSAGE)
        control &= subscribed | ~attached
    return control | data
