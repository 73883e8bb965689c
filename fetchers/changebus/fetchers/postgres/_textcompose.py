"""Postgres' text form of types built from others: ranges, multiranges, composites, arrays.

Each function here takes the renderers (binary value -> text, see
:mod:`._pgtext`) of the parts and returns the renderer of the whole, as
Postgres' output functions write it: ``[1,5)`` and ``empty``
(``range_out``), ``{[1,3),[5,7)}`` (``multirange_out``), ``(1,"a b",,"")``
(``record_out``: a NULL field is empty), ``{1,NULL,"a b"}`` and
``[0:1]={1,2}`` (``array_out``). A part is put in double quotes when it is
empty or holds white space or a character with a meaning in the whole;
inside the quotes ranges and composites double ``"`` and ``\\``, arrays
escape them with a backslash.

:data:`BUILTIN` holds the renderers of the built-in ranges and multiranges
(``int4range`` ... ``datemultirange``) by type OID; the resolver builds those
of other range types from their bound type (``pg_range``). Renderers raise
``ValueError`` (or ``struct.error``, ``IndexError``) on a malformed value.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from typing import Final

from ._pgtext import TEXT, Render

__all__ = ["BUILTIN", "array_text", "multirange_text", "range_text", "record_text"]

_I32: Final = struct.Struct(">i")
#: white space as C's isspace() sees it (the output functions' quoting rule)
_SPACE: Final = frozenset(" \t\n\v\f\r")
#: range flags (rangetypes.h)
_EMPTY: Final = 0x01
_LB_INC: Final = 0x02
_UB_INC: Final = 0x04
_LB_INF: Final = 0x08
_UB_INF: Final = 0x10


def _quote(text: str, specials: str) -> str:
    """``text`` in double quotes (``"`` and ``\\`` escaped by a backslash) when empty or
    holding a special character or white space: array elements."""
    if not text or any(c in specials or c in _SPACE for c in text):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return text


def _doubled(text: str, specials: str) -> str:
    """``text`` in double quotes (``"`` and ``\\`` doubled) when empty or holding a
    special character or white space: range bounds and composite fields."""
    if not text or any(c in specials or c in _SPACE for c in text):
        return '"' + text.replace("\\", "\\\\").replace('"', '""') + '"'
    return text


def _range_bound(text: str) -> str:
    return _doubled(text, '"\\()[],')


def _record_field(text: str) -> str:
    return _doubled(text, '"\\(),')


def range_text(bound: Render) -> Render:
    """The renderer of a range whose bounds ``bound`` renders: ``[1,5)``, ``empty``."""

    def render(b: bytes) -> str:
        flags = b[0]
        if flags & _EMPTY:
            if len(b) != 1:
                raise ValueError("trailing bytes after an empty range")
            return "empty"
        pos = 1
        texts = []
        for inf in (_LB_INF, _UB_INF):
            if flags & inf:
                texts.append("")
                continue
            (size,) = _I32.unpack_from(b, pos)
            value = b[pos + 4 : pos + 4 + size]
            if size < 0 or len(value) != size:
                raise ValueError("a range bound past the value's end")
            texts.append(_range_bound(bound(value)))
            pos += 4 + size
        if pos != len(b):
            raise ValueError("trailing bytes after a range")
        return (
            ("[" if flags & _LB_INC else "(")
            + f"{texts[0]},{texts[1]}"
            + ("]" if flags & _UB_INC else ")")
        )

    return render


def multirange_text(one_range: Render) -> Render:
    """The renderer of a multirange of ranges ``one_range`` renders: ``{[1,3),[5,7)}``."""

    def render(b: bytes) -> str:
        (count,) = _I32.unpack_from(b)
        pos, out = 4, []
        for _ in range(count):
            (size,) = _I32.unpack_from(b, pos)
            value = b[pos + 4 : pos + 4 + size]
            if size < 0 or len(value) != size:
                raise ValueError("a range past the multirange's end")
            out.append(one_range(value))
            pos += 4 + size
        if pos != len(b):
            raise ValueError("trailing bytes after a multirange")
        return "{" + ",".join(out) + "}"

    return render


def record_text(
    fields: Sequence[tuple[int, Render]], fallback: Callable[[int], Render | None] | None = None
) -> Render:
    """The renderer of a composite value whose fields are ``(type OID, renderer)``, in order:
    ``(1,"a b",,"")`` (a NULL field is empty, an empty string ``""``).

    A composite value names its own fields' type OIDs. One that does not
    match ``fields`` (the type was altered since it was looked up, or the
    value is older WAL from before an ``ALTER TYPE``) is rendered field by
    field with ``fallback(oid)``'s renderer instead of stopping the stream; a
    field type without one is an error.
    """

    def render(b: bytes) -> str:
        (count,) = _I32.unpack_from(b)
        exact = count == len(fields)
        pos, out = 4, []
        for i in range(count):
            got, size = struct.unpack_from(">Ii", b, pos)
            field = fields[i][1] if exact and fields[i][0] == got else None
            if field is None:
                field = fallback(got) if fallback is not None else None
                if field is None:
                    raise ValueError(
                        f"a composite field of type oid {got}, which its type does not have "
                        "(altered since?) and changebus cannot render"
                    )
            pos += 8
            if size < 0:
                out.append("")
                continue
            value = b[pos : pos + size]
            if len(value) != size:
                raise ValueError("a composite field past the value's end")
            out.append(_record_field(field(value)))
            pos += size
        if pos != len(b):
            raise ValueError("trailing bytes after a composite value")
        return "(" + ",".join(out) + ")"

    return render


def array_text(element: Render, delimiter: str = ",") -> Render:
    """The renderer of an array of elements ``element`` renders: ``{1,NULL,"a b"}``,
    ``{{1,2},{3,4}}``, ``[0:1]={1,2}`` for lower bounds other than 1."""
    specials = '{}"\\' + delimiter

    def quote(text: str) -> str:
        if text.upper() == "NULL":
            return f'"{text}"'
        return _quote(text, specials)

    def render(b: bytes) -> str:
        ndim, _flags, _elem = struct.unpack_from(">iiI", b)
        if ndim == 0:
            return "{}"
        dims = struct.unpack_from(f">{2 * ndim}i", b, 12)
        pos = 12 + 8 * ndim
        lengths = dims[0::2]
        flat: list[str] = []
        for _ in range(math.prod(lengths)):
            (size,) = _I32.unpack_from(b, pos)
            pos += 4
            if size < 0:
                flat.append("NULL")
                continue
            value = b[pos : pos + size]
            if len(value) != size:
                raise ValueError("an array element past the value's end")
            flat.append(quote(element(value)))
            pos += size
        if pos != len(b):
            raise ValueError("trailing bytes after an array")
        prefix = ""
        if any(lb != 1 for lb in dims[1::2]):
            prefix = (
                "".join(f"[{lb}:{lb + n - 1}]" for n, lb in zip(lengths, dims[1::2], strict=True))
                + "="
            )
        return prefix + _nest_text(flat, list(lengths), delimiter)

    return render


def _nest_text(flat: list[str], dims: list[int], delimiter: str) -> str:
    if len(dims) == 1:
        return "{" + delimiter.join(flat) + "}"
    step = len(flat) // dims[0]
    return (
        "{"
        + delimiter.join(
            _nest_text(flat[i * step : (i + 1) * step], dims[1:], delimiter) for i in range(dims[0])
        )
        + "}"
    )


#: the built-in ranges by their bound type, the built-in multiranges by their range type
_RANGES: Final = {3904: 23, 3906: 1700, 3908: 1114, 3910: 1184, 3912: 1082, 3926: 20}
_MULTIRANGES: Final = {4451: 3904, 4532: 3906, 4533: 3908, 4534: 3910, 4535: 3912, 4536: 3926}
#: renderers of the built-in ranges and multiranges, by type OID
BUILTIN: Final[dict[int, Render]] = {r: range_text(TEXT[b]) for r, b in _RANGES.items()}
BUILTIN.update((m, multirange_text(BUILTIN[r])) for m, r in _MULTIRANGES.items())
