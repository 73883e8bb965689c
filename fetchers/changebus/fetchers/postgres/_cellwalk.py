"""The column walk of the generated row walkers: one block per column, runs in one struct call.

Two generated walkers read a row's cells column by column: the pgoutput
tuple walker of :class:`~._transcode.Transcoder` and the binary COPY row
walker of :class:`~._copyenc.CopyEncoder`. Both write the same body for
each row; the cells differ only in their framing (pgoutput: a kind byte and
a 4-byte length; COPY: a 4-byte length, -1 for NULL). :func:`walk_lines`
is the walk both use; a :class:`CellFormat` says how that format's cells
look.

Runs: adjacent columns of fixed-width rules (:data:`RUN_FORMATS`: integers,
bool, date, time, timestamp) are read with one ``struct`` call whose format
holds each cell's head and value, when the run fits in the buffer and every
head is the expected one (no NULL, nothing unchanged): the usual row. Else
the run's columns are read one by one (``CellFormat.cell``). The run's
values go from the unpacked integer ``x`` to ``p<i>`` (and ``k<i>`` for a
key column) by the snippets of :data:`FROM_X`.

Generated names: ``buf``, ``pos``, ``size`` (``len(buf)``), ``r`` (a run's
values), ``x``, ``e``, ``p<i>``, ``k<i>``; ``RUN<i>`` (a run's
``unpack_from``) and ``general<i>`` (a column on the general path) are put
in ``env``; the snippets' own names come from
:func:`~._transcode.walker_env`.

Thread-safety: pure functions of their arguments (``env`` is written).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from changebus.schemas import TableSchema

from .._policy import ColumnRule
from ._types import ColumnType

__all__ = [
    "FROM_X",
    "RUN_FORMATS",
    "CellFormat",
    "key_expr",
    "name_p",
    "nullable_key",
    "walk_lines",
]

#: fixed-width rules read in struct runs: (struct code, width)
RUN_FORMATS: Final = {
    "int2": ("h", 2), "int4": ("i", 4), "int8": ("q", 8), "oid": ("I", 4), "bool": ("B", 1),
    "date": ("i", 4), "time": ("q", 8), "timestamp": ("q", 8),
}  # fmt: skip
#: code from the integer `x` (a run's value) to `p` (and `e`, for key columns)
FROM_X: Final = {
    "int2": ("e = zz(x)", "p = pzz(x)"),
    "int4": ("e = zz(x)", "p = pzz(x)"),
    "int8": ("e = zz(x)", "p = pzz(x)"),
    "oid": ("e = zz(x)", "p = pzz(x)"),
    "bool": (
        "if x > 1: raise Fallback\ne = BOOL_BY_INT[x]",
        "if x > 1: raise Fallback\np = PBOOL_BY_INT[x]",
    ),
    "date": (
        "if x < DAY_MIN or x > DAY_MAX: raise Fallback\ne = zz(x + PG_EPOCH_DAYS)",
        "if x < DAY_MIN or x > DAY_MAX: raise Fallback\np = pzz(x + PG_EPOCH_DAYS)",
    ),
    "time": (
        "if x < 0 or x > DAY_US: raise Fallback\ne = zz(x)",
        "if x < 0 or x > DAY_US: raise Fallback\np = pzz(x)",
    ),
    "timestamp": (
        "if x < US_MIN or x > US_MAX: raise Fallback\ne = zz(x + PG_EPOCH_US)",
        "p = TS.get(x)\nif p is None: p = present_ts(x)",
    ),
}

#: lines reading one cell at ``pos``: (rule, column, is_key, indent, type) -> lines
CellLines = Callable[[str | None, int, bool, str, ColumnType], list[str]]


@dataclass(frozen=True, slots=True)
class CellFormat:
    """How the cells of one wire format are framed, for :func:`walk_lines`.

    ``head_code``: the ``struct`` code of the head before a value in a run;
    ``head``: the head a present cell of a fixed-width rule has, as Python
    source (compared with the unpacked head); ``min_run``: the fewest
    adjacent fixed-width columns read as a run; ``inline``: rewrites a value
    snippet of :data:`FROM_X`; ``cell`` and ``skip``: lines reading one cell
    the general way and stepping over one (an excluded column).
    """

    head_code: str
    head: Callable[[str], str]
    min_run: int
    inline: Callable[[str], str]
    cell: CellLines
    skip: Callable[[str], list[str]]


def name_p(code: str, i: int) -> str:
    """A snippet's variable ``p`` renamed to column i's ``p<i>``."""
    return re.sub(r"\bp\b", f"p{i}", code)


def nullable_key(key: Sequence[int], table: TableSchema) -> frozenset[int]:
    """The column indexes in ``key`` whose key bytes are ``["null", T]`` (all or none)."""
    return frozenset(key) if table.nullable_key else frozenset()


def key_expr(key: tuple[int, ...], nullable: frozenset[int]) -> str:
    """The expression of a row's key bytes: its key columns' ``k<i>`` in key order.

    A key column of a table with ``nullable_key`` (``nullable``: column
    indexes) is a ``["null", T]`` field of the key record, whose bytes are its
    ``p<i>`` (a NULL key column
    never gets there: the walk hands it to the general path).
    """
    return " + ".join(f"p{c}" if c in nullable else f"k{c}" for c in key) if key else "b''"


def walk_lines(
    fmt: CellFormat,
    types: Sequence[ColumnType],
    policy: Sequence[ColumnRule | None],
    rules: Sequence[str | None],
    key: tuple[int, ...],
    env: dict[str, Any],
    indent: str,
    general: Callable[[int], Any],
) -> list[str]:
    """The lines reading every column of a row at ``pos`` (module docstring).

    ``rules``: each column's transcoding rule (None: the general path, for
    which ``env["general<i>"] = general(i)``); ``policy``: each column's
    policy rule (an excluded column is stepped over).
    """
    lines: list[str] = []
    i = 0
    while i < len(types):
        j = i
        while j < len(types) and rules[j] in RUN_FORMATS:
            j += 1
        if j - i >= fmt.min_run:  # columns i..j-1 form a run of fixed-width columns
            lines += _run_lines(fmt, range(i, j), types, rules, key, env, indent)
            i = j
            continue
        column_rule = policy[i]
        if column_rule is not None and column_rule.action == "exclude":
            lines += fmt.skip(indent)
            i += 1
            continue
        if rules[i] is None:
            env[f"general{i}"] = general(i)
        lines += fmt.cell(rules[i], i, i in key, indent, types[i])
        i += 1
    return lines


def _run_lines(
    fmt: CellFormat,
    run: range,
    types: Sequence[ColumnType],
    rules: Sequence[str | None],
    key: tuple[int, ...],
    env: dict[str, Any],
    indent: str,
) -> list[str]:
    """One struct call for the run's cells when all are present; else cell by cell."""
    first = run[0]
    layout = ">" + "".join(fmt.head_code + RUN_FORMATS[str(rules[c])][0] for c in run)
    width = struct.calcsize(layout)
    env[f"RUN{first}"] = struct.Struct(layout).unpack_from
    heads = " and ".join(f"r[{2 * n}] == {fmt.head(str(rules[c]))}" for n, c in enumerate(run))
    inner = indent + "    "
    lines = [
        f"{indent}r = RUN{first}(buf, pos) if pos + {width} <= size else None",
        f"{indent}if r is not None and {heads}:",
        f"{inner}pos += {width}",
    ]
    for n, c in enumerate(run):
        lines.append(f"{inner}x = r[{2 * n + 1}]")
        lines += _value_lines(fmt, str(rules[c]), c, c in key, inner)
    lines.append(f"{indent}else:")
    for c in run:
        lines += fmt.cell(rules[c], c, c in key, inner, types[c])
    return lines


def _value_lines(fmt: CellFormat, rule: str, i: int, is_key: bool, indent: str) -> list[str]:
    """Lines from a run's integer ``x`` to ``p<i>`` (and ``k<i>``)."""
    code_e, code_p = (fmt.inline(c) for c in FROM_X[rule])
    if is_key:
        return [indent + line for line in code_e.split("\n")] + [
            f"{indent}p{i} = b'\\x02' + e",
            f"{indent}k{i} = e",
        ]
    return [indent + line for line in name_p(code_p, i).split("\n")]
