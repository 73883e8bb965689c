"""Set-up of the Postgres fetcher: server checks, publication and slot, loss detection.

Runs at every start (:meth:`PostgresFetcher.start`, in a worker thread) on a
regular connection, and returns a :class:`StartPlan`. The publication and
the slot are created when missing, never dropped, except a lost slot with
``on_slot_lost = "recreate"``. ``wal_level`` other than ``logical``, a
missing privilege or an invalidated slot (with ``on_slot_lost = "fail"``)
raise clear, non-retriable :class:`SourceConfigError`\\ s; a lost connection
or a slot held by another process (often the previous run's walsender,
still exiting) is a retriable :class:`SourceError`.

Loss detection: the fetcher confirms only what the relay holds, so a slot
that starts after the end of the relay's last window (invalidated, dropped
and recreated, or consumed by someone else) means changes in between are
gone. The plan then carries a DATA_LOSS window for them and a resume point
at the new slot's start.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from changebus.schemas import SourceConfigError, SourceError, lsn_to_scn, scn_to_lsn
from changebus.schemas.config import scrub

from .._base import ResumePoint
from ._config import PostgresConfig
from ._watchdog import Watchdog

__all__ = ["StartPlan", "connect", "reason", "set_up"]

log = logging.getLogger("changebus.fetchers.postgres")


@dataclass(frozen=True, slots=True)
class StartPlan:
    """Where the stream of a (re)started fetcher goes on, and what it announces first.

    ``resume``: the relay's resume point, or after a gap one at the new
    slot's start, right after the DATA_LOSS window. ``data_loss``:
    ``(from_scn, to_scn, reason)`` of that window, None without a gap.
    ``confirmed``: the slot's confirmed position as an SCN (-1: unknown).
    ``system``: the cluster's system identifier (its WAL positions are its own;
    "": not known).
    """

    resume: ResumePoint
    data_loss: tuple[int, int, str] | None
    confirmed: int
    system: str = ""


def set_up(config: PostgresConfig, resume: ResumePoint, partition: str) -> StartPlan:
    """Check the server, create publication and slot when missing, look for a gap."""
    import psycopg

    watchdog = Watchdog(config.io_timeout_s, partition)
    try:
        conn = connect(config.dsn, "cannot connect to Postgres", timeout_s=config.io_timeout_s)
        with watchdog.guard(conn) as catalog:
            resume, data_loss = _prepare(catalog, config, resume, partition)
            row = catalog.execute(
                "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                (config.slot,),
            ).fetchone()
            system = system_identifier(catalog)
    except psycopg.OperationalError as exc:
        watchdog.check()
        raise SourceError(f"cannot connect to Postgres: {reason(exc)}") from None
    finally:
        watchdog.close()
    return StartPlan(resume, data_loss, lsn_to_scn(row[0]) if row and row[0] else -1, system)


def system_identifier(conn: Any) -> str:
    """The cluster's system identifier ("" when the role may not read it)."""
    import psycopg

    try:
        row = conn.execute("SELECT system_identifier::text FROM pg_control_system()").fetchone()
    except psycopg.errors.InsufficientPrivilege:  # (autocommit: nothing to roll back)
        return ""
    return str(row[0]) if row and row[0] else ""


