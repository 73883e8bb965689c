"""Dates and times that Python cannot hold, written to a replica as the text the database reads.

The decoder hands a ``date`` / ``timestamp-micros`` / ``local-timestamp-micros``
value outside Python's years 1-9999 (a Postgres BC date, a year-10000
timestamp), and a ``time-micros`` of 24:00:00, as the Avro int itself (days,
or microseconds, since 1970-01-01; microseconds since midnight). Bound as an
int, PostgreSQL refused it for a date or time column on every retry (no cast
from integer), and SQLite stored the number. :func:`wide_values` gives, per
column of such a type, a function that turns those ints into the text both
read: ``0044-03-15 BC``, ``10000-01-01 00:00:00+00``, ``24:00:00`` (SQLite
keeps dates as ISO text anyway). Other values pass unchanged, and so do the
ints of a MySQL zero date in a key column (:data:`MYSQL_ZERO_DATE_KEY`:
no database date holds them).

Pure functions; thread-safe.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Final

from changebus.schemas import MYSQL_ZERO_DATE_KEY, TableSchema

from ._model import ChangeEvent

__all__ = ["date_text", "wide_values", "written"]

_DAY_US: Final = 86_400_000_000
#: the MySQL zero-date key range: ``MYSQL_ZERO_DATE_KEY + (year << 9 | month << 5 | day)``,
#: or with the time of day (below every real date either way)
_ZERO_KEYS: Final = range(MYSQL_ZERO_DATE_KEY, MYSQL_ZERO_DATE_KEY + (1 << 30))


def _civil(days: int) -> tuple[int, int, int]:
    """(astronomical year, month, day) of ``days`` since 1970-01-01, proleptic Gregorian."""
    z = days + 719_468
    era = z // 146_097
    doe = z - era * 146_097
    yoe = (doe - doe // 1460 + doe // 36_524 - doe // 146_096) // 365
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    day = doy - (153 * mp + 2) // 5 + 1
    month = mp + 3 if mp < 10 else mp - 9
    return yoe + era * 400 + (month <= 2), month, day


def date_text(days: int, clock: str = "", zone: str = "") -> str:
    """``YYYY-MM-DD[ clock][zone][ BC]`` of ``days`` since 1970-01-01 (year 0 is 1 BC)."""
    year, month, day = _civil(days)
    era = ""
    if year <= 0:
        year, era = 1 - year, " BC"
    return f"{year:04d}-{month:02d}-{day:02d}{' ' + clock if clock else ''}{zone}{era}"


def _clock(us: int) -> str:
    secs, micros = divmod(us, 1_000_000)
    return f"{secs // 3600:02d}:{secs // 60 % 60:02d}:{secs % 60:02d}.{micros:06d}"


def _date(v: Any) -> Any:
    if type(v) is not int or v in _ZERO_KEYS:
        return v
    return date_text(v)


def _timestamp(zone: str) -> Callable[[Any], Any]:
    def convert(v: Any) -> Any:
        if type(v) is not int or v in _ZERO_KEYS:
            return v
        days, us = divmod(v, _DAY_US)
        return date_text(days, _clock(us), zone)

    return convert


def _time(v: Any) -> Any:
    return "24:00:00" if type(v) is int and v == _DAY_US else v


_BY_LOGICAL: Final[dict[str, Callable[[Any], Any]]] = {
    "date": _date,
    "timestamp-micros": _timestamp("+00"),
    "local-timestamp-micros": _timestamp(""),
    "time-micros": _time,
}


@functools.lru_cache(maxsize=1024)
def wide_values(schema: TableSchema) -> dict[str, Callable[[Any], Any]]:
    """Column name -> the converter of its wide ints, for the columns that may carry them."""
    out: dict[str, Callable[[Any], Any]] = {}
    for column in schema.columns:
        t = column.type
        if isinstance(t, dict) and t.get("type") in ("int", "long"):
            convert = _BY_LOGICAL.get(str(t.get("logicalType")))
            if convert is not None:
                out[column.name] = convert
    return out


def _image(row: dict[str, Any] | None, convert: dict[str, Callable[[Any], Any]]) -> Any:
    """``row`` with its wide ints converted (the same dict when none is there)."""
    if not row:
        return row
    changed = {c: f(row[c]) for c, f in convert.items() if type(row.get(c)) is int}
    return {**row, **changed} if changed else row


def written(e: ChangeEvent) -> ChangeEvent:
    """``e`` as a replica writes it: wide ints of its date and time columns as text (a
    copy; ``e`` itself is left as the application sees it)."""
    if e.schema is None:
        return e
    convert = wide_values(e.schema)
    if not convert:
        return e
    key, after, before = _image(e.key, convert), _image(e.after, convert), _image(e.before, convert)
    if key is e.key and after is e.after and before is e.before:
        return e
    return dataclasses.replace(e, key=key, after=after, before=before)
