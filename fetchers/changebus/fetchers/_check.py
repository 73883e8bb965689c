"""The preflight of a source database (``changebus check-source``): findings, report, renderer.

One mechanism for both sources: :mod:`.postgres._check` and
:mod:`.mysql._check` each turn a fetcher config into a list of
:class:`Finding`\\ s (blocking calls, run in a worker thread);
:func:`check_source` picks the source, runs its checks off the event loop
and wraps them in a :class:`CheckReport`, which :func:`render_text` prints
as a checklist and :meth:`CheckReport.to_json` serialises.

Levels: ``ok``; ``WARN`` (the fetcher works, but something will hurt later:
a disk that can fill, no failover safety); ``FAIL`` (the fetcher cannot
start or would lose or mis-key changes). Every non-ok finding carries the
exact fix: an SQL statement, or a server config line and whether a restart
is needed. Exit status of a report: 0 without a FAIL, 1 with one (2, "the
check could not run", is the caller's: a connection that fails raises).

Nothing here holds a password: the target is described by host, port,
database and user only, and the findings quote no DSN. Values are
immutable, so reports may be shared between threads.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from changebus.schemas import ConfigError
from changebus.schemas.config import load_config_dict

__all__ = [
    "KINDS",
    "CheckReport",
    "Finding",
    "Level",
    "check_source",
    "guess_kind",
    "mysql_options_from_dsn",
    "render_text",
]

#: the source kinds that can be checked (fetcher kinds)
KINDS: Final = ("postgres", "mysql")


class Level(enum.Enum):
    """How bad a finding is (its value is what the checklist prints)."""

    OK = "ok"
    WARN = "WARN"
    FAIL = "FAIL"


@dataclass(frozen=True, slots=True)
class Finding:
    """One line of the checklist.

    ``check``: a short stable id (``wal_level``, ``binlog_format``...);
    ``found``: what the source has, in words; ``fix``: the exact remedy
    (empty only when ``level`` is ok).
    """

    check: str
    level: Level
    found: str
    fix: str = ""

    def __post_init__(self) -> None:
        if self.level is not Level.OK and not self.fix:
            raise ValueError(f"finding {self.check}: a {self.level.value} needs a fix")

    @classmethod
    def ok(cls, check: str, found: str) -> Finding:
        return cls(check, Level.OK, found)

    @classmethod
    def warn(cls, check: str, found: str, fix: str) -> Finding:
        return cls(check, Level.WARN, found, fix)

    @classmethod
    def fail(cls, check: str, found: str, fix: str) -> Finding:
        return cls(check, Level.FAIL, found, fix)


@dataclass(frozen=True, slots=True)
class CheckReport:
    """The result of one source's preflight.

    ``kind``: ``postgres`` or ``mysql``; ``target``: ``host:port/db as
    user`` (never a password); ``server``: the server's version string;
    ``findings``: in the order checked.
    """

    kind: str
    target: str
    server: str
    findings: tuple[Finding, ...]

    @property
    def failures(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.level is Level.FAIL)

    @property
    def warnings(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.level is Level.WARN)

    @property
    def blocking(self) -> bool:
        """Whether something keeps the fetcher from working correctly."""
        return bool(self.failures)

    @property
    def exit_status(self) -> int:
        """0 when nothing blocks (warnings allowed), 1 otherwise."""
        return 1 if self.blocking else 0

    def to_json(self) -> dict[str, Any]:
        """A JSON-friendly dict (``--json``)."""
        return {
            "kind": self.kind,
            "target": self.target,
            "server": self.server,
            "ok": not self.blocking,
            "exit_status": self.exit_status,
            "findings": [
                {"check": f.check, "level": f.level.value, "found": f.found, "fix": f.fix}
                for f in self.findings
            ],
        }


def render_text(report: CheckReport, *, title: str = "") -> str:
    """The checklist: a heading, one line per finding (plus its fix), a verdict."""
    width = max((len(f.check) for f in report.findings), default=8)
    head = f"{report.kind} source {report.target}" + (
        f" ({report.server})" if report.server else ""
    )
    lines = [f"{title}: {head}" if title else head]
    for f in report.findings:
        lines.append(f"  {f.level.value:<4}  {f.check:<{width}}  {f.found}")
        if f.fix:
            lines.append(f"  {'':<4}  {'':<{width}}  fix: {f.fix}")
    fails, warns = len(report.failures), len(report.warnings)
    if fails:
        verdict = f"NOT READY: {fails} blocking problem{'s' * (fails != 1)}"
    else:
        verdict = "READY"
    if warns:
        verdict += f", {warns} warning{'s' * (warns != 1)}"
    lines.append(verdict)
    return "\n".join(lines)


def guess_kind(dsn: str) -> str:
    """``mysql`` for ``mysql://`` and ``mariadb://`` URLs, else ``postgres`` (libpq DSNs)."""
    scheme = dsn.strip().partition("://")[0].lower() if "://" in dsn else ""
    return "mysql" if scheme in ("mysql", "mariadb") else "postgres"


