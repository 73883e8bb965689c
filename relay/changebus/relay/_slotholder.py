"""Taking a Postgres replication slot over from a deposed leader's walsender.

A new leader of a Postgres partition (:mod:`._cluster`) ends the backend
that still holds the partition's slot (a paused, deposed leader's
walsender: its new epoch is the proof that the old one no longer leads)
before its own fetcher starts on the slot. Blocking: run in a worker thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["terminate_slot_holder"]


def terminate_slot_holder(dsn: str, slot: str, still_leader: Callable[[], bool]) -> int | None:
    """Terminate the backend holding ``slot`` and wait (2 s at most) until it let go.

    Blocking: a worker thread. Returns the ended backend's pid, None when the
    slot was free or ``still_leader()`` (the term's lease, thread-safe) said
    no once connected: a term lost during the connect (a pause) must not end
    its successor's walsender.
    """
    import psycopg

    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
        if not still_leader():
            return None
        row = conn.execute(
            "SELECT active_pid, pg_terminate_backend(active_pid) FROM pg_replication_slots"
            " WHERE slot_name = %s AND active_pid IS NOT NULL",
            (slot,),
        ).fetchone()
        if row is None:
            return None
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            held = conn.execute(
                "SELECT 1 FROM pg_replication_slots WHERE slot_name = %s AND active_pid = %s",
                (slot, row[0]),
            ).fetchone()
            if held is None:
                break
            time.sleep(0.02)
    return int(row[0])
