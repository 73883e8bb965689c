"""What ``changebus status`` shows: the servers' reports and their one-screen text.

:class:`ServerReport` is what the command learned of one relay or bootstrap
server: reachable or not (and why), its role (told from its ``/v1/status``
body: relay partitions have ``max_scn``, bootstrap partitions
``producer_scn``), whether ``/readyz`` said ready, and the ``/v1/status``
partitions exactly as the server sent them. The renderers read those
dictionaries with ``.get`` only: a field a server does not send (an older
version) is shown as ``-`` and fields it sends beyond these (a newer
version) are kept in ``--json`` and ignored by the text. Nothing here does
I/O; :func:`render_text` takes the clock as an argument (ages of windows).

The text, per server: a head line (role, URL, ready or not, cluster member
id), then for a relay one line per partition (state, role in a cluster,
fetcher kind and its source position figures, SCN range, newest SCN, age of
the newest window, time behind the source when the relay reports it
(``source_lag_seconds``), buffer use) and one line per consumer it saw in
the last five minutes (SCN asked for, lag in SCNs and, when the relay
reports it, in seconds: ``lag_seconds``; when it last asked); for a bootstrap server one
line per partition (state, producer and applier SCNs, applier lag, log
start, seed progress) and its chunked snapshot jobs. Errors a server
reports (``last_error``) follow their partition.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ServerReport", "render_text", "report_json"]


@dataclass(frozen=True)
class ServerReport:
    """One server as ``changebus status`` saw it (module docstring).

    ``url`` has no credentials. ``role``: ``relay``, ``bootstrap`` or
    ``unknown`` (reachable, but nothing told the role). ``error``: why the
    server could not be read (unreachable, refused, not changebus); empty
    when it answered. ``ready``: ``/readyz`` said 200 (None: no answer).
    ``member``: its member id in the cluster it was found in (else empty).
    """

    url: str
    role: str = "unknown"
    reachable: bool = False
    ready: bool | None = None
    error: str = ""
    readiness: Mapping[str, str] = field(default_factory=dict)
    partitions: Sequence[Mapping[str, Any]] = ()
    member: str = ""

    @property
    def ok(self) -> bool:
        """Reachable and ready (what the exit status counts)."""
        return self.reachable and self.ready is True

    def to_json(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "role": self.role,
            "member": self.member or None,
            "reachable": self.reachable,
            "ready": self.ready,
            "error": self.error or None,
            "readiness": dict(self.readiness),
            "partitions": [dict(p) for p in self.partitions],
        }


def report_json(reports: Sequence[ServerReport], now: float) -> dict[str, Any]:
    """The ``--json`` document: every server, and whether all are reachable and ready."""
    return {
        "time": round(now, 3),
        "ok": all(r.ok for r in reports),
        "servers": [r.to_json() for r in reports],
    }


# ---- cells ----------------------------------------------------------------------


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _num(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def _scn(value: Any) -> str:
    n = _int(value)
    return "-" if n is None or n < 0 else str(n)


def _count(value: Any) -> str:
    n = _int(value)
    return "-" if n is None else f"{n:,}"


def size(value: Any) -> str:
    """Bytes in binary units (``12.0 MiB``); ``-`` when not a number."""
    n = _num(value)
    if n is None or n < 0:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "-"  # pragma: no cover


def seconds(value: Any) -> str:
    """A duration: ``0.4 s``, ``12 s``, ``3m05s``, ``2h10m``; ``-`` when not a number."""
    s = _num(value)
    if s is None or s < 0:
        return "-"
    if s < 10:
        return f"{s:.1f} s"
    if s < 60:
        return f"{s:.0f} s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


def _age(ns: Any, now: float) -> str:
    t = _int(ns)
    if t is None or t <= 0:
        return "-"
    return seconds(max(now - t / 1e9, 0.0))


def _table(head: Sequence[str], rows: Iterable[Sequence[str]], indent: str = "  ") -> list[str]:
    body = [list(r) for r in rows]
    widths = [max(len(r[i]) for r in [list(head), *body]) for i in range(len(head))]
    return [
        (indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True))).rstrip()
        for r in [list(head), *body]
    ]


# ---- relay ----------------------------------------------------------------------


def _fetcher(part: Mapping[str, Any]) -> str:
    """The fetcher's kind and where it is on its source (what the relay reports)."""
    fetcher = part.get("fetcher")
    if not isinstance(fetcher, Mapping):
        return "-"
    kind = str(fetcher.get("kind") or "?")
    bits = []
    if fetcher.get("slot"):
        wal = fetcher.get("slot_wal_status")
        bits.append(f"slot {fetcher['slot']}" + (f" ({wal})" if wal else ""))
    for key, label in (
        ("retained_wal_bytes", "retains"),
        ("binlog_distance_bytes", "binlog behind"),
    ):
        if _num(fetcher.get(key)) is not None and fetcher[key] >= 0:
            bits.append(f"{label} {size(fetcher[key])}")
    if fetcher.get("source_position") and not bits:
        bits.append(str(fetcher["source_position"]))
    return kind + (f": {', '.join(bits)}" if bits else "")


