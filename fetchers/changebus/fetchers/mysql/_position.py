"""The ``source_position`` text of the MySQL fetcher's windows, and where a stream resumes.

``gtid=D-S-N;file=NAME;pos=P[;server=ID][;base=B][;xa=GTID@FILE:POS]``
(docs/protocol.md 1.4, 5): the window's transaction's GTID and end (binlog
file and position) on server ``ID``, the SCN base, and, while an XA
transaction prepared before it is not committed yet, the start of the oldest
such prepared event group (:mod:`._xa`): a restart must read from there.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["format_position", "format_restart", "parse_position", "parse_restart", "resume_point"]


def format_position(
    gtid: str, file: str, pos: int, server: int = 0, base: int = 0, xa: str = ""
) -> str:
    """The ``source_position`` text of a window: ``gtid=D-S-N;file=NAME;pos=P``.

    ``server`` (the ``@@server_id`` whose binlog ``file``/``pos`` are in) adds
    ``;server=ID`` when non-zero; a non-zero SCN ``base`` adds ``;base=B``
    (SCN = base + ``file_number << 32 | pos``; docs/protocol.md 5); ``xa`` (a
    :func:`format_restart` value) adds ``;xa=GTID@FILE:POS``.
    """
    text = f"gtid={gtid};file={file};pos={pos}"
    if server:
        text += f";server={server}"
    if base:
        text += f";base={base}"
    return f"{text};xa={xa}" if xa else text


def parse_position(text: str) -> dict[str, str]:
    """The fields of a ``source_position`` (empty when it is not a MySQL one)."""
    out: dict[str, str] = {}
    for part in text.split(";"):
        key, sep, value = part.partition("=")
        if sep:
            out[key.strip()] = value.strip()
    return out if "file" in out and "pos" in out else {}


def format_restart(gtid: str, file: str, pos: int) -> str:
    """The value of a position's ``xa`` field: ``GTID@FILE:POS`` (GTID may be empty)."""
    return f"{gtid}@{file}:{pos}"


def parse_restart(value: str) -> tuple[str, str, int] | None:
    """``(gtid, file, pos)`` of an ``xa`` field; None when it is malformed."""
    gtid, sep, where = value.partition("@")
    file, colon, pos = where.rpartition(":")
    if not sep or not colon or not file or not pos.isdigit():
        return None
    return gtid, file, int(pos)


def resume_point(position: Mapping[str, str]) -> tuple[str, int]:
    """Where a stream resumes to have everything after a window of this position: the
    start of its oldest pending prepared XA group (``xa``), else its end."""
    restart = parse_restart(position.get("xa", ""))
    if restart is not None:
        return restart[1], restart[2]
    return position["file"], int(position["pos"])
