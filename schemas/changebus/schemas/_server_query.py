"""Query-parameter parsing for the daemons' HTTP handlers.

Every function here reads one parameter of a request's query (any
``Mapping[str, str]``, e.g. ``request.query``) and either returns a value of
the asked type within the asked bounds or raises :class:`BadRequestError`
(400, ``retriable: false``) naming the parameter. Nothing raised here is
ever "internal": a parse failure is the client's to fix, so a client must not
retry it.

Numbers are read with a strict grammar *before* converting them: at most
:data:`MAX_DIGITS` digits, ASCII only, no underscores or surrounding blanks.
This keeps a hostile 5,000-digit value from costing the server a quadratic
``int()`` conversion (or Python's own digit-limit ``ValueError``) and gives
every oversized value the same answer as an out-of-range one.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Mapping
from typing import TypeVar

from .errors import BadRequestError, ChangebusError

__all__ = [
    "MAX_DIGITS",
    "check_params",
    "query_choice",
    "query_float",
    "query_int",
    "query_parsed",
]

#: the longest integer text accepted (2**63 has 19 digits)
MAX_DIGITS = 20

_INT = re.compile(rf"[+-]?[0-9]{{1,{MAX_DIGITS}}}")
#: what only an over-long number matches (to say "out of range" rather than "not a number")
_LONG_INT = re.compile(r"[+-]?[0-9]+")
_LONG_DECIMAL = re.compile(r"[+-]?[0-9]+(?:\.[0-9]*)?")
_FLOAT = re.compile(r"[+-]?(?:[0-9]{1,20}(?:\.[0-9]{0,20})?|\.[0-9]{1,20})(?:[eE][+-]?[0-9]{1,3})?")
#: how much of a bad value an error message quotes
_QUOTE = 40

T = TypeVar("T")


def _quote(text: str) -> str:
    if len(text) <= _QUOTE:
        return repr(text)
    return f"{text[:_QUOTE]!r}... ({len(text)} characters)"


def check_params(query: Mapping[str, str], allowed: Collection[str]) -> None:
    """Reject parameters not in ``allowed`` (typos must not pass silently).

    ``allowed`` is best a ``frozenset`` built once (this runs on every request).
    """
    unknown = sorted({name for name in query if name not in allowed})
    if unknown:
        shown = ", ".join(name[:_QUOTE] for name in unknown[:10])
        raise BadRequestError(f"unknown parameter(s): {shown}")


def query_int(
    query: Mapping[str, str], name: str, *, default: int | None = None, lo: int, hi: int
) -> int:
    """The integer parameter ``name`` within ``lo..hi``; ``default`` when absent.

    With ``default=None`` the parameter is required.
    """
    text = query.get(name)
    if text is None:
        if default is None:
            raise BadRequestError(f"parameter {name} is required")
        return default
    if _INT.fullmatch(text) is None:
        if _LONG_INT.fullmatch(text):
            raise BadRequestError(
                f"parameter {name} must be within {lo}..{hi}, got a {len(text)}-character number"
            )
        raise BadRequestError(f"parameter {name} must be an integer, got {_quote(text)}")
    value = int(text)
    if not lo <= value <= hi:
        raise BadRequestError(f"parameter {name} must be within {lo}..{hi}, got {value}")
    return value


def query_float(
    query: Mapping[str, str], name: str, *, default: float, lo: float, hi: float
) -> float:
    """The decimal number parameter ``name`` within ``lo..hi``; ``default`` when absent.

    Only plain decimal notation is accepted (``1``, ``0.25``, ``2e-3``): no
    ``nan``, ``inf`` or hexadecimal.
    """
    text = query.get(name)
    if text is None:
        return default
    if _FLOAT.fullmatch(text) is None:
        if _LONG_DECIMAL.fullmatch(text):
            raise BadRequestError(
                f"parameter {name} must be within {lo}..{hi}, got a {len(text)}-character number"
            )
        raise BadRequestError(f"parameter {name} must be a number, got {_quote(text)}")
    value = float(text)
    if not (math.isfinite(value) and lo <= value <= hi):
        raise BadRequestError(f"parameter {name} must be within {lo}..{hi}, got {value}")
    return value


def query_choice(
    query: Mapping[str, str], name: str, choices: Collection[str], *, default: str
) -> str:
    """The parameter ``name``, which must be one of ``choices``; ``default`` when absent."""
    text = query.get(name)
    if text is None:
        return default
    if text not in choices:
        raise BadRequestError(f"parameter {name} must be {' or '.join(choices)}")
    return text


def query_parsed(query: Mapping[str, str], name: str, parse: Callable[[str], T]) -> T | None:
    """``parse(text)`` of the parameter ``name`` (None when absent).

    A :class:`ChangebusError` from ``parse`` passes through (e.g. a
    ``bad_checkpoint``); any ``ValueError``, ``TypeError``, ``OverflowError``
    or ``RecursionError`` (a parser meeting input it did not expect) becomes a
    :class:`BadRequestError` naming the parameter.
    """
    text = query.get(name)
    if text is None:
        return None
    try:
        return parse(text)
    except ChangebusError:
        raise
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        raise BadRequestError(
            f"parameter {name} is malformed: {str(exc)[:120] or type(exc).__name__}"
        ) from None
