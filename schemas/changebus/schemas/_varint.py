"""Avro ``int``/``long`` bytes (zig-zag, then a little-endian base-128 varint), fast.

Every encoder of changebus writes many of these per row (integers, lengths,
timestamps in µs), so the bytes come from tables instead of a loop: the
varint of each value below 2**14 is precomputed, and a larger value is 14
bits at a time, two bytes with the continuation bit each, then the varint of
the rest. Values up to 56 significant bits (timestamps in µs since 1970)
take at most four lookups; only larger ones run the loop.

Thread-safety: pure functions over immutable tables.
"""

from __future__ import annotations

from typing import Final

__all__ = ["AVRO_PRESENT_SMALL", "avro_long", "avro_present_long"]


def _varint(z: int) -> bytes:
    out = bytearray()
    while z >= 0x80:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


_SMALL: Final = tuple(_varint(z) for z in range(0x4000))
#: 14 bits as two varint bytes, both with the continuation bit
_LOW14: Final = tuple(bytes(((z & 0x7F) | 0x80, (z >> 7) | 0x80)) for z in range(0x4000))
#: the union branch "present" (0x02) followed by a small varint
_PRESENT_SMALL: Final = tuple(b"\x02" + b for b in _SMALL)
#: ``avro_present_long(n)`` for ``0 <= n < 8192``, by ``n`` (lengths, counts): a lookup
#: instead of a call where a generated encoder writes one per value
AVRO_PRESENT_SMALL: Final = _PRESENT_SMALL[0::2]


def avro_long(n: int) -> bytes:
    """The Avro binary of the ``int``/``long`` ``n``."""
    z = (n << 1) ^ (n >> 63)
    if z < 0x4000:
        return _SMALL[z]
    t = _LOW14
    if z < 0x10000000:
        return t[z & 0x3FFF] + _SMALL[z >> 14]
    if z < 0x40000000000:
        return t[z & 0x3FFF] + t[(z >> 14) & 0x3FFF] + _SMALL[z >> 28]
    if z < 0x100000000000000:
        return t[z & 0x3FFF] + t[(z >> 14) & 0x3FFF] + t[(z >> 28) & 0x3FFF] + _SMALL[z >> 42]
    return _varint(z)


def avro_present_long(n: int) -> bytes:
    """``0x02`` (the value branch of a ``["null", long]`` union), then :func:`avro_long`."""
    z = (n << 1) ^ (n >> 63)
    if z < 0x4000:
        return _PRESENT_SMALL[z]
    return b"\x02" + avro_long(n)
