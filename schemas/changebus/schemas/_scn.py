"""SCNs: the source's own commit clock as one 64-bit number.

An SCN (system change number) orders the transactions of one physical source:
it is strictly increasing in commit order, so "everything after SCN x" is a
well-defined position. changebus keeps SCNs within ``0 .. 2**63 - 1`` so they
fit signed 64-bit fields too (Avro ``long``, Spark ``LongType``).

* **Postgres**: the transaction's commit LSN (``X/Y`` in Postgres notation is
  ``X << 32 | Y``). Unique per transaction and increasing in commit order on
  one timeline.
* **MySQL / MariaDB**: ``binlog file number << 32 | end position`` of the
  transaction's commit event. Increasing across rotations and restarts of one
  server, but *not* comparable across servers: after a failover the new
  primary's binlog names restart. The GTID of each transaction therefore
  travels in its END_OF_WINDOW event (``source_position``), and the fetcher
  maps GTIDs to SCNs when it resumes on another server.

``NO_SCN`` (-1) means "no position".
"""

from __future__ import annotations

import re
from typing import Final, Literal

from .errors import BadRequestError

__all__ = [
    "MAX_SCN",
    "NO_SCN",
    "binlog_file_number",
    "binlog_to_scn",
    "format_scn",
    "lsn_to_scn",
    "parse_scn",
    "scn_to_binlog",
    "scn_to_lsn",
]

NO_SCN: Final = -1
MAX_SCN: Final = 2**63 - 1

_LSN_RE: Final = re.compile(r"([0-9A-Fa-f]{1,8})/([0-9A-Fa-f]{1,8})")
_BINLOG_RE: Final = re.compile(r"([0-9]{1,10}):([0-9]{1,10})")
_BINLOG_NAME_RE: Final = re.compile(r".*?\.([0-9]+)")


def _check(scn: int) -> int:
    if not 0 <= scn <= MAX_SCN:
        raise BadRequestError(f"SCN {scn} is outside 0..2**63-1")
    return scn


def lsn_to_scn(lsn: str) -> int:
    """SCN of a Postgres LSN written ``X/Y`` (hex, case-insensitive)."""
    m = _LSN_RE.fullmatch(lsn.strip())
    if not m:
        raise BadRequestError(f"bad Postgres LSN {lsn!r}: expected hex 'X/Y', e.g. '16/B374D848'")
    return _check((int(m.group(1), 16) << 32) | int(m.group(2), 16))


def scn_to_lsn(scn: int) -> str:
    """The Postgres ``X/Y`` form of an SCN."""
    _check(scn)
    return f"{scn >> 32:X}/{scn & 0xFFFFFFFF:X}"


def binlog_to_scn(file_number: int, position: int) -> int:
    """SCN of a binlog position: ``file_number << 32 | position``."""
    if not 0 <= file_number < 2**31:
        raise BadRequestError(f"binlog file number {file_number} is outside 0..2**31-1")
    if not 0 <= position < 2**32:
        raise BadRequestError(f"binlog position {position} is outside 0..2**32-1")
    return (file_number << 32) | position


def scn_to_binlog(scn: int) -> tuple[int, int]:
    """``(file_number, position)`` of a binlog-based SCN."""
    _check(scn)
    return scn >> 32, scn & 0xFFFFFFFF


def binlog_file_number(name: str) -> int:
    """The numeric suffix of a binlog file name (``mysql-bin.000123`` -> 123)."""
    m = _BINLOG_NAME_RE.fullmatch(name)
    if not m or len(m.group(1)) > 10:
        raise BadRequestError(f"binlog file name {name!r} has no numeric suffix")
    return int(m.group(1))


def format_scn(scn: int, kind: Literal["plain", "pg", "mysql"] = "plain") -> str:
    """Text form of an SCN: decimal, Postgres LSN, or ``file:position``."""
    if kind == "pg":
        return scn_to_lsn(scn)
    if kind == "mysql":
        f, p = scn_to_binlog(scn)
        return f"{f}:{p}"
    return str(_check(scn))


def parse_scn(text: str) -> int:
    """Parse a decimal SCN, a Postgres LSN ``X/Y`` or a binlog ``file:position``."""
    t = text.strip()
    if t.isascii() and t.isdigit() and len(t) <= 19:  # ("²".isdigit() and "١٢".isdigit() too)
        return _check(int(t))
    if "/" in t:
        return lsn_to_scn(t)
    m = _BINLOG_RE.fullmatch(t)
    if m:
        return binlog_to_scn(int(m.group(1)), int(m.group(2)))
    raise BadRequestError(
        f"bad SCN {text[:40]!r}: expected a decimal number, a Postgres LSN 'X/Y' or a binlog 'file:position'"
    )
