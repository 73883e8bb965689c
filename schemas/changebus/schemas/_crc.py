"""CRC-32 (the zlib/IEEE polynomial) from the fastest implementation at hand.

zlib-ng's SIMD implementation computes exactly the same values as zlib's
``crc32`` about three times faster on kilobyte inputs; the standard library
is the fallback. Every changebus checksum goes through :func:`crc32`.
"""

from __future__ import annotations

try:
    from zlib_ng.zlib_ng import crc32 as crc32
except ImportError:  # pragma: no cover - zlib-ng is a declared dependency
    from zlib import crc32 as crc32

__all__ = ["crc32"]
