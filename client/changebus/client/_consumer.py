"""The asyncio consumer: iterator and callback APIs over one relay partition.

Structure::

    relays --HTTP--> RelayStream --> RelayFetcher task --> WindowQueue --> iterator / Dispatcher
                     (validate,       (decode; bootstrap    (bounded,      (application)
                      failover)        when fallen off)      flow control)

:class:`Consumer` owns the fetcher task, the queue, the schema cache, the
HTTP session (unless one is given) and the :class:`~._position.PositionTracker`.
Two positions, each with one owner: the fetch position (the last window
queued: :attr:`.RelayStream.position`) and the application's checkpoint
(processed and persisted: the tracker).
It serves one application loop at a time: either ``async for window in
consumer`` or ``await consumer.run(callbacks)``, not both.

Delivery is at-least-once: a window's position is persisted only after the
application finished it (iterator: when it asks for the next window or calls
:meth:`Consumer.commit`; callbacks: after ``on_checkpoint``), so a crash
replays at most the windows since the last persisted checkpoint. Use
:attr:`ChangeEvent.dedupe_key` (or an idempotent sink, see
:mod:`._apply`) to make processing effectively-once.

Consumer groups: with ``config.group`` the consumer is a member of a
group sharing ``config.partitions`` (:mod:`._group`, which this class hands
every call to): windows carry their unit (``Window.unit``), the persister
is a :class:`~changebus.schemas.UnitStore` (default: checkpoints in
ZooKeeper) and a :class:`~._rebalance.RebalanceListener` hears of units
given and taken. The single-partition path below is not involved.

Thread-safety: every method is for the consumer's event loop, except
:meth:`Consumer.stop`, which any thread may call.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Self

import aiohttp

from changebus.schemas import Checkpoint, ConfigError, Mode, Unit, UnitStore, stop_task

from ._callbacks import AsyncCallbacks, Callbacks
from ._config import ConsumerConfig
from ._decode import SchemaCache
from ._dispatch import Dispatcher, in_async_callback
from ._errors import DataLossDetectedError
from ._fetch import RelayFetcher, start_point
from ._http import open_session
from ._model import Window
from ._persist import CheckpointPersister, MemoryCheckpointPersister
from ._position import PositionTracker
from ._queue import QueueClosed, WindowQueue

if TYPE_CHECKING:
    from ._cluster import ClusterRoute
    from ._group import GroupConsumer

__all__ = ["Consumer"]

log = logging.getLogger(__name__)


class Consumer:
    """Consumes one physical partition from a set of relays (module docstring).

    ``persister`` keeps the checkpoint between runs (default: in memory
    only); a stored checkpoint overrides ``config.start``. In a consumer
    group (``config.group``) it must be a
    :class:`~changebus.schemas.UnitStore` (default: ``ZkUnitStore`` on the
    member's ZooKeeper session; one given is not closed here), and
    ``listener`` (a :class:`~changebus.client.RebalanceListener`) is told of
    the units assigned and revoked. ``session`` lets
    the application share an :class:`aiohttp.ClientSession` (it is then not
    closed here, and ``config.auth`` is not applied to it: open it with
    :func:`~changebus.client.open_session`).

    Usage::

        async with Consumer(config, persister=FileCheckpointPersister("ckpt.json")) as c:
            async for window in c:
                for event in window.events:
                    ...
    """

    def __init__(
        self,
        config: ConsumerConfig,
        persister: CheckpointPersister | UnitStore | None = None,
        *,
        listener: object | None = None,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self.config = config
        self._group: GroupConsumer | None = None
        if config.group:
            if persister is not None and not isinstance(persister, UnitStore):
                raise ConfigError(
                    f"group {config.group!r}: the persister must be a UnitStore (ZkUnitStore,"
                    " FileUnitStore, PostgresUnitStore or a replica), not"
                    f" {type(persister).__name__}"
                )
            from ._group import GroupConsumer  # kazoo only for consumer groups

            self._group = GroupConsumer(config, persister, listener, session)
            persister = None
        elif listener is not None:
            raise ConfigError("listener: rebalance listeners are for consumer groups (group=...)")
        elif persister is not None and not isinstance(persister, CheckpointPersister):
            raise ConfigError(
                f"persister: {type(persister).__name__} is a unit store of consumer groups;"
                " set group (and zookeeper) or use a CheckpointPersister"
            )
        self.persister: CheckpointPersister = persister or MemoryCheckpointPersister()
        self._session = session
        self._own_session = session is None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: WindowQueue | None = None
        self._fetcher: RelayFetcher | None = None
        self._task: asyncio.Task[None] | None = None
        self._position: PositionTracker | None = None
        self._mode: Literal["", "iterator", "callbacks"] = ""
        #: set once :meth:`run` ended (what :meth:`close` waits for)
        self._run_ended: asyncio.Event | None = None
        #: the task running :meth:`run` (its own close, from a checkpoint store, say,
        #: must not wait for itself)
        self._run_task: asyncio.Task[Any] | None = None
        self._dispatcher: Dispatcher | None = None
        self._uncommitted: Window | None = None
        self._failed: BaseException | None = None
        self._closed = False
        #: stop() came before the queue existed (during start): start closes it at once
        self._stop_requested = False
        #: a bounded read (``until_scn``) yielded its last window
        self._range_ended = False
        self._route: ClusterRoute | None = None
        self.cache = SchemaCache.for_config(config)

    # ---- lifecycle ----------------------------------------------------

    async def start(self) -> None:
        """Load the checkpoint and start fetching (implied by iteration and ``run``)."""
        if self._group is not None:
            return await self._group.start()
        if self._task is not None:
            return
        if self._closed:
            raise RuntimeError("this consumer is closed")
        cfg = self.config
        self._loop = asyncio.get_running_loop()
        stored = await self.persister.load()
        checkpoint = stored if stored is not None else Checkpoint({})
        partition = cfg.partition
        if partition is None and len(checkpoint.partitions) == 1:
            partition = next(iter(checkpoint.partitions))
        pc = checkpoint.get(partition) if partition is not None else None
        if cfg.uses_cluster:  # first: the table may list the bootstrap servers a resume needs
            cfg = await self._route_cluster(cfg)
        try:
            position, latest, resume = start_point(pc, cfg, f"partition {partition}")
            if self._session is None:  # (a token file that cannot be read fails here)
                self._session = await open_session(cfg.auth)
        except BaseException:
            if self._route is not None:  # the routing table's ZooKeeper session: not left open
                await self._route.stop()
                self._route = None
            raise
        if self._closed_meanwhile():
            # close() ran while this start awaited (a SIGTERM handler): it found nothing
            # to release, so what the start opened goes now, and the iteration ends (the
            # start went on and delivered windows from a closed consumer: found by review)
            await self._release()
            return
        if resume is not None:
            log.info("resuming the bootstrap of partition %s (%s)", partition, resume.mode.value)
        elif pc is not None and pc.has_position:
            log.info("resuming partition %s after SCN %d", partition, position)
        self._position = PositionTracker(checkpoint, self.persister)
        self._queue = WindowQueue(cfg.queue_windows, cfg.queue_bytes)
        if self._stop_requested:  # stop() ran while this start was under way
            self._queue.close_threadsafe(asyncio.get_running_loop())
        self._fetcher = RelayFetcher(
            cfg,
            self._session,
            self._queue,
            self.cache,
            position=position,
            latest=latest,
            partition=partition,
            resume=resume,
        )
        self._task = asyncio.create_task(self._fetcher.run(), name="changebus-fetcher")
        if self._route is not None:
            self._route.on_change(self._fetcher.set_relays, cfg.relays)
            if not self.config.bootstrap_servers:  # follow the table's, even when none yet
                self._route.on_bootstrap_change(
                    self._fetcher.set_bootstrap_servers, cfg.bootstrap_servers
                )

    def _closed_meanwhile(self) -> bool:
        """Whether :meth:`close` ran (read after an await: another task may have)."""
        return self._closed

    async def _route_cluster(self, cfg: ConsumerConfig) -> ConsumerConfig:
        """Open the cluster's routing table; ``cfg`` with the relays it lists (waits for one)."""
        # kazoo only for consumers of a cluster
        from ._cluster import open_route

        assert cfg.partition is not None  # the config demands it with zookeeper
        route, relays = await open_route(cfg, cfg.partition)
        self._route = route
        boot = cfg.bootstrap_servers or route.bootstrap_servers()
        return replace(cfg, relays=relays, bootstrap_servers=boot)

    async def close(self) -> None:
        """Stop fetching and release everything; idempotent.

        In iterator mode the position of windows already committed or skipped
        as empty is persisted; the last window yielded and not committed is
        not (it comes again next time). A group member revokes its units
        (``on_revoked``, final commit) and leaves the group.
        """
        if self._group is not None:
            return await self._group.close()
        if self._closed:
            return
        self._closed = True
        try:
            if self._queue is not None:
                await self._queue.close()
            # (cancel and wait without suppressing CancelledError: that swallowed the
            # cancellation of the task calling close() too; review)
            await stop_task(self._task)
            await self._run_finished()
            if self._mode == "iterator" and self._position is not None and self._failed is None:
                await self._position.persist()
        finally:
            await self._release()

    async def _run_finished(self) -> None:
        """Wait for a :meth:`run` under way to finish its window and end (the queue is
        closed), for as long as it starts a callback within each time budget (and a
        second).

        run() finishes the window under way (its callbacks, checkpoint and
        store) and ends on the closed queue: the session goes after that.
        close() returned at once and the window's callbacks went on after it
        (the application's sink closed under them), and a SyncConsumer's loop
        stopped under a run() that then never returned (review). A close from
        inside a window's async callbacks still under way (a callback, or a task
        it made, which it may await) does not wait: that would wait for itself.
        Nor does run()'s own task (a checkpoint store's close). A task a
        callback made and left running waits once that window's callbacks
        ended, as any other task does (it inherited the exemption for good
        before, and its close returned under the next windows); such a task
        that later callbacks await must call :meth:`stop`, not close (close
        would wait for a callback that waits for it, until the callback's
        budget). A sync callback's close, through the loop, gives up after a
        budget with no callback started.
        """
        running, dispatcher = self._run_ended, self._dispatcher
        if running is None or running.is_set() or dispatcher is None:
            return
        if in_async_callback() or asyncio.current_task() is self._run_task:
            return
        # as long as callbacks go on being started: a window's calls are each bounded by
        # the budget, not the window (its thousands of events may take longer)
        budget = self.config.callback_time_budget_s + 1.0
        seen = -1
        while dispatcher.calls != seen:
            seen = dispatcher.calls
            try:
                async with asyncio.timeout(budget):
                    await running.wait()
                return
            except TimeoutError:
                continue
        log.warning(
            "close(): run() started no callback in %.0f s; closing under its window", budget
        )

    async def _release(self) -> None:
        """Stop the routing table's ZooKeeper session and close an HTTP session of ours."""
        if self._route is not None:
            await self._route.stop()
            self._route = None
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    def stop(self) -> None:
        """Ask a running :meth:`run` or iteration to end after the current window.

        Safe to call from any thread (a sync callback, a signal handler).
        """
        if self._group is not None:
            return self._group.stop()
        self._stop_requested = True
        if self._loop is not None and self._queue is not None:
            self._queue.close_threadsafe(self._loop)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # ---- state ----------------------------------------------------------

    @property
    def checkpoint(self) -> Checkpoint:
        """The position after the last window the application finished (groups: by unit)."""
        if self._group is not None:
            return self._group.checkpoint
        if self._position is None:
            raise RuntimeError("the consumer has not started")
        return self._position.current

    @property
    def committed(self) -> Checkpoint:
        """The last checkpoint handed to the persister (groups: accepted, by unit)."""
        if self._group is not None:
            return self._group.committed
        if self._position is None:
            raise RuntimeError("the consumer has not started")
        return self._position.committed

    @property
    def units(self) -> frozenset[Unit]:
        """The units this group member holds now (empty outside groups)."""
        return self._group.units if self._group is not None else frozenset()

    @property
    def partition(self) -> str | None:
        """The physical partition's name (learned from the relay when not configured)."""
        return self._fetcher.partition if self._fetcher is not None else self.config.partition

    def stats(self) -> dict[str, Any]:
        """Counters for monitoring (requests, failovers, queue, position).

        ``processed_scn`` is the SCN of the last window the application
        finished (-1: none, or bootstrapping); ``relay_head_scn`` is the relay's newest SCN as its last answer
        said; ``bootstrap_rows``, ``bootstrap_scn`` and
        ``bootstrap_target_scn`` the current (or last) bootstrap's snapshot
        rows, catch-up SCN and target (what ``--progress`` shows).

        In a group: ``member_id``, ``units`` (held), ``lanes``,
        ``rebalances``, ``fenced_commits`` and ``units_lost`` too (the relay
        counters summed over the lanes).
        """
        if self._group is not None:
            return self._group.stats()
        f, q, p = self._fetcher, self._queue, self._position
        s = f.stream if f else None
        rows, boot_scn, target = f.bootstrap_progress() if f else (0, -1, -1)
        name = self.partition
        done = p.current.get(name) if p is not None and name is not None else None
        return {
            "relay": s.relay if s else None,
            "relays": list(s.relays) if s else list(self.config.relays),
            "requests": s.requests if s else 0,
            "failovers": s.failovers if s else 0,
            "windows_fetched": s.windows if s else 0,
            "fetch_position": s.position if s else -1,
            "queued_windows": len(q) if q else 0,
            "queued_bytes": q.nbytes if q else 0,
            "queue_full_waits": q.waits if q else 0,
            "checkpoints_persisted": p.persisted if p else 0,
            "schema_fetches": self.cache.fetches,
            "phase": f.phase if f else "online",
            "bootstraps": f.bootstraps if f else 0,
            "processed_scn": done.window_scn
            if done is not None and done.mode is Mode.ONLINE
            else -1,
            "relay_head_scn": s.head_scn if s else -1,
            "bootstrap_rows": rows,
            "bootstrap_scn": boot_scn,
            "bootstrap_target_scn": target,
        }

    # ---- iterator API ---------------------------------------------------

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Window:
        """The next window; commits the previous one first when ``auto_commit``."""
        if self._group is not None:
            return await self._group.anext()
        if self._mode == "callbacks":
            raise RuntimeError("this consumer is running callbacks")
        self._mode = "iterator"
        if self._failed is not None:
            raise self._failed
        if self._closed:
            raise StopAsyncIteration
        await self.start()
        if self._closed_meanwhile():
            raise StopAsyncIteration
        assert self._queue is not None
        assert self._position is not None
        if self.config.auto_commit and self._uncommitted is not None:
            await self.commit()
        if self._range_ended:
            raise StopAsyncIteration
        while True:
            if not len(self._queue) and self._uncommitted is None and self._position.dirty:
                await self._position.persist()  # idle: store what empty windows advanced
            window, ended = await self._take()
            if window.is_empty and not self.config.yield_empty_windows:
                if self._uncommitted is None:
                    self._position.advance(window)
                else:
                    self._uncommitted = window  # committing the later one covers both
                if ended:
                    self._range_ended = True
                    raise StopAsyncIteration
                continue
            self._uncommitted = window
            self._range_ended = ended
            return window

    async def _take(self) -> tuple[Window, bool]:
        """The next window of the queue, and whether it ends a bounded read
        (``until_scn``: the fetcher stopped after it); raises at the end and at a
        reported data loss the consumer must not deliver."""
        assert self._queue is not None
        try:
            window = await self._queue.get()
        except QueueClosed:
            raise StopAsyncIteration from None
        except Exception as exc:
            self._failed = exc
            raise
        if window.data_loss is not None and self.config.on_data_loss == "raise":
            self._failed = DataLossDetectedError.reported_in(window)
            raise self._failed
        return window, self._ends_read(window)

    def _ends_read(self, window: Window) -> bool:
        """Whether ``window`` ends a bounded read (``until_scn``): a relay window or a
        bootstrap's catch-up window at or past it (a catch-up that reached the end
        waited for a relay window that might never come: found by review); never a
        snapshot page, whose SCN is the snapshot's."""
        until = self.config.until_scn
        return until is not None and window.phase != "snapshot" and window.scn >= until

    async def _next_unmarked(self) -> Window:
        """For batch iterators (:func:`changebus.client.spark.arrow_batches`): the next
        window, empty ones too, marked as yielded by nothing. Such an iterator reads
        ahead of what it hands out, so it marks the last window of each batch it
        hands out itself (:meth:`_handed_out`): :meth:`commit` must never cover a
        window whose rows sit in a batch not yet handed out (it did: found by
        review, a crash then lost them)."""
        if self._mode == "callbacks" or self._group is not None:
            raise RuntimeError("batches need a consumer of one partition, not running callbacks")
        self._mode = "iterator"
        if self._failed is not None:
            raise self._failed
        if self._closed or self._range_ended:
            raise StopAsyncIteration
        await self.start()
        window, self._range_ended = await self._take()
        return window

    def _handed_out(self, last: Window) -> None:
        """A batch iterator handed out the windows up to ``last``: :meth:`commit` covers
        them (and those of earlier batches)."""
        self._uncommitted = last

    async def commit(self) -> None:
        """Persist the position after the last window yielded (and the empty ones after it).

        In a group: the positions of every unit's last window yielded, written
        to the unit store at once.
        """
        if self._group is not None:
            return await self._group.commit()
        if self._position is None:
            return
        if self._uncommitted is not None:
            self._position.advance(self._uncommitted)
            self._uncommitted = None
        await self._position.persist()

    # ---- callback API ---------------------------------------------------

    async def run(self, callbacks: Callbacks | AsyncCallbacks) -> None:
        """Dispatch windows to ``callbacks`` until :meth:`stop`/:meth:`close` or an error.

        Raises :class:`~changebus.client.ConsumerAbortedError` when a callback
        fails unrecoverably, :class:`~changebus.client.DataLossDetectedError`
        when ``on_data_loss`` does not accept a gap, and the fetcher's terminal
        errors (:class:`~changebus.client.FellOffRelayError`, ...), each after
        ``on_error``. In a group, ``callbacks`` may define the rebalance
        methods too (``on_assigned``, ``on_revoked``, ``on_lost``).
        """
        if self._group is not None:
            return await self._group.run(callbacks)
        if self.config.columnar:
            # (callbacks and replicas are handed decoded events: none came, and the
            # checkpoint moved past every row; review)
            raise ConfigError(
                "a columnar consumer is read as an iterator (async for), not run(callbacks)"
            )
        if self._mode:
            raise RuntimeError(f"this consumer is already used in {self._mode} mode")
        self._mode = "callbacks"
        await self.start()
        if self._closed_meanwhile():  # (nothing to dispatch)
            return
        assert self._queue is not None
        assert self._position is not None
        queue = self._queue
        ended = False

        async def next_window() -> Window:
            # a bounded read (until_scn) ends once its last window was dispatched
            nonlocal ended
            if ended:
                raise QueueClosed
            window = await queue.get()
            ended = self._ends_read(window)
            return window

        dispatcher = Dispatcher(callbacks, self.config, self._position, next_window)
        self._dispatcher = dispatcher
        self._run_ended = asyncio.Event()
        self._run_task = asyncio.current_task()
        try:
            await dispatcher.run()
        except QueueClosed:
            return
        except Exception as exc:
            self._failed = exc
            raise
        finally:
            self._run_ended.set()