def _relay_lines(report: ServerReport, now: float) -> list[str]:
    parts = report.partitions
    rows = []
    for p in parts:
        state = str(p.get("state") or report.readiness.get(str(p.get("name")), "-"))
        if p.get("role"):
            state += f"/{p['role']}"
        if _int(p.get("epoch")) is not None:
            state += f" e{p['epoch']}"
        lag = p.get("source_lag_seconds")
        rows.append(
            [
                str(p.get("name", "?")),
                state,
                _fetcher(p),
                f"{_scn(p.get('min_scn'))}..{_scn(p.get('max_scn'))}",
                _age(p.get("newest_timestamp_ns"), now),
                seconds(lag),
                f"{size(p.get('bytes_used'))}/{size(p.get('capacity_bytes'))}",
                _count(p.get("windows")),
            ]
        )
    lines = _table(
        (
            "PARTITION",
            "STATE",
            "FETCHER",
            "SCN RANGE",
            "NEWEST AGE",
            "BEHIND SOURCE",
            "BUFFER",
            "WINDOWS",
        ),
        rows,
    )
    for p in parts:
        if p.get("last_error"):
            lines.append(f"  ! {p.get('name', '?')}: {p['last_error']}")
    consumers = [(p, c) for p in parts for c in p.get("consumers") or () if isinstance(c, Mapping)]
    if consumers:
        lines.append("  consumers (seen in the last 5 minutes):")
        lines += _table(
            ("PARTITION", "CONSUMER", "SCN", "LAG SCN", "LAG S", "LAST ASKED"),
            (
                [
                    str(p.get("name", "?")),
                    str(c.get("client") or "(hidden)"),
                    _scn(c.get("scn")),
                    _count(c.get("lag_scn")),
                    seconds(c.get("lag_seconds")),
                    f"{seconds(c.get('seconds_since_request'))} ago",
                ]
                for p, c in consumers
            ),
            indent="    ",
        )
    return lines


# ---- bootstrap ------------------------------------------------------------------


def _seed(seed: Any) -> str:
    if not isinstance(seed, Mapping) or not seed.get("state"):
        return "-"
    text = str(seed["state"])
    done, total = _int(seed.get("tables_done")), _int(seed.get("tables_total"))
    if total:
        text += f" {done or 0}/{total} tables"
    if seed.get("table") and seed.get("state") not in ("done", "idle"):
        text += f", {seed['table']}"
    if _int(seed.get("rows")):
        text += f", {_count(seed.get('rows'))} rows"
    if _num(seed.get("rows_per_s")):
        text += f" at {seed['rows_per_s']:,.0f}/s"
    if _num(seed.get("eta_s")) is not None:
        text += f", ETA {seconds(seed.get('eta_s'))}"
    return text


def _bootstrap_lines(report: ServerReport) -> list[str]:
    parts = report.partitions
    lines = _table(
        ("PARTITION", "STATE", "PRODUCER SCN", "APPLIER SCN", "APPLIER LAG", "LOG FROM", "SEED"),
        (
            [
                str(p.get("partition", "?")),
                str(p.get("state", "-")),
                _scn(p.get("producer_scn")),
                _scn(p.get("applier_scn")),
                f"{_count(p.get('applier_lag_events'))} events",
                _scn(p.get("log_min_scn")),
                _seed(p.get("seed")),
            ]
            for p in parts
        ),
    )
    for p in parts:
        name = p.get("partition", "?")
        seed = p.get("seed")
        jobs = seed.get("jobs") if isinstance(seed, Mapping) else None
        for job in jobs or ():
            if isinstance(job, Mapping):
                lines.append(
                    f"  snapshot job {name} {job.get('table', '?')} ({job.get('scope', '?')}):"
                    f" {_count(job.get('chunks'))} chunks, {_count(job.get('rows'))} rows stored"
                )
        if p.get("last_error"):
            lines.append(f"  ! {name}: {p['last_error']}")
        if p.get("gap"):
            lines.append(f"  ! {name}: gap in the log: {p['gap']}")
    return lines


# ---- the screen -----------------------------------------------------------------


def _head(report: ServerReport) -> str:
    member = f" (member {report.member})" if report.member else ""
    if not report.reachable:
        return f"UNREACHABLE {report.url}{member}: {report.error}"
    ready = {True: "ready", False: "NOT READY", None: "readiness unknown"}[report.ready]
    head = f"{report.role} {report.url}{member}  {ready}"
    if report.ready is False:
        waiting = [f"{p}={s}" for p, s in sorted(report.readiness.items())]
        if waiting:
            head += f" ({', '.join(waiting)})"
    return head


def render_text(reports: Sequence[ServerReport], now: float | None = None) -> str:
    """One screen: every server's head line and its partitions (module docstring)."""
    now = time.time() if now is None else now
    bad = sum(not r.ok for r in reports)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(now))
    summary = "all ready" if not bad else f"{bad} not ready or unreachable"
    lines = [f"changebus status  {stamp}  {len(reports)} server(s), {summary}"]
    for report in reports:
        lines.append("")
        lines.append(_head(report))
        if report.reachable and report.error:
            lines.append(f"  ! {report.error}")
        if not report.reachable or not report.partitions:
            if report.reachable and not report.error:
                lines.append("  (no partitions)")
            continue
        if report.role == "bootstrap":
            lines += _bootstrap_lines(report)
        else:
            lines += _relay_lines(report, now)
    return "\n".join(lines)
