"""One hosted partition: its buffer, schema registry, fetcher and ingest task.

The ingest task (on the event loop) pulls windows from the fetcher and hands
each to the partition's single writer thread, which registers any new table
schemas, appends the window to the buffer and returns; only then is the
window acknowledged to the fetcher (so the source releases only what the
relay holds). Readers wait for new windows through :meth:`wait_for_window`,
which the writer wakes with ``loop.call_soon_threadsafe``.

A fetcher failure marked retriable restarts the fetcher from the buffer's
last SCN with exponential backoff; a non-retriable one stops ingestion for
this partition (``/readyz`` then reports it) while reading goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from changebus.fetchers import Fetcher, ResumePoint, Window, create_fetcher
from changebus.schemas import (
    HEADER_SIZE,
    ChangebusError,
    DataLoss,
    EndOfWindow,
    EventTooLargeError,
    Op,
    SchemaChange,
    SchemaRegistry,
    TableSchema,
    decode_control,
    encode_control,
    parse_stream,
)

from ._buffer import EventBuffer
from ._config import PartitionConfig

__all__ = ["ConsumerSeen", "PartitionHost"]

log = logging.getLogger("changebus.relay.ingest")

_SCHEMA_CHANGE = int(Op.SCHEMA_CHANGE)


@dataclass
class ConsumerSeen:
    """What the relay last saw of one consumer (for /v1/status only)."""

    scn: int
    behind_bytes: int
    last_seen: float
    peer: str


class PartitionHost:
    """Owns everything of one physical partition inside the relay."""

    def __init__(self, config: PartitionConfig, data_dir: Path) -> None:
        self.config = config
        self.name = config.name
        self.directory = data_dir / config.name
        self._loop: asyncio.AbstractEventLoop | None = None
        self.buffer = EventBuffer(
            self.directory,
            config.buffer,
            name=config.name,
            partition_id=config.id,
            on_publish=self._published,
        )
        self.registry = SchemaRegistry(self.directory / "schemas.jsonl")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix=f"relay-writer-{config.name}")
        self._new_window: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self.fetcher: Fetcher | None = None
        self.state = "idle" if config.fetcher.kind == "none" else "starting"
        self.last_error = ""
        self.consumers: dict[str, ConsumerSeen] = {}
        self.stats = {"windows_data_loss": 0, "fetcher_restarts": 0}

    # ---- lifecycle ----------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._new_window = asyncio.Event()
        if self.config.fetcher.kind != "none":
            self._task = asyncio.create_task(self._ingest(), name=f"ingest-{self.name}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.fetcher is not None:
            await self.fetcher.close()
        await asyncio.get_running_loop().run_in_executor(self._writer, self.buffer.close)
        self._writer.shutdown(wait=True)

    def flush(self) -> None:
        """msync the buffer (runs on the writer thread to stay ordered with appends)."""
        self._writer.submit(self.buffer.flush)

    @property
    def ready(self) -> bool:
        return self.state in ("idle", "streaming", "finished")

    # ---- readers ------------------------------------------------------

    def _published(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        assert self._new_window is not None
        self._new_window.set()
        self._new_window = asyncio.Event()

    async def wait_for_window(self, seconds: float) -> bool:
        """Wait until a window is published (True) or ``seconds`` pass."""
        assert self._new_window is not None
        try:
            await asyncio.wait_for(self._new_window.wait(), seconds)
        except TimeoutError:
            return False
        return True

    def saw_consumer(self, client: str, scn: int, behind_bytes: int, peer: str) -> None:
        now = time.monotonic()
        self.consumers[client] = ConsumerSeen(scn, behind_bytes, now, peer)
        if len(self.consumers) > 1000:  # forget the long gone
            for key, seen in list(self.consumers.items()):
                if now - seen.last_seen > 300:
                    del self.consumers[key]

    # ---- ingest -------------------------------------------------------

    def _append(self, window: Window) -> None:
        """Writer thread: register new schemas, then append the window."""
        offsets, headers = parse_stream(window.data)
        for i in np.flatnonzero(headers["op"] == _SCHEMA_CHANGE).tolist():
            start = int(offsets[i]) + HEADER_SIZE
            payload = window.data[start : int(offsets[i]) + int(headers["total_length"][i])]
            change = decode_control(Op.SCHEMA_CHANGE, payload)
            assert isinstance(change, SchemaChange)
            table = TableSchema.from_json(json.loads(change.schema))
            self.registry.register_as(table, change.source_id)
        try:
            self.buffer.append_window(window.data)
        except EventTooLargeError as exc:
            # never a silent gap: the window is replaced by a DATA_LOSS marker
            self.stats["windows_data_loss"] += 1
            log.error(
                "partition %s: %s; recorded as data loss at SCN %d",
                self.name,
                exc.message,
                window.scn,
            )
            marker = b"".join(
                (
                    encode_control(
                        DataLoss(window.scn, window.scn, exc.message),
                        window.scn,
                        0,
                        window.timestamp_ns,
                        partition=self.config.id,
                    ),
                    encode_control(
                        EndOfWindow(0, window.source_position),
                        window.scn,
                        1,
                        window.timestamp_ns,
                        partition=self.config.id,
                    ),
                )
            )
            self.buffer.append_window(marker)

    async def _ingest(self) -> None:
        loop = asyncio.get_running_loop()
        cfg = self.config.fetcher
        delay = cfg.retry_initial_s
        while True:
            try:
                self.fetcher = create_fetcher(cfg.kind, self.name, self.config.id, cfg.options)
                meta = self.buffer.meta
                resume = ResumePoint(meta.last_scn, self.buffer.last_source_position)
                start_scn = await self.fetcher.start(resume)
                if meta.tail_event == meta.head_event and meta.prev_scn < 0 and start_scn >= 0:
                    await loop.run_in_executor(self._writer, self.buffer.set_start, start_scn)
                self.state = "streaming"
                self.last_error = ""
                async for window in self.fetcher.windows():
                    await loop.run_in_executor(self._writer, self._append, window)
                    await self.fetcher.acknowledge(window.scn)
                    delay = cfg.retry_initial_s
                self.state = "finished"
                log.info("partition %s: fetcher finished", self.name)
                return
            except asyncio.CancelledError:
                raise
            except ChangebusError as exc:
                self.last_error = exc.message
                if not exc.retriable:
                    self.state = "failed"
                    log.error("partition %s: fetcher failed for good: %s", self.name, exc.message)
                    return
                log.warning(
                    "partition %s: fetcher error, retrying in %.1fs: %s",
                    self.name,
                    delay,
                    exc.message,
                )
            except Exception as exc:
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.exception(
                    "partition %s: unexpected fetcher error, retrying in %.1fs", self.name, delay
                )
            finally:
                if self.fetcher is not None and self.state != "streaming":
                    with contextlib.suppress(Exception):
                        await self.fetcher.close()
            self.state = "retrying"
            self.stats["fetcher_restarts"] += 1
            await asyncio.sleep(delay)
            delay = min(delay * 2, cfg.retry_max_s)

    # ---- status -------------------------------------------------------

    def status(self) -> dict[str, Any]:
        m = self.buffer.meta
        now = time.monotonic()
        consumers = [
            {
                "client": client,
                "peer": seen.peer,
                "scn": seen.scn,
                "lag_scn": max(m.last_scn - seen.scn, 0) if seen.scn >= 0 else None,
                "behind_bytes": seen.behind_bytes,
                "seconds_since_request": round(now - seen.last_seen, 3),
            }
            for client, seen in sorted(self.consumers.items())
            if now - seen.last_seen <= 300
        ]
        status: dict[str, Any] = {
            "name": self.name,
            "id": self.config.id,
            "state": self.state,
            "min_scn": m.min_scn,
            "max_scn": m.last_scn,
            "prev_scn": m.prev_scn,
            "bytes_used": m.tail_pos - m.head_pos,
            "capacity_bytes": m.capacity,
            "events": m.tail_event - m.head_event,
            "windows": m.windows,
            "oldest_timestamp_ns": m.first_ts,
            "newest_timestamp_ns": m.last_ts,
            "consumers": consumers,
            "stats": {**self.buffer.stats, **self.stats},
        }
        if self.last_error:
            status["last_error"] = self.last_error
        if self.fetcher is not None:
            status["fetcher"] = self.fetcher.status()
        return status
