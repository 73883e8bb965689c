"""How far the binlog stream is behind the server: bytes between two binlog positions.

One job: ``changebus_relay_source_binlog_distance_bytes``. The fetcher polls
the server's binlog list (``SHOW BINARY LOGS``: every file kept and its size)
every ``binlog_stats_interval_s`` in a worker thread, on its own short-lived
connection (never the stream's, never on the event loop), and measures the
bytes from the position the stream has read up to (the fetcher's resume
position) to the end of the newest file, across files.

Thread-safety: :func:`read_distance` runs in a worker thread and only
returns a number; the caller stores it for ``status()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from changebus.schemas import BadRequestError, binlog_file_number

from ._setup import connect

if TYPE_CHECKING:
    from ._config import MySQLConfig

__all__ = ["binlog_distance", "read_distance"]


def binlog_distance(logs: Sequence[tuple[str, int]], file: str, pos: int) -> int:
    """Bytes from ``file:pos`` to the end of the newest of ``logs`` ((name, size) pairs).

    -1 when ``file`` is not among them (purged, or another server's) or
    nothing was read yet. Files are ordered by their number, not by name.
    """
    if not file:
        return -1
    try:
        number = binlog_file_number(file)
        sizes = {binlog_file_number(name): size for name, size in logs}
    except BadRequestError:
        return -1
    if number not in sizes:
        return -1
    ahead = sum(size for n, size in sizes.items() if n > number)
    return ahead + max(sizes[number] - pos, 0)


def read_distance(config: MySQLConfig, file: str, pos: int) -> int:
    """The server's binlog distance from ``file:pos`` (a worker thread; one connection)."""
    conn = connect(config)
    try:
        with conn.cursor() as cur:
            cur.execute("SHOW BINARY LOGS")
            logs = [(str(row[0]), int(row[1])) for row in cur.fetchall()]
    finally:
        conn.close()
    return binlog_distance(logs, file, pos)
