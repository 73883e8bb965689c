"""The generated row decoder: binlog row images to Python rows, per table layout.

:func:`compile_decoder` generates, per layout, one straight-line Python
function that reads row images from the raw bytes of a rows event and
returns rows with values of the Python types :class:`RowEncoder` (fastavro)
takes for the column's Avro type (:mod:`._codecs`). Zero dates
(``0000-00-00``) have no Avro value: the column is listed as not sent. That
is the fetcher's own decoder: about 4-8x faster than mysql-replication's
generic per-column reader (docs/benchmarks.md). The transcoders
(:mod:`._transcoder`) reuse its per-column statements (:func:`value_code`)
for the types they do not write directly.

Decoders are pure functions and may be shared between threads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from changebus.schemas import SourceConfigError

from ._codecs import HELPERS, decimal_size, row_loop_head
from ._columns import (
    T_BIT,
    T_BLOB,
    T_DATE,
    T_DATETIME2,
    T_DOUBLE,
    T_ENUM,
    T_FLOAT,
    T_GEOMETRY,
    T_INT24,
    T_LONG,
    T_LONGLONG,
    T_NEWDECIMAL,
    T_SET,
    T_SHORT,
    T_STRING,
    T_TIME2,
    T_TIMESTAMP2,
    T_TINY,
    T_VAR_STRING,
    T_VARCHAR,
    T_YEAR,
    ColumnLayout,
    TableLayout,
    base_type,
)

__all__ = ["RowsDecoder", "compile_decoder", "value_code"]

#: (raw event bytes, start, end, images per row) -> list of (row, not_sent) per image
RowsDecoder = Callable[[bytes, int, int, int], list[tuple[dict[str, Any], list[str] | None]]]

_INT_SIZES: Final = {T_TINY: 1, T_SHORT: 2, T_INT24: 3, T_LONG: 4, T_LONGLONG: 8}


def value_code(c: ColumnLayout, i: int) -> list[str]:
    """Statements that read column ``c`` at ``pos`` into ``@v`` and advance ``pos``."""
    t = c.binlog_type
    base = base_type(c.source_type)
    if t in _INT_SIZES:
        size = _INT_SIZES[t]
        if size == 3:
            code = ["@v = _from(buf[pos:pos + 3], 'little', signed=%s)" % (not c.unsigned)]
        else:
            fn = {1: "8", 2: "16", 4: "32", 8: "64"}[size]
            if size == 1:
                code = ["@v = buf[pos]" if c.unsigned else "@v = _i8(buf, pos)[0]"]
            else:
                code = [f"@v = _{'u' if c.unsigned else 'i'}{fn}(buf, pos)[0]"]
        if t == T_LONGLONG and c.unsigned:
            code.append("@v = _dec(@v)")
        if c.avro == "boolean":
            code.append("@v = @v != 0")
        return [*code, f"pos += {size}"]
    if t == T_FLOAT:
        return ["@v = _f32(buf, pos)[0]", "pos += 4"]
    if t == T_DOUBLE:
        return ["@v = _f64(buf, pos)[0]", "pos += 8"]
    if t == T_YEAR:
        return ["@v = buf[pos]", "@v = @v + 1900 if @v else 0", "pos += 1"]
    if t == T_NEWDECIMAL:
        p, s = c.m("precision"), c.m("scale")
        n = decimal_size(p, s)
        return [f"@v = _decimal(buf[pos:pos + {n}], {p}, {s})", f"pos += {n}"]
    if t == T_DATE:
        return [
            "@v = _date(buf[pos] | buf[pos + 1] << 8 | buf[pos + 2] << 16)",
            "pos += 3",
            f"if @v is None: ns = (ns or []) + [_name{i}]",
        ]
    if t == T_TIME2:
        fsp = c.m("fsp")
        return [f"@v = _time2(buf, pos, {fsp})", f"pos += {3 + (fsp + 1) // 2}"]
    if t == T_DATETIME2:
        fsp = c.m("fsp")
        return [
            f"@v = _datetime2(buf, pos, {fsp})",
            f"pos += {5 + (fsp + 1) // 2}",
            f"if @v is None: ns = (ns or []) + [_name{i}]",
        ]
    if t == T_TIMESTAMP2:
        fsp = c.m("fsp")
        frac = f" + _frac(buf, pos + 4, {fsp})" if fsp else ""
        return [
            "@v = _from(buf[pos:pos + 4], 'big')",
            f"@v = @v * 1000000{frac} if @v else None",
            f"pos += {4 + (fsp + 1) // 2}",
            f"if @v is None: ns = (ns or []) + [_name{i}]",
        ]
    if t == T_BIT:
        n = (c.m("bits") + 7) // 8
        return [f"@v = _bit(buf[pos:pos + {n}])", f"pos += {n}"]
    if t == T_ENUM:
        n = c.m("size")
        idx = "buf[pos]" if n == 1 else "_u16(buf, pos)[0]"
        return [f"@v = {idx}", f"@v = _labels{i}[@v - 1] if @v else ''", f"pos += {n}"]
    if t == T_SET:
        n = c.m("size")
        return [
            f"bits = _from(buf[pos:pos + {n}], 'little')",
            f"@v = sorted(s for b, s in enumerate(_labels{i}) if bits >> b & 1)",
            f"pos += {n}",
        ]
    if t in (T_VARCHAR, T_STRING, T_VAR_STRING):
        n = c.m("length")
        if n > 255:
            code = ["ln = _u16(buf, pos)[0]", "pos += 2"]
        else:
            code = ["ln = buf[pos]", "pos += 1"]
        if c.codec:
            code.append(f"@v = buf[pos:pos + ln].decode(_codec{i})")
        elif base == "uuid":
            code.append("@v = _uuid(buf[pos:pos + ln].ljust(16, b'\\0'))")
        elif base == "inet6":
            code.append("@v = _inet6(buf[pos:pos + ln].ljust(16, b'\\0'))")
        elif base == "inet4":
            code.append("@v = _ip4(buf[pos:pos + ln].ljust(4, b'\\0'))")
        elif t == T_STRING:
            # BINARY(n) is padded with zero bytes; the binlog strips trailing ones
            code.append(f"@v = buf[pos:pos + ln].ljust({n}, b'\\0')")
        else:
            code.append("@v = buf[pos:pos + ln]")
        return [*code, "pos += ln"]
    if t in (T_BLOB, T_GEOMETRY):
        n = c.m("length")
        code = [f"ln = _from(buf[pos:pos + {n}], 'little')", f"pos += {n}"]
        if c.codec:
            code.append(f"@v = buf[pos:pos + ln].decode(_codec{i})")
        else:
            code.append("@v = buf[pos:pos + ln]")
        return [*code, "pos += ln"]
    raise SourceConfigError(
        f"column {c.name!r} has binlog type {t}, which the mysql fetcher cannot decode "
        "(old pre-5.6 temporal formats: ALTER TABLE ... FORCE rebuilds them)"
    )


def compile_decoder(layout: TableLayout) -> RowsDecoder:
    """A decoder for the row images of ``layout`` (see the module docstring).

    The returned function takes ``(buf, start, end, images)``: the event
    bytes, the span holding the row images, and the images per row (1, or
    2 for updates: before, after). All columns must be present (FULL image).
    """
    cols = layout.columns
    nbytes = (len(cols) + 7) // 8
    lines = row_loop_head("decode(buf, pos, end, images)", nbytes)
    env = dict(HELPERS)
    rules = layout.rules
    for i, c in enumerate(cols):
        env[f"_labels{i}"], env[f"_name{i}"], env[f"_codec{i}"] = c.labels, c.name, c.codec
        rule = rules[i]
        stmts = value_code(c, i)
        if rule is not None and rule.action == "exclude":  # read past it, keep nothing
            stmts = [s for s in stmts if not s.startswith("if @v is None: ns")]
        lines.append(f"        if nulls >> {i} & 1:")
        lines.append(f"            v{i} = None")
        lines.append("        else:")
        lines.extend("            " + s.replace("@v", f"v{i}") for s in stmts)
        if rule is not None and rule.action != "exclude":
            env[f"_rule{i}"] = rule.apply
            lines.append(f"            if v{i} is not None: v{i} = _rule{i}(v{i})")
    # keys are names bound in the environment: no outside text in the generated code
    kept = [i for i, r in enumerate(rules) if r is None or r.action != "exclude"]
    row = ", ".join(f"_name{i}: v{i}" for i in kept)
    lines.append(f"        append(({{{row}}}, ns))")
    lines.append("    return out")
    source = "\n".join(lines)
    code = compile(source, f"<changebus mysql decoder {layout.name}>", "exec")
    exec(code, env)  # generated from the layout alone: no outside text in the code
    decoder: RowsDecoder = env["decode"]
    return decoder
