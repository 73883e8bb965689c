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

Blocking (psycopg's sync API): call from the worker thread that owns the session.
"""

from __future__ import annotations

from typing import Any

__all__ = ["IDLE_IN_TRANSACTION_S", "connect", "session_lost"]

#: default for ``idle_in_transaction_s``: far above any pause of a healthy process
IDLE_IN_TRANSACTION_S = 5.0


def connect(dsn: str, idle_in_transaction_s: float) -> Any:
    """An autocommit psycopg connection with the idle-in-transaction timeout (0: none)."""
    import psycopg  # lazily: only PostgreSQL users need the driver loaded

    conn = psycopg.connect(dsn, autocommit=True)
    try:
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