def mysql_options_from_dsn(dsn: str) -> dict[str, Any]:
    """Options of the ``mysql`` fetcher from ``mysql://user:password@host:port[/db,db...]``.

    ``mariadb://`` is accepted too; user and password are percent-decoded; the path,
    when given, names the databases to capture; query parameters are the connection
    options (``?password_file=...&tls_ca_file=...``:
    :func:`changebus.fetchers.mysql._config.dsn_options`). Errors never quote the DSN.
    """
    from .mysql._config import dsn_options

    return dsn_options(dsn)


async def check_source(
    dsn: str = "",
    *,
    kind: str | None = None,
    options: Mapping[str, Any] | None = None,
    slot: str | None = None,
    publication: str | None = None,
    tables: Sequence[str] = (),
) -> CheckReport:
    """Check a source for a fetcher of ``kind``; returns the report.

    Either ``dsn`` (a libpq DSN, or a ``mysql://`` URL) or ``options`` (a
    fetcher's options table, as in a relay config; ``dsn`` replaces its own
    connection settings when given). ``kind`` defaults to what the DSN
    looks like. ``slot``/``publication`` (Postgres) override the options;
    ``tables`` (``schema.table``) narrows the tables checked for keys
    (Postgres: also the tables a new publication would cover).

    Raises :class:`~changebus.schemas.ConfigError` for bad arguments and
    :class:`~changebus.schemas.SourceError` when the source cannot be
    reached: the check could not run. The checks run in a worker thread.
    """
    opts = dict(options or {})
    kind = kind or (guess_kind(dsn) if dsn else "postgres")
    if kind not in KINDS:
        raise ConfigError(f"cannot check a source of kind {kind!r} (only {', '.join(KINDS)})")
    if kind == "postgres":
        from .postgres._check import check_postgres
        from .postgres._config import PostgresConfig

        if dsn:
            opts["dsn"] = dsn
        if slot:
            opts["slot"] = slot
        if publication:
            opts["publication"] = publication
        if tables:
            opts["tables"] = list(tables)
        pg = load_config_dict(PostgresConfig, opts, "fetcher options")
        target, server, found = await asyncio.to_thread(check_postgres, pg)
    else:
        from .mysql._check import check_mysql
        from .mysql._config import DSN_QUERY_OPTIONS, MySQLConfig

        if dsn:
            for key in ("host", "port", "user", "password", "databases", *DSN_QUERY_OPTIONS):
                opts.pop(key, None)
            opts.update(mysql_options_from_dsn(dsn))
        my = load_config_dict(MySQLConfig, opts, "fetcher options")
        target, server, found = await asyncio.to_thread(check_mysql, my, tuple(tables))
    return CheckReport(kind, target, server, tuple(found))
