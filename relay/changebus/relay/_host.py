"""One hosted partition: its buffer, schema registry, fetcher and ingest task.

The ingest task (on the event loop) pulls windows from the fetcher through a
bounded queue and hands them to the partition's single writer thread in
groups: everything that queued up while the writer was busy goes in one
group commit (at most 512 windows or 8 MiB), so the per-append cost is
shared when the source is busy and latency stays minimal when it is not.
Windows that carry their event sizes (framed in this process by changebus's
encoders: :attr:`~changebus.fetchers.Window.event_sizes`) take the buffer's
trusted path, without a rescan or CRCs computed again; others are verified in
full. The writer registers any new table schemas (from SCHEMA_CHANGE events,
and the registry entries a window carries in ``Window.schemas``), appends the
group and returns;
only then is the group's last SCN acknowledged to the fetcher (so the source
releases only what the relay holds). Readers wait for new windows through :meth:`wait_for_window`,
which the writer wakes with ``loop.call_soon_threadsafe``.

Durability (``PartitionConfig.durability``): with ``"page_cache"`` a group
is acknowledged once appended; with ``"fsync"`` the writer only asks the
:class:`~._syncer.GroupSyncer` for a sync and goes on, and an acknowledger
task (:meth:`PartitionHost._ack_synced`) acknowledges up to ``synced_scn``
after each sync: acks trail asynchronously, never pass what is on disk and
never go backwards (docs/operations.md, "Durability").

Fencing (relay clusters, :mod:`._cluster`). While :attr:`PartitionHost.fence`
is set (the partition leads), the writer asks ``fence.admit()`` once per
group, right before appending it, and the ingest asks ``fence.ack_scn(scn)``
right before acknowledging it (one call each per group, never per event).
With ``durability = "fsync"`` the acknowledger asks ``fence.ack_scn`` once
per sync instead (so the source is acknowledged up to ``min(synced_scn,
fence limit)``), and a refusal there stops the ingest the same way.
A refusal stops the ingest on the spot: the group is neither appended nor
acknowledged, the source fetcher is closed, the state becomes ``fenced``
(``/readyz`` 503 with the reason) and ``fence.refused(reason)`` tells the
cluster member to step down.

Figures for ``/metrics`` (:mod:`._lagmetrics`) cost the ingest one
wall-clock read per group commit (:attr:`PartitionHost.appended_at`);
data-loss windows are counted by cause in :attr:`PartitionHost.losses`
(the host's own, and a dropped fetcher's ``data_loss_events``, kept so that
the counter never goes back when a fetcher is replaced).

A fetcher failure marked retriable restarts the fetcher from the buffer's
last SCN with exponential backoff; a non-retriable one stops ingestion for
this partition (``/readyz`` then reports it) while reading goes on. Its text
(``last_error`` in ``/v1/status``, the log lines) is scrubbed of the
fetcher's secrets (:func:`changebus.schemas.config.scrub`): a driver may
quote a malformed DSN in its message.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from changebus.fetchers import Fetcher, ResumePoint, Window, WindowFeed, create_fetcher
from changebus.schemas import (
    ChangebusError,
    DirLock,
    SchemaRegistry,
    StoreUnavailableError,
    stop_task,
)
from changebus.schemas.config import scrub, scrub_exception, secret_values

from ._acks import Fenced as _Fenced, IngestFence as IngestFence, SourceAcks
from ._buffer import EventBuffer
from ._chain import RestartBufferError
from ._config import FetcherConfig, PartitionConfig
from ._hostappend import GroupAppend
from ._hoststatus import data_loss_events, fetcher_losses, partition_status
from ._syncer import GroupSyncer
from ._wakeups import Wakeups
from ._windowqueue import WindowQueue
from ._writerthread import WriterThread, fits_inline

__all__ = [
    "STATES",
    "ConsumerSeen",
    "IngestFence",
    "PartitionHost",
]

log = logging.getLogger("changebus.relay.ingest")


#: windows waiting between the fetcher and the writer (back-pressure beyond), by
#: count and by bytes (see ._windowqueue)
_QUEUE_WINDOWS = 4096
_QUEUE_BYTES = 8 << 20
#: a group commit takes at most this much of what queued up
_GROUP_WINDOWS = 512
_GROUP_BYTES = 8 << 20
#: every state of a partition's ingest (:attr:`PartitionHost.state`): ``idle`` (no
#: fetcher configured), ``starting``, ``streaming``, ``retrying`` (after a retriable
#: error, with backoff), ``fenced`` (a deposed cluster leader), ``failed`` (a
#: non-retriable error: ingest stopped), ``finished`` (the fetcher ended its stream)
STATES = ("idle", "starting", "streaming", "retrying", "fenced", "failed", "finished")
#: consumers remembered per partition for /v1/status (least recently seen forgotten first)
MAX_CONSUMERS = 1000
#: characters of a ``client=`` id kept
MAX_CLIENT_ID = 128


def _nothing() -> None:
    """Run on the writer thread to wait for the work submitted before it."""


def _owner(client: str) -> str:
    """The principal a consumer id ``principal/client`` names ("" for other ids)."""
    owner, slash, _rest = client.partition("/")
    return owner if slash else ""


@dataclass
class ConsumerSeen:
    """What the relay last saw of one consumer (for /v1/status only)."""

    scn: int
    behind_bytes: int
    last_seen: float
    peer: str


class PartitionHost(SourceAcks, GroupAppend):
    """Owns everything of one physical partition inside the relay."""

    def __init__(
        self,
        config: PartitionConfig,
        data_dir: Path,
        *,
        replayable: bool = False,
        resize: bool = False,
    ) -> None:
        """``resize``: a buffer whose files hold other sizes starts empty, its old files
        moved aside (else the start is refused: :mod:`._bufopen`)."""
        self.config = config
        self.name = config.name
        self.directory = data_dir / config.name
        #: waking readers when windows are published (:mod:`._wakeups`)
        self.wakeups = Wakeups(config.name)
        #: one process at a time in the partition's directory: taken before recovery
        #: reads (and repairs) anything there, released by :meth:`stop`
        self._dir_lock = DirLock(self.directory, f"relay partition {config.name!r}")
        buffer: EventBuffer | None = None
        try:
            buffer = EventBuffer(
                self.directory,
                config.buffer,
                name=config.name,
                partition_id=config.id,
                on_publish=self.wakeups.published,
                # a chained relay's upstream still holds what an OS crash took from its disk
                # (or says 410): windows recovery drops are read again, not lost (a DATA_LOSS
                # window stopped its consumers for windows the upstream had; found by review)
                replayable=replayable or config.fetcher.kind == "relay",
                resize=resize,
            )
            self.registry = SchemaRegistry(self.directory / "schemas.jsonl")
            #: the grouped syncer (``durability = "fsync"`` only: see :mod:`._syncer`)
            self.syncer: GroupSyncer | None = None
            if config.durability == "fsync":
                self.syncer = GroupSyncer(buffer)
        except BaseException:
            # what was opened is closed now, not by the collector (review)
            try:
                if buffer is not None:
                    buffer.close()
            finally:
                self._dir_lock.release()
            raise
        self.buffer = buffer
        self._writer = WriterThread(config.name)
        self._task: asyncio.Task[None] | None = None
        self.fetcher: Fetcher | None = None
        self.state = "idle" if config.fetcher.kind == "none" else "starting"
        self.last_error = ""
        self._flushing = False  # (a periodic flush is running: see flush)
        #: what error texts must never show: the fetcher's secret option values
        self._secrets = secret_values(config.fetcher)
        self.consumers: dict[str, ConsumerSeen] = {}
        #: entries of :attr:`consumers` per owner (:meth:`saw_consumer`)
        self._owned: dict[str, int] = {}
        #: how many consumers :attr:`consumers` remembers (the daemon raises it to
        #: ``http.max_connections``), and how many it forgot for want of room
        self.max_consumers = MAX_CONSUMERS
        self.consumers_forgotten = 0
        self.stats = {"windows_data_loss": 0, "fetcher_restarts": 0}
        #: data-loss windows by cause (``/metrics``): what this host recorded itself plus
        #: what its retired fetchers reported (see :func:`fetcher_losses`)
        self.losses: Counter[str] = Counter()
        #: wall-clock time of the newest group appended (0: none since start), and of
        #: the start (so a fetcher that never delivers shows as idle)
        self.appended_at = 0.0
        self.started_at = time.time()
        #: the leadership epoch this partition serves under (None: not in a cluster);
        #: answered as ``X-Changebus-Epoch`` on /v1/stream so that followers can fence
        #: a deposed leader (changebus.relay.chain's ``min_epoch``)
        self.epoch: int | None = None
        #: the leader's checks before appending and acknowledging (None: none; see
        #: the module docstring); set by the cluster member before it switches fetchers
        self.fence: IngestFence | None = None
        #: the partition's role in a relay cluster ("leader", "follower" or "": none)
        self.role = ""
        self._switching = asyncio.Lock()
        #: the newest SCN acknowledged to ``_acked_by`` (acks never go backwards)
        self._acked_by: Fetcher | None = None
        self._acked_scn = -1

    # ---- lifecycle ----------------------------------------------------

    async def start(self) -> None:
        self.wakeups.start()
        if self.syncer is not None:
            self.syncer.start()
        if self.config.fetcher.kind != "none":
            # build it now: an unknown kind or bad options fail the start-up
            self.fetcher = await self._create_fetcher()
            self._task = asyncio.create_task(self._ingest(), name=f"ingest-{self.name}")

    async def stop(self) -> None:
        self.wakeups.stop()
        task = self._task
        try:
            await stop_task(task)
            if self.fetcher is not None:
                await self.fetcher.close()
        finally:  # (a fetcher that failed to close still leaves the files closed, unlocked)
            if task is None or task.done():
                await self._close_files()
            else:
                # cancelled while the ingest task still runs: it may append yet, so the
                # files stay open and the directory locked (closed under it, and another
                # process let in, before: review); the process is going away
                log.warning("partition %s: stop cancelled before its ingest ended", self.name)

    async def _close_files(self) -> None:
        try:
            if self.syncer is not None:  # before the buffer's mappings go
                await asyncio.to_thread(self.syncer.stop)
            await self._writer.run(self.buffer.close)
            # the writer thread only has to exit now, but joining it is a wait: not on the loop
            await self._writer.shutdown()
        finally:
            self._dir_lock.release()

    async def switch_fetcher(
        self, fetcher: FetcherConfig, *, fence: IngestFence | None = None
    ) -> None:
        """Replace this partition's fetcher at run time (a leader's source <-> a follower's chain).

        The ingest task stops between two windows, the old fetcher is closed
        and the writer finishes the group in flight; the new fetcher (built
        from ``fetcher``, kind ``"none"``: none) then starts from the
        buffer's newest SCN and its registry, like after a restart: no
        window is lost or appended twice. Reading goes on meanwhile. Calls
        are serialised; ``stop`` must not run concurrently. ``fence``
        replaces :attr:`fence` once the old fetcher stopped and its last
        group is through the writer, before the new fetcher starts (so the old
        source's windows meet the old fence, the new fetcher's the new one).
        """
        async with self._switching:
            task, self._task = self._task, None
            await stop_task(task)
            if self.fetcher is not None:
                with contextlib.suppress(Exception):
                    await self.fetcher.close()
                self._retire(self.fetcher)
                self.fetcher = None
            # a group the cancelled task handed to the writer is appended before we resume
            await self._writer.run(_nothing)
            self.fence = fence
            self.config = dataclasses.replace(self.config, fetcher=fetcher)
            self._secrets = secret_values(fetcher)
            self.state = "idle" if fetcher.kind == "none" else "starting"
            self.last_error = ""
            log.info("partition %s: fetcher switched to %s", self.name, fetcher.kind)
            if fetcher.kind != "none":
                self.fetcher = await self._create_fetcher()
                self._task = asyncio.create_task(self._ingest(), name=f"ingest-{self.name}")

    async def _create_fetcher(self) -> Fetcher:
        """The configured fetcher, built in a thread.

        The first use of a kind reads the plugin declarations and imports the
        plugin's module (file reads), which must not happen on the event loop.
        """
        cfg = self.config.fetcher
        return await asyncio.to_thread(
            create_fetcher, cfg.kind, self.name, self.config.id, cfg.options
        )

    async def flush(self) -> None:
        """msync the buffer (runs on the writer thread to stay ordered with appends).

        Nothing to do with ``durability = "fsync"``: the syncer keeps it synced.
        One at a time: a tick while a flush runs is skipped (queued each interval,
        slow flushes piled up on the writer thread ahead of appends), and a failed
        one is logged with the partition's name (it was dropped unread: review).
        """
        if self.syncer is not None or self._flushing:
            return
        self._flushing = True
        try:
            await self._writer.run(self.buffer.flush)
        except Exception as exc:  # noqa: BLE001 - logged, tried again at the next tick
            log.error("partition %s: flushing the buffer failed: %s", self.name, exc)
        finally:
            self._flushing = False

    @property
    def ready(self) -> bool:
        """Serving and ingesting as configured (an fsync partition whose syncs failed is not)."""
        if self.syncer is not None and self.syncer.error:
            return False
        return self.state in ("idle", "streaming", "finished")

    # ---- readers ------------------------------------------------------

    def add_wake_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` (on the loop) whenever waiting readers are woken.

        The HTTP layer's tail broadcast (:mod:`._broadcast`) is one: it does
        its own coalescing on top of these wake-ups (:mod:`._wakeups`).
        """
        self.wakeups.add_listener(listener)

    async def wait_for_window(self, seconds: float) -> bool:
        """Wait until a window is published (True) or ``seconds`` pass."""
        return await self.wakeups.wait(seconds)

    def saw_consumer(self, client: str, scn: int, peer: str, reached: int = -1) -> None:
        """Note a consumer's request for ``/v1/status``.

        ``reached``: the virtual byte position just past the answer it got (the
        answer's ``start_pos`` plus its bytes; -1: nothing to send, it is at the
        tail, or the answer reached it). Its ``behind_bytes`` are the buffer's
        bytes after that: exact for an unfiltered answer, an upper bound for a
        filtered one that stopped before the tail (the events a filter skipped
        after the answer count).

        ``consumers`` is kept in least-recently-seen order (a consumer seen
        again moves to the end) and holds at most :attr:`max_consumers`
        entries: beyond, one is forgotten (and counted in
        :attr:`consumers_forgotten`), so made-up client ids cannot grow it
        (the HTTP layer cuts ids to :data:`MAX_CLIENT_ID` characters). The
        one forgotten is the least recently seen of the *owner* holding the
        most entries (the principal a ``principal/client`` id names; "" for
        the others, ``_owned`` counts them): a principal sending a thousand
        made-up ids pushed every other principal's lagging consumer out of
        ``/v1/status`` and the lag metrics (review); now it pushes out its own.
        """
        consumers = self.consumers
        known = consumers.pop(client, None) is not None
        behind = max(self.buffer.meta.tail_pos - reached, 0) if reached >= 0 else 0
        consumers[client] = ConsumerSeen(scn, behind, time.monotonic(), peer)
        owned = self._owned
        if not known:
            owner = _owner(client)
            owned[owner] = owned.get(owner, 0) + 1
        if len(consumers) > self.max_consumers:
            most = max(owned, key=owned.__getitem__)
            victim = next(c for c in consumers if _owner(c) == most)
            del consumers[victim]
            owned[most] -= 1
            if not owned[most]:
                del owned[most]
            self.consumers_forgotten += 1

    # ---- ingest -------------------------------------------------------

    async def _commit(self, fetcher: Fetcher, batch: list[Window]) -> None:
        """Append ``batch``, then acknowledge it; raises _Fenced if refused.

        A small group is appended right here on the event loop when the
        writer thread is idle (:func:`~._writerthread.fits_inline`): two thread hand-overs less
        per commit, each a wake-up that costs a quarter of a millisecond of a
        window's latency on an idle machine. Anything else goes to the writer
        thread. With ``durability = "fsync"`` the acknowledger acknowledges
        after the sync. Once a sync failed for good nothing more is appended: the
        source is acknowledged no further, so ingesting on only grew the fetcher's
        unacknowledged windows and the source's retained log until someone restarted
        the relay (found by review); the partition fails instead, and a restart
        replays the unsynced windows from the source.
        """
        syncer = self.syncer
        if syncer is not None and syncer.error:
            raise StoreUnavailableError(
                f"{syncer.error}: ingest stopped; restart the relay once its disk works",
                retriable=False,
            )
        if fits_inline(self._writer, self.buffer, batch):
            appended = self._append(batch)
        else:
            appended = await self._writer.run(self._append, batch)
        if not appended:
            raise _Fenced("the leadership lease is not valid: group not appended")
        self.appended_at = time.time()  # once per group (source lag and idle time)
        if self.syncer is None:
            await self._acknowledge(fetcher, batch[-1].scn)

    @staticmethod
    def _feed(fetcher: Fetcher) -> WindowFeed:
        """The fetcher's windows as a queue: its own ``window_feed()``, or one a pump fills.

        A fetcher with ``window_feed()`` (the built-in ones) hands its
        windows straight to this queue from its thread; a pump task and a
        second queue between them would cost a task switch and a loop
        iteration per window (about a tenth of a millisecond of latency on
        an idle machine).
        """
        window_feed = getattr(fetcher, "window_feed", None)
        if callable(window_feed):
            feed: WindowFeed = window_feed()
            return feed
        return WindowQueue(_QUEUE_WINDOWS, _QUEUE_BYTES)

    async def _pump(
        self, fetcher: Fetcher, queue: WindowQueue[Window | BaseException | None]
    ) -> None:
        """Move windows from the fetcher into the bounded queue; errors too."""
        try:
            async for window in fetcher.windows():
                await queue.put(window)
            await queue.put(None)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the ingest loop, re-raised there
            await queue.put(exc)

    async def _ingest(self) -> None:
        cfg = self.config.fetcher
        delay = cfg.retry_initial_s
        while True:
            pump: asyncio.Task[None] | None = None
            acker: asyncio.Task[None] | None = None
            fenced = False
            #: the attempt ended in an error: its fetcher is closed below (a cancelled
            #: ingest leaves that to stop(), a finished one has nothing left open)
            failed = True
            try:
                if self.fence is not None and not self.fence.admit():
                    # a deposed leader never (re)opens the source: it might report
                    # positions as flushed that the followers do not hold
                    raise _Fenced("the leadership lease is not valid: source not started")
                if self.fetcher is None:
                    self.fetcher = await self._create_fetcher()
                meta = self.buffer.meta
                resume = ResumePoint(
                    meta.last_scn,
                    self.buffer.last_source_position,
                    tuple(self.registry.to_json()),
                )
                start_scn = await self.fetcher.start(resume)
                if meta.tail_event == meta.head_event and meta.prev_scn < 0 and start_scn >= 0:
                    lost = bool(getattr(self.fetcher, "start_evicted", False))
                    # (a follower: where the upstream's source resumes after start_scn)
                    position = str(getattr(self.fetcher, "start_position", ""))
                    await self._writer.run(
                        functools.partial(
                            self.buffer.set_start, start_scn, evicted=lost, position=position
                        )
                    )
                self.state = "streaming"
                self.last_error = ""
                queue = self._feed(self.fetcher)
                if isinstance(queue, WindowQueue):
                    pump = asyncio.create_task(
                        self._pump(self.fetcher, queue), name=f"pump-{self.name}"
                    )
                if self.syncer is not None:
                    acker = asyncio.create_task(
                        self._ack_synced(self.fetcher, queue), name=f"ack-{self.name}"
                    )
                finished = False
                while not finished:
                    item = await queue.get()
                    batch: list[Window] = []
                    size = 0
                    while True:
                        if item is None:
                            finished = True
                            break
                        if isinstance(item, BaseException):
                            if batch:  # keep what came before the failure
                                await self._commit(self.fetcher, batch)
                            raise item
                        batch.append(item)
                        size += len(item.data)
                        if size >= _GROUP_BYTES or len(batch) >= _GROUP_WINDOWS or queue.empty():
                            break
                        item = queue.get_nowait()
                    if batch:
                        await self._commit(self.fetcher, batch)
                        delay = cfg.retry_initial_s
                self.state = "finished"
                failed = False
                log.info("partition %s: fetcher finished", self.name)
                return
            except asyncio.CancelledError:
                failed = False
                raise
            except RestartBufferError as exc:
                self.last_error = scrub(exc.message, self._secrets)
                log.warning(
                    "partition %s: %s; the buffer starts again after SCN %d",
                    self.name,
                    self.last_error,
                    exc.scn,
                )
                await self._writer.run(self.buffer.restart_after, exc.scn, exc.position)
                delay = cfg.retry_initial_s
                self.state = "retrying"  # not streaming: the fetcher is closed below
            except _Fenced as exc:
                self.state = "fenced"
                self.last_error = str(exc)
                log.error("partition %s: ingest stopped: %s", self.name, exc)
                fenced = True
            except ChangebusError as exc:
                self.last_error = scrub(exc.message, self._secrets)
                if not exc.retriable:
                    self.state = "failed"
                    log.error(
                        "partition %s: fetcher failed for good: %s", self.name, self.last_error
                    )
                    return
                log.warning(
                    "partition %s: fetcher error, retrying in %.1fs: %s",
                    self.name,
                    delay,
                    self.last_error,
                )
            except Exception as exc:  # noqa: BLE001 - logged (scrubbed traceback), retried
                self.last_error = scrub_exception(exc, self._secrets)
                log.error(
                    "partition %s: unexpected fetcher error, retrying in %.1fs: %s",
                    self.name,
                    delay,
                    scrub_exception(exc, self._secrets, trace=True),
                )
            finally:
                for task in (pump, acker):
                    # (a stop() cancelling the ingest meanwhile is raised here: suppressed,
                    # the ingest restarted its fetcher while stop() waited for it; review)
                    await stop_task(task)
                if self.fetcher is not None and failed:
                    with contextlib.suppress(Exception):
                        await self.fetcher.close()
            if self.fetcher is not None:
                self._retire(self.fetcher)
            if fenced:
                self.fetcher = None
                if self.fence is not None:
                    self.fence.refused(self.last_error)
                return
            self.fetcher = None  # a fresh one for the next attempt
            self.state = "retrying"
            self.stats["fetcher_restarts"] += 1
            await asyncio.sleep(delay)
            delay = min(delay * 2, cfg.retry_max_s)

    # ---- status -------------------------------------------------------

    def _retire(self, fetcher: Fetcher) -> None:
        """Keep a fetcher's data-loss counts once it is dropped (counters never go back)."""
        self.losses.update(fetcher_losses(fetcher))

    def data_loss_events(self) -> Counter[str]:
        """Data-loss windows by cause since start (scrape time; see :mod:`._hoststatus`)."""
        return data_loss_events(self)

    def status(self, *, consumers: bool = True) -> dict[str, Any]:
        """The partition's ``/v1/status`` entry (see :mod:`._hoststatus`)."""
        return partition_status(self, consumers=consumers)
