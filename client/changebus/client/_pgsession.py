"""Opening the client's PostgreSQL sessions (the replica and the unit store).

A member frozen (SIGSTOP, a VM pause, a debugger) in the middle of a
window's transaction keeps that transaction's row locks: another member
taking over its units would wait on them for as long as the freeze lasts,
a whole group stuck behind one frozen process. Every session opened here
therefore has ``idle_in_transaction_session_timeout`` set: the server ends
a session idle inside a transaction for that long and drops its locks. The
client's own transactions never idle (a window's rows and checkpoint are
sent in one go from a worker thread), so only a frozen or hung process is
cut off; when it wakes, its session is gone, its commit fails as a
retriable transport error, and a new session finds its units fenced.

The other way round, a path that goes dead (a black-holed network) left a
session's call waiting on the kernel, about 15 minutes, while a revoke
waited for its last commit (found by review): unless the DSN says
otherwise, sessions get a connect timeout, TCP keepalives and libpq's
``tcp_user_timeout`` (:data:`SESSION_DEFAULTS`), so such a call fails within
about half a minute as a retriable transport error.

Sessions run in UTC (``TimeZone``), whatever the server's default.

Blocking (psycopg's sync API): call from the worker thread that owns the session.
"""

from __future__ import annotations

from typing import Any

from changebus.schemas import ConfigError

__all__ = [
    "IDLE_IN_TRANSACTION_S",
    "SESSION_DEFAULTS",
    "connect",
    "pg_session_defaults",
    "session_lost",
]

#: libpq settings of every session here that its DSN does not set (seconds; ms for
#: tcp_user_timeout): a dead path is found in about 30 s instead of the kernel's minutes
SESSION_DEFAULTS: dict[str, int] = {
    "connect_timeout": 10,
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 30_000,
}

#: default for ``idle_in_transaction_s``: far above any pause of a healthy process
IDLE_IN_TRANSACTION_S = 5.0


def pg_session_defaults(dsn: str) -> dict[str, int]:
    """The :data:`SESSION_DEFAULTS` the DSN does not set itself (for ``psycopg.connect``'s
    keyword arguments: changebus's other Postgres sessions, the bootstrap store's, take
    them too)."""
    import psycopg  # lazily: only PostgreSQL users need the driver loaded
    from psycopg.conninfo import conninfo_to_dict

    try:
        given = conninfo_to_dict(dsn)
    except psycopg.Error:
        given = {}  # (psycopg.connect reports the DSN's problem)
    return {k: v for k, v in SESSION_DEFAULTS.items() if k not in given}


def connect(dsn: str, idle_in_transaction_s: float) -> Any:
    """An autocommit psycopg connection with the idle-in-transaction timeout (0: none)."""
    import psycopg  # lazily: only PostgreSQL users need the driver loaded

    extra: dict[str, Any] = pg_session_defaults(dsn)
    try:
        conn = psycopg.connect(dsn, autocommit=True, **extra)
    except psycopg.ProgrammingError:
        # libpq quotes the piece of the DSN it choked on, which may be (part of) the
        # password (found by review)
        raise ConfigError(
            "the PostgreSQL DSN cannot be parsed (quote values with spaces: password='...')"
        ) from None
    try:
        # UTC, whatever the server's or the database's default: a timezone-aware value
        # stored into a ``timestamp`` column (a replica column kept when its source
        # column turned ``timestamptz``) is converted by the session's zone (a
        # Europe/Berlin default shifted 12:00Z to 14:00; review)
        conn.execute("SELECT set_config('TimeZone', 'UTC', false)")
        if idle_in_transaction_s > 0:
            ms = max(1, round(idle_in_transaction_s * 1000))
            conn.execute(
                "SELECT set_config('idle_in_transaction_session_timeout', %s, false)", (f"{ms}ms",)
            )
    except BaseException:
        conn.close()
        raise
    return conn


def session_lost(exc: BaseException) -> bool:
    """Whether ``exc`` means the session is gone (a retriable transport error, not bad data).

    Besides network and server failures, the server ending a session that
    idled in a transaction too long (the process froze) counts: the next
    call connects again.
    """
    import psycopg

    return isinstance(
        exc,
        psycopg.OperationalError
        | psycopg.InterfaceError
        | psycopg.errors.IdleInTransactionSessionTimeout,
    )
