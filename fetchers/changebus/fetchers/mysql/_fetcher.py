"""The MySQL / MariaDB fetcher: the binlog through mysql-replication.

One thread per fetcher reads the binlog (:mod:`._stream`) and hands windows
to the event loop through a bounded :class:`ThreadFeed`, so a slow relay
slows the stream. Each start first checks the server and plans where the
stream begins (:mod:`._setup`). This module is the fetcher itself: the
relay's side of it and the state the two parts share.

Positions: every window's END_OF_WINDOW carries
``gtid=D-S-N;file=NAME;pos=P;server=ID[;base=B]`` (where the next
transaction starts, on which server, and the SCN base); on start the stream
resumes from the relay's last window's position. Windows at or below the
relay's last SCN are dropped (no duplicates in the buffer).

Failover (MariaDB): when the relay's last window came from another server
(its ``server`` differs from this server's ``@@server_id``), the fetcher
finds that window's GTID in this server's binlog (:mod:`._failover`) and
goes on right after it, with a new SCN base so that SCNs keep increasing
(``base = relay's last SCN - (file_number << 32 | end position)`` of that
transaction here: the transaction keeps its SCN on the new server). A GTID
this server does not hold is refused (divergent history). On the same
server, a GTID that is not where the relay saw it means the binlog was
rewritten (``RESET MASTER``): refused too.

Reconnects are the fetcher's own (:mod:`._stream`): from the end of the last
window emitted, up to ``reconnect_attempts`` times, then a retriable
:class:`SourceError` goes to the relay, which restarts the fetcher from its
buffer.

Checks at start, each a clear non-retriable :class:`SourceConfigError` naming
the setting: binary logging on, ``binlog_format=ROW``,
``binlog_row_image=FULL``, ``binlog_row_metadata=FULL``. A resume position in
a purged binlog file becomes a DATA_LOSS window (or a failure with
``on_binlog_purged = "fail"``), never a silent jump.

Thread-safety: ``start``/``acknowledge``/``close``/``status`` run on the
event loop; the stream thread writes ``stats`` and the position fields (plain
values, read for status only). The fields :meth:`MySQLFetcher.start` sets
from the :class:`StartPlan` are read by the stream thread, which starts
after it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from changebus.schemas import stop_task
from changebus.schemas.config import load_config_dict

from .._base import ResumePoint, Window, window_bytes
from .._threadfeed import ThreadFeed
from ._config import MySQLConfig
from ._ddl import DeclaredTypes
from ._distance import read_distance
from ._setup import set_up
from ._stream import run
from ._workers import start_workers

__all__ = ["MySQLFetcher"]

log = logging.getLogger("changebus.fetchers.mysql")


class MySQLFetcher:
    """Streams a MySQL/MariaDB server's binlog as windows (see the module docstring)."""

    def __init__(self, name: str, partition_id: int, config: MySQLConfig) -> None:
        self.name = name
        self.partition_id = partition_id
        #: the options as configured; ``config`` is them with ``password_file`` read at start
        self.options = config
        self.config = config
        self.server_id = config.server_id_for(name, partition_id)
        self._resume = ResumePoint()
        self._feed: ThreadFeed[Window] | None = None
        self._start: tuple[str, int] = ("", 0)  # (file, pos) the stream starts at
        #: (file, pos) the stream has read to ("": nothing yet); ahead of ``_start``
        #: while an XA prepare is pending (a restart goes back to it)
        self._read_to: tuple[str, int] = ("", 0)
        self._server = 0  # the server's @@server_id
        self._base = 0  # SCN = base + (file_number << 32 | pos): see the module docstring
        self._last_scn = -1
        self._checksum = 4
        self._data_loss: tuple[int, int, str, str, str] | None = None  # lo, hi, why, where, cause
        self._declared = DeclaredTypes()
        self._pool: ProcessPoolExecutor | None = None
        self.position = ""  # source_position of the last emitted window
        #: DATA_LOSS windows this fetcher made, by cause (the relay's /metrics)
        self.data_loss_events: Counter[str] = Counter()
        self._distance: asyncio.Task[None] | None = None
        self.stats: dict[str, Any] = {
            "windows": 0,
            "rows": 0,
            "heartbeats": 0,
            "reconnects": 0,
            "acked_scn": -1,
            # bytes of binlog the stream has not read yet (-1: not measured; ._distance)
            "binlog_distance_bytes": -1,
        }

    # ---- Fetcher protocol -------------------------------------------------

    async def start(self, resume: ResumePoint) -> int:
        """Check the server, plan the start position; returns the SCN the stream is complete from."""
        self._resume = resume
        self._last_scn = resume.scn
        return await asyncio.to_thread(self._setup)

    def window_feed(self) -> ThreadFeed[Window]:
        """Start reading the binlog; its windows as a queue (see :class:`WindowFeed`)."""
        self._feed = ThreadFeed(
            self._run, maxsize=1024, name=f"mysql-{self.name}", weigh=window_bytes
        )
        if self.config.binlog_stats_interval_s > 0 and self._distance is None:
            self._distance = asyncio.create_task(
                self._measure_distance(), name=f"binlog-distance-{self.name}"
            )
        return self._feed

    async def windows(self) -> AsyncIterator[Window]:
        async for window in self.window_feed().items():
            yield window

    async def _measure_distance(self) -> None:
        """Read the binlog distance now and then (a worker thread; see ._distance)."""
        while True:
            file, pos = self._read_to if self._read_to[0] else self._start
            try:
                self.stats["binlog_distance_bytes"] = await asyncio.to_thread(
                    read_distance, self.config, file, pos
                )
            except Exception as exc:  # noqa: BLE001 - a figure only: the stream reports failures
                log.debug("partition %s: binlog distance not read: %s", self.name, exc)
            await asyncio.sleep(self.config.binlog_stats_interval_s)

    async def acknowledge(self, scn: int) -> None:
        # the binlog is kept by the server's own retention; nothing to release
        self.stats["acked_scn"] = max(self.stats["acked_scn"], scn)

    async def close(self) -> None:
        if self._distance is not None:
            await stop_task(self._distance)
            self._distance = None
        if self._feed is not None:
            await self._feed.close()
        if self._pool is not None:
            pool, self._pool = self._pool, None
            await asyncio.to_thread(pool.shutdown, wait=True, cancel_futures=True)

    def status(self) -> dict[str, Any]:
        return {
            "kind": "mysql",
            "server_id": self.server_id,
            "source_position": self.position,
            "decode_workers": 0 if self._pool is None else self.config.decode_workers,
            "mysql_server_id": self._server,
            "scn_base": self._base,
            **self.stats,
        }

    # ---- set-up (a worker thread; _setup) -------------------------------------

    def _setup(self) -> int:
        # the password file is read at each start (a rotated password takes a restart)
        self.config = self.options.resolved()
        plan = set_up(self.config, self._resume, self._declared, self.name)
        self._start, self._server, self._base = plan.start, plan.server, plan.base
        self._checksum, self._data_loss = plan.checksum, plan.data_loss
        if self.config.decode_workers and self._pool is None:
            self._pool = start_workers(self.config.decode_workers, self.name)
        return plan.scn

    # ---- the stream thread (_stream) ---------------------------------------------

    def _run(self, emit: Callable[[Window], None], stopping: threading.Event) -> None:
        run(self, emit, stopping)

    def _emit(self, window: Window, emit: Callable[[Window], None]) -> None:
        emit(window)
        self._last_scn = window.scn
        self.position = window.source_position
        self.stats["windows"] += 1


def _factory(name: str, partition_id: int, options: Mapping[str, Any]) -> MySQLFetcher:
    return MySQLFetcher(name, partition_id, load_config_dict(MySQLConfig, options, "fetcher"))
