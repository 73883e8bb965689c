"""The Postgres seeder's session: one connection, set up for chunked reads.

One job: :func:`open_session` connects to ``seed.dsn`` as
:data:`APPLICATION_NAME`, sets what the chunk readers rely on whatever the
role or database sets (no row-level security, key cursors as exact text in
UTC, a lock timeout), and refuses a source other than the cluster the relay
reads. Thread-safety: the connection is the seeder thread's.
"""

from __future__ import annotations

from typing import Any

from changebus.schemas import SourceConfigError

from ._seedtypes import SeedRequest

__all__ = ["APPLICATION_NAME", "open_session"]

#: application_name of every seeder connection (operators and tests find its transactions by it)
APPLICATION_NAME = "changebus-seed"


def open_session(request: SeedRequest, lock_timeout_s: float) -> Any:
    """A connection to the seed source, set up and checked (closed again on a failure)."""
    from changebus.fetchers.postgres import pg_connect

    conn = pg_connect(
        request.dsn,
        "cannot connect to the seed source",
        option="seed.dsn",
        application_name=APPLICATION_NAME,
    )
    try:
        # the only writes are the watermark samples' empty commits: no need to wait for a
        # flush
        conn.execute("SET synchronous_commit = off")
        # a chunk queued behind a lock (an ALTER TABLE waiting or running) would wait with
        # its snapshot open, holding back vacuum, and a stop could not end the wait
        conn.execute(f"SET lock_timeout = {int(lock_timeout_s * 1000)}")
        # row-level security would show the seed a subset of the rows, and the sweep would
        # then take the others for deleted: off, a table it would filter fails loudly
        # (found by review). Key cursors are key values as text: floats in full, times in
        # ISO form and UTC, whatever the role or database sets.
        conn.execute("SET row_security = off")
        conn.execute("SET extra_float_digits = 3")
        conn.execute("SET DateStyle = 'ISO, MDY'")
        conn.execute("SET IntervalStyle = 'postgres'")
        conn.execute("SET TimeZone = 'UTC'")
        _check_cluster(conn, request)
    except BaseException:
        conn.close()  # (refused while set up: the connection leaked, failing a later test)
        raise
    return conn


def _check_cluster(conn: Any, request: SeedRequest) -> None:
    """Refuse a seed source other than the cluster the relay reads: its LSNs, the chunks'
    tags, would order its rows against another WAL's (rows written ahead of the stream's
    changes, or behind them, silently: review)."""
    from changebus.fetchers.postgres import pg_system_identifier

    relay = str((request.relay_fetcher or {}).get("system_identifier") or "")
    if not relay:
        return  # (a relay of an older version, or a role that may not read it)
    own = pg_system_identifier(conn)
    if own and own != relay:
        raise SourceConfigError(
            f"the seed source is another Postgres cluster (system identifier {own}) than "
            f"the relay reads ({relay}): seed from the cluster the relay reads (commit "
            "LSNs, hence SCNs, are a cluster's own)"
        )