def _prepare(
    catalog: Any, cfg: PostgresConfig, resume: ResumePoint, partition: str
) -> tuple[ResumePoint, tuple[int, int, str] | None]:
    """Check ``wal_level``, create publication and slot when missing (a lost slot:
    recreated or refused); returns the resume point and the DATA_LOSS window to plan."""
    import psycopg
    from psycopg import sql

    level = catalog.execute("SHOW wal_level").fetchone()[0]
    if level != "logical":
        raise SourceConfigError(
            f"Postgres wal_level is {level!r}; set wal_level = logical and restart it"
        )
    try:
        exists = catalog.execute(
            "SELECT 1 FROM pg_publication WHERE pubname = %s", (cfg.publication,)
        ).fetchone()
        if exists is None:
            if not cfg.create_publication:
                raise SourceConfigError(f"publication {cfg.publication!r} does not exist")
            if cfg.tables:
                tables = sql.SQL(", ").join(sql.Identifier(*t.split(".", 1)) for t in cfg.tables)
                catalog.execute(
                    sql.SQL("CREATE PUBLICATION {} FOR TABLE {}").format(
                        sql.Identifier(cfg.publication), tables
                    )
                )
            else:
                catalog.execute(
                    sql.SQL("CREATE PUBLICATION {} FOR ALL TABLES").format(
                        sql.Identifier(cfg.publication)
                    )
                )
            log.info("created publication %s", cfg.publication)
        slot = catalog.execute(
            "SELECT plugin, active, active_pid, wal_status FROM pg_replication_slots "
            "WHERE slot_name = %s",
            (cfg.slot,),
        ).fetchone()
        lost = ""
        if slot is not None:
            plugin, active, pid, wal_status = slot
            if plugin != "pgoutput":
                raise SourceConfigError(f"slot {cfg.slot!r} uses plugin {plugin!r}, not pgoutput")
            if active:  # often the previous run's walsender, still exiting: retriable
                raise SourceError(f"slot {cfg.slot!r} is in use by another process (pid {pid})")
            if wal_status == "lost":
                lost = f"slot {cfg.slot!r} was invalidated (the WAL it needed was removed)"
        elif resume.scn >= 0:
            lost = f"slot {cfg.slot!r} vanished (dropped while the relay held its changes)"
        if lost:
            if cfg.on_slot_lost == "fail":
                raise SourceConfigError(
                    f"{lost}: changes are lost; set on_slot_lost = 'recreate' to go on "
                    "after a data-loss event"
                )
            if slot is not None:
                catalog.execute("SELECT pg_drop_replication_slot(%s)", (cfg.slot,))
            slot = None
        if slot is None:
            if not cfg.create_slot:
                raise SourceConfigError(f"replication slot {cfg.slot!r} does not exist")
            # no deadline: the slot waits for the transactions running at its start
            catalog.execute(
                "SELECT pg_create_logical_replication_slot(%s, 'pgoutput')",
                (cfg.slot,),
                timeout_s=0,
            )
            log.info("created replication slot %s", cfg.slot)
        row = catalog.execute(
            "SELECT confirmed_flush_lsn::text, pg_current_wal_lsn()::text"
            " FROM pg_replication_slots WHERE slot_name = %s",
            (cfg.slot,),
        ).fetchone()
        return _check_gap(cfg, resume, partition, lost, lsn_to_scn(row[0]), lsn_to_scn(row[1]))
    except psycopg.errors.InsufficientPrivilege as exc:
        raise SourceConfigError(
            f"the Postgres user lacks a privilege: {exc.diag.message_primary}"
        ) from None


def _check_gap(
    cfg: PostgresConfig,
    resume: ResumePoint,
    partition: str,
    lost: str,
    confirmed: int,
    current: int = -1,
) -> tuple[ResumePoint, tuple[int, int, str] | None]:
    """Plan a DATA_LOSS window when the slot starts after the relay's last window.

    The fetcher confirms only what the relay holds, so a slot confirmed
    beyond the end of the relay's last window (``resume.source_position``)
    means changes in between were consumed elsewhere or are gone with a lost
    slot. Checked at every start, so a relay restarted before announcing
    the loss announces it then. A server whose WAL (``current``) ends before
    the relay's last window went back in time (restored from a backup with
    its slot, a standby promoted before it had replayed it): its new commits
    take SCNs the relay passed, which cannot be delivered in order.
    """
    if resume.scn < 0 or resume.source_position.count("/") != 1:
        return resume, None  # the relay holds nothing from this slot yet
    end = lsn_to_scn(resume.source_position)
    if not lost and 0 <= current < end:  # (a lost slot says so below, the same way)
        what = (
            f"the server's WAL ends at {scn_to_lsn(current)}, before the relay's last window"
            f" ({resume.source_position}): it was restored from a backup or is a standby"
            " promoted before it had replayed the relay's changes"
        )
        return _announce_loss(resume, partition, what, confirmed)
    if confirmed == end or (confirmed < end and not lost):
        return resume, None
    # (a new slot behind the relay's end: the server's WAL went back, see _announce_loss)
    what = lost or (
        f"slot {cfg.slot!r} was confirmed beyond the relay's last window "
        "(recreated, or used by another consumer)"
    )
    return _announce_loss(resume, partition, what, confirmed)


