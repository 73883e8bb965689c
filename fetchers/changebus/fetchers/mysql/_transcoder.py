"""The generated row transcoder: binlog row images straight to Avro bytes, per table layout.

:func:`compile_transcoder` generates, per layout, one straight-line Python
function from row images to the Avro bytes of the key record and of the row
record. Same values as :func:`._decoder.compile_decoder` followed by
fastavro, without the Python row in between: UTF-8 text, doubles and floats
are copied as they are in the binlog, decimals go from their packed form to
Avro's two's complement directly, datetimes are remembered by their packed
bytes. The other types reuse the decoder's statements
(:func:`._decoder.value_code`) and encode the value.

A transcoder remembers datetime encodings in bounded dicts of its own
(entries never change once written: a racing clear only costs a
recomputation); otherwise it is a pure function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from changebus.schemas import (
    MYSQL_ZERO_DATE_KEY,
    MYSQL_ZERO_DATETIME_KEY,
    AvroType,
    SourceConfigError,
)

from .._policy import ColumnRule
from ._codecs import ENCODERS, HELPERS, decimal_expr, decimal_size, row_loop_head
from ._columns import (
    T_BLOB,
    T_DATE,
    T_DATETIME2,
    T_DOUBLE,
    T_FLOAT,
    T_LONGLONG,
    T_NEWDECIMAL,
    T_STRING,
    T_TIMESTAMP2,
    T_VAR_STRING,
    T_VARCHAR,
    ColumnLayout,
    TableLayout,
)
from ._decoder import value_code

__all__ = ["RowsTranscoder", "compile_transcoder"]

#: (raw event bytes, start, end) -> list of (key, row, not_sent) per image: the Avro
#: bytes of the key record and of the row record, the columns not sent (or None)
RowsTranscoder = Callable[[bytes, int, int], list[tuple[bytes, bytes, list[str] | None]]]


def _frac_expr(fsp: int, at: str) -> str:
    """:func:`_frac` inlined into generated code (a function call less per value)."""
    if fsp <= 2:
        return f"buf[{at}] * 10000"
    if fsp <= 4:
        return f"_from(buf[{at}:{at} + 2], 'big') * 100"
    return f"_from(buf[{at}:{at} + 3], 'big')"


def _avro_kind(avro: AvroType) -> str:
    """The Avro physical type of a column type (with ``decimal`` for the logical one)."""
    if isinstance(avro, dict):
        if avro.get("logicalType") == "decimal":
            return "decimal"
        return str(avro["type"])
    return str(avro)


#: values remembered per column by a transcoder (datetimes)
_MEMO_ENTRIES: Final = 4096


def _transcode_code(c: ColumnLayout, i: int) -> list[str]:
    """Statements that read column ``c`` at ``pos`` into ``@e`` (its Avro bytes, or None
    when the value has no Avro form: listed as not sent) and advance ``pos``."""
    t = c.binlog_type
    kind = _avro_kind(c.avro)
    # the hot types, without a Python value in between where the bytes allow it
    if t in (T_VARCHAR, T_STRING, T_VAR_STRING, T_BLOB) and c.codec == "utf-8":
        if t == T_BLOB:
            n = c.m("length")
            head = [f"ln = _from(buf[pos:pos + {n}], 'little')", f"pos += {n}"]
        elif c.m("length") > 255:
            head = ["ln = _u16(buf, pos)[0]", "pos += 2"]
        else:
            head = ["ln = buf[pos]", "pos += 1"]
        return [*head, "@e = _long(ln) + buf[pos:pos + ln]", "pos += ln"]
    if t == T_NEWDECIMAL:
        p, sc = c.m("precision"), c.m("scale")
        n = decimal_size(p, sc)
        # the sign is the top bit, inverted; a negative value has every byte inverted
        return [
            f"x = _from(buf[pos:pos + {n}], 'big')",
            f"neg = x >> {8 * n - 1} == 0",
            f"x ^= {1 << (8 * n - 1)}",
            f"if neg: x ^= {(1 << 8 * n) - 1}",
            f"u = {decimal_expr(p, sc, 'x')}",
            "@e = _adec(-u if neg else u)",
            f"pos += {n}",
        ]
    if t == T_DATETIME2:
        # rows of a transaction often share a datetime (NOW()): the Avro bytes are
        # remembered by the packed value (_dtm<i>, cleared when full)
        fsp = c.m("fsp")
        width = 5 + (fsp + 1) // 2
        frac = f" + {_frac_expr(fsp, 'pos + 5')}" if fsp else ""
        return [
            f"r = buf[pos:pos + {width}]",
            f"@e = _dtm{i}.get(r, _MISS)",
            "if @e is _MISS:",
            "    x = _from(r[:5], 'big') - 0x8000000000",
            "    dd = _DAYS.get(x >> 17, _MISS)",
            "    if dd is _MISS: dd = _ymd_days(x >> 17)",
            "    if dd is None: @e = None",
            "    else:",
            "        h = x & 0x1FFFF",
            "        @e = _long((dd * 86400 + (h >> 12) * 3600 + ((h >> 6) & 63) * 60 + (h & 63))"
            f" * 1000000{frac})",
            f"    if len(_dtm{i}) >= {_MEMO_ENTRIES}: _dtm{i}.clear()",
            f"    _dtm{i}[r] = @e",
            f"pos += {width}",
        ]
    if t == T_DOUBLE and kind == "double":
        return ["@e = buf[pos:pos + 8]", "pos += 8"]
    if t == T_FLOAT and kind == "float":
        return ["@e = buf[pos:pos + 4]", "pos += 4"]
    # the decoder's own not-sent bookkeeping is done by the caller here
    code = [line for line in value_code(c, i) if not line.startswith("if @v is None: ns")]
    if t == T_LONGLONG and c.unsigned and kind == "decimal":
        code = [line for line in code if line != "@v = _dec(@v)"]
        enc = "_adec(@v)"
    elif kind in ("int", "long"):
        enc = "_long(@v)"
    elif kind == "boolean":
        enc = "(b'\\x01' if @v else b'\\x00')"
    elif kind == "float":
        enc = "_pf32(@v)"
    elif kind == "double":
        enc = "_pf64(@v)"
    elif kind == "string":
        enc = "_astr(@v)"
    elif kind == "bytes":
        enc = "_abytes(@v)"
    elif kind == "array":
        enc = "_astrs(@v)"
    else:
        raise SourceConfigError(f"column {c.name!r}: no Avro encoding for {c.avro!r}")
    # a value without an Avro form (a zero date) is None here and listed as not sent
    return [*code, f"@e = None if @v is None else {enc}"]


def _zero_key_code(c: ColumnLayout) -> str:
    """An expression for the key bytes of a zero date in key column ``c``, just read
    (``pos`` is past it): :data:`MYSQL_ZERO_DATE_KEY` / :data:`MYSQL_ZERO_DATETIME_KEY`
    plus the packed value, distinct per zero date and from every real date."""
    t = c.binlog_type
    if t == T_DATE:
        return f"_long({MYSQL_ZERO_DATE_KEY} + _from(buf[pos - 3:pos], 'little'))"
    fsp = c.m("fsp")
    if t == T_DATETIME2:
        at = f"pos - {5 + (fsp + 1) // 2}"
        frac = f" | {_frac_expr(fsp, f'{at} + 5')}" if fsp else ""
        packed = f"(_from(buf[{at}:{at} + 5], 'big') - 0x8000000000) << 20{frac}"
        return f"_long({MYSQL_ZERO_DATETIME_KEY} + ({packed}))"
    # TIMESTAMP2: zero seconds since the epoch (the zero date), the fraction as read
    at = f"pos - {4 + (fsp + 1) // 2}"
    frac = f" + {_frac_expr(fsp, f'{at} + 4')}" if fsp else ""
    return f"_long({MYSQL_ZERO_DATETIME_KEY}{frac})"


#: value encoders and their forms with the union's value branch in front
_WITH_BRANCH: Final = (
    ("@e = None if @v is None else _long(@v)", "@e = None if @v is None else _plong(@v)"),
    ("@e = _long(", "@e = _plong("),
    ("@e = _adec(", "@e = _padec("),
)


def _with_branch(code: list[str]) -> tuple[list[str], bool]:
    """``code`` writing ``0x02`` + the value into ``@e``, when every assignment allows it."""
    out: list[str] = []
    for line in code:
        stripped = line.lstrip()
        if stripped.startswith("@e ="):
            for plain, branch in _WITH_BRANCH:
                if stripped.startswith(plain):
                    line = line.replace(plain, branch, 1)
                    break
            else:
                return code, False
        out.append(line)
    return out, True


def _policy_code(c: ColumnLayout, i: int, rule: ColumnRule, is_key: bool) -> list[str]:
    """Statements for a column with a policy rule: read ``@v`` at ``pos`` (the decoder's
    statements), then nothing more (exclude) or ``@e`` = ``0x02`` + the Avro bytes of the
    rule's value (``k<i>`` too for a key column); a value without an Avro form (a zero
    date) is listed as not sent, as without a policy."""
    code = [line for line in value_code(c, i) if not line.startswith("if @v is None: ns")]
    if rule.action == "exclude":
        return code
    enc = "_abytes" if rule.action == "truncate" and _avro_kind(c.avro) == "bytes" else "_astr"
    out = [
        *code,
        "if @v is None:",
        "    @e = b'\\x00'",
        f"    ns = (ns or []) + [_name{i}]",
        "else:",
        f"    @e = {enc}(_rule{i}(@v))",
    ]
    if is_key:
        out.append(f"    k{i} = @e")
    out.append("    @e = b'\\x02' + @e")
    return out


def compile_transcoder(layout: TableLayout) -> RowsTranscoder:
    """A function from row images to Avro bytes for ``layout`` (the row record of
    ``layout.table_schema()``: every field ``["null", T]``, in column order; the key
    record: the key columns' ``T`` in key order).

    Same values as :func:`compile_decoder` followed by fastavro, without the Python
    row in between: UTF-8 text, doubles and floats are copied as they are in the
    binlog, decimals go from their packed form to Avro's two's complement directly.
    """
    cols = layout.columns
    nbytes = (len(cols) + 7) // 8
    index = {c.name: i for i, c in enumerate(cols)}
    key = [index[k] for k in layout.key]
    lines = row_loop_head("transcode(buf, pos, end)", nbytes)
    env = dict(HELPERS)
    env.update(ENCODERS)
    rules = layout.rules
    for i, c in enumerate(cols):
        env[f"_labels{i}"], env[f"_name{i}"], env[f"_codec{i}"] = c.labels, c.name, c.codec
        env[f"_dtm{i}"] = {}
        rule = rules[i]
        if rule is not None:  # a column policy: the decoder's value, then the rule
            env[f"_rule{i}"] = rule.apply
            body = [
                s.replace("@e", f"e{i}").replace("@v", f"v{i}")
                for s in _policy_code(c, i, rule, i in key)
            ]
            if c.nullable:
                null = "pass" if rule.action == "exclude" else f"e{i} = b'\\x00'"
                lines += [f"        if nulls >> {i} & 1:", f"            {null}", "        else:"]
                lines.extend("            " + s for s in body)
            else:
                lines.extend("        " + s for s in body)
            continue
        # NOT NULL columns skip the null bit; only temporal types can lack an Avro value
        pad = "            " if c.nullable else "        "
        if c.nullable:
            lines.append(f"        if nulls >> {i} & 1:")
            lines.append(f"            e{i} = b'\\x00'")
            lines.append("        else:")
        lines_i = _transcode_code(c, i)
        present = i not in key
        if present:  # write the union's value branch with the value: one concatenation less
            lines_i, present = _with_branch(lines_i)
        body = [s.replace("@e", f"e{i}").replace("@v", f"v{i}") for s in lines_i]
        lines.extend(pad + s for s in body)
        if c.binlog_type in (T_DATE, T_DATETIME2, T_TIMESTAMP2):
            lines.append(f"{pad}if e{i} is None:")
            lines.append(f"{pad}    e{i} = b'\\x00'")
            lines.append(f"{pad}    ns = (ns or []) + [_name{i}]")
            if i in key:  # the key needs a value: one no real date has
                lines.append(f"{pad}    k{i} = {_zero_key_code(c)}")
            if present:
                continue
            lines.append(f"{pad}else:")
            pad += "    "
        if i in key:
            lines.append(f"{pad}k{i} = e{i}")
        if not present:
            lines.append(f"{pad}e{i} = b'\\x02' + e{i}")
    if key:
        keyexpr = (
            f"k{key[0]}" if len(key) == 1 else f"b''.join(({', '.join(f'k{i}' for i in key)},))"
        )
    else:
        keyexpr = "b''"
    row = ", ".join(f"e{i}" for i, r in enumerate(rules) if r is None or r.action != "exclude")
    lines.append(f"        append(({keyexpr}, b''.join(({row},)), ns))")
    lines.append("    return out")
    source = "\n".join(lines)
    code = compile(source, f"<changebus mysql transcoder {layout.name}>", "exec")
    exec(code, env)  # generated from the layout alone: no outside text in the code
    transcoder: RowsTranscoder = env["transcode"]
    return transcoder