def _announce_loss(
    resume: ResumePoint, partition: str, what: str, new_start: int
) -> tuple[ResumePoint, tuple[int, int, str]]:
    """Plan the DATA_LOSS window for changes between the relay's end and a new slot."""
    last = resume.scn
    hi = max(new_start - 1, last + 1)
    if new_start > last:
        why = (
            f"{what}; a new slot streams from {scn_to_lsn(new_start)}: changes committed "
            f"after SCN {last} and before it are missing"
        )
    else:  # a server restored from a backup, or a standby promoted before it caught up
        why = (
            f"{what}; the new slot starts at {scn_to_lsn(new_start)}, behind the relay's "
            f"last SCN {last}: the server's WAL went back (restored, or a lagging standby "
            f"promoted); its changes committed up to SCN {hi} are not delivered"
        )
    log.error("partition %s: %s", partition, why)
    # the stream continues after the new slot's start, not the relay's old end
    return ResumePoint(hi, scn_to_lsn(new_start), resume.schemas), (last + 1, hi, why)


def reason(exc: BaseException, dsn: str = "") -> str:
    """An error's first line without connection details (no DSN, no password).

    The server's primary message when there is one; else (a connection that
    failed, a DSN libpq cannot parse) the first line of the error scrubbed of
    ``dsn`` and its password; else the error's class name.
    """
    diag = getattr(exc, "diag", None)
    primary = getattr(diag, "message_primary", None) if diag is not None else None
    if primary:
        return str(primary)
    lines = str(exc).strip().splitlines()
    if dsn and lines:
        return scrub(lines[0], (dsn,))
    return exc.__class__.__name__


def connect(
    dsn: str,
    what: str,
    *,
    option: str = "fetcher option dsn",
    timeout_s: float = 0.0,
    **kwargs: Any,
) -> Any:
    """``psycopg.connect(dsn, autocommit=True, client_encoding="UTF8", **kwargs)``; errors
    never quote the DSN.

    ``timeout_s`` (> 0) becomes libpq's ``connect_timeout`` unless the DSN
    sets its own: a server that accepts the TCP connection and never answers
    (frozen, or a half-open path) fails the connect instead of hanging it.

    A connection that fails is a retriable :class:`SourceError` headed by
    ``what`` (the reason scrubbed of the DSN and its password); a DSN libpq
    cannot parse (``ProgrammingError``) a :class:`SourceConfigError` naming
    ``option``, without libpq's text: it quotes the piece it choked on, which
    may be (part of) the password.
    """
    import psycopg

    if timeout_s > 0 and "connect_timeout" not in dsn:
        kwargs.setdefault("connect_timeout", max(2, math.ceil(timeout_s)))
    # every decoder reads text as UTF-8, and the walsender, the SQL interface and COPY
    # send it in the connection's encoding, which follows the database's by default
    # (a LATIN1 database's "é" stopped the partition: review); a DSN's own is overridden
    kwargs["client_encoding"] = "UTF8"
    try:
        return psycopg.connect(dsn, autocommit=True, **kwargs)
    except psycopg.OperationalError as exc:
        raise SourceError(f"{what}: {reason(exc, dsn)}") from None
    except psycopg.Error:
        raise SourceConfigError(
            f"{option} is not a valid Postgres connection string (libpq's message is not "
            "shown: it may quote the password); check its key=value pairs or URL syntax"
        ) from None
