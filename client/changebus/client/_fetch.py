"""The consumer's fetcher task: relay stream -> decode -> the consumer's queue.

One :class:`RelayFetcher` per consumer runs as an asyncio task::

    RelayStream (HTTP, validation, failover) --RawWindow--> decode --> WindowQueue
         ^                                                                 ^
         +-- 410 everywhere: Bootstrapper (snapshot + catch-up) -----------+

It composes the low-level :class:`~._stream.RelayStream` (which owns the
fetch position and the failover) with a decoding sink: each raw window is
decoded (:mod:`._decode`, schemas fetched from the relay it came from) and
put into the bounded :class:`~._queue.WindowQueue`, waiting while it is full
(flow control). The stream's position moves past a window once it is queued.

When every relay answers that the position is gone (410), the fetcher
either runs a bootstrap (``bootstrap_servers``: :class:`~._bootstrap.Bootstrapper`
queues the snapshot and catch-up windows and returns the SCN to continue
after), jumps to the newest windows (``on_fell_off = "latest"``), or ends
with :class:`~._errors.FellOffRelayError`. A consumer that starts from
nothing with bootstrap servers, or resumes a bootstrap from its checkpoint,
bootstraps first. A terminal error is queued behind the windows already
fetched.

Runs on the consumer's event loop; not thread-safe.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import aiohttp

from changebus.schemas import CheckpointError, Mode, PartitionCheckpoint

from ._assembler import RawWindow
from ._backoff import Backoff
from ._bootstrap import Bootstrapper
from ._config import ConsumerConfig
from ._decode import SchemaCache, decode_window
from ._errors import FellOffRelayError
from ._info import RelaySchemas
from ._queue import QueueClosed, WindowSink
from ._stream import RelayStream, StreamConfig

__all__ = ["RelayFetcher", "start_point"]

log = logging.getLogger(__name__)


def start_point(
    stored: PartitionCheckpoint | None, config: ConsumerConfig, what: str
) -> tuple[int, bool, PartitionCheckpoint | None]:
    """Where a fetcher starts: ``(position, latest, resume)`` for its constructor.

    ``stored`` is the stored checkpoint of what it reads (``what`` names it in
    errors: a partition, a lane's units). A checkpoint in a bootstrap mode is
    resumed (it needs ``bootstrap_servers``), an online one continues after
    its last whole window (a partial window is read again whole); without
    one, ``config.start`` decides.
    """
    if stored is not None and stored.mode is not Mode.ONLINE:
        if not config.bootstrap_servers:
            raise CheckpointError(
                f"the checkpoint of {what} is in {stored.mode.value} mode;"
                " configure bootstrap_servers to continue it"
            )
        return stored.window_scn, False, stored
    if stored is not None and stored.has_position:
        return stored.rollback().window_scn, False, None
    start_scn = config.start_scn
    return (-1 if start_scn is None else start_scn), config.start == "latest", None


class RelayFetcher:
    """Fills a :class:`~._queue.WindowSink` from the relays (module docstring).

    The sink is the consumer's :class:`~._queue.WindowQueue`, or a group
    lane's splitting sink (:mod:`._group_lane`).

    ``resume`` is the stored checkpoint entry of the partition when it is in
    a bootstrap mode (the bootstrap then continues first).
    """

    def __init__(
        self,
        config: ConsumerConfig,
        session: aiohttp.ClientSession,
        queue: WindowSink,
        cache: SchemaCache,
        *,
        position: int,
        latest: bool,
        partition: str | None,
        resume: PartitionCheckpoint | None = None,
    ) -> None:
        self.config = config
        self.stream = RelayStream(
            StreamConfig.of(config, partition), session, position=position, latest=latest
        )
        self._session = session
        self._queue = queue
        self._cache = cache
        self._latest = latest
        self._resume = resume
        self._schemas: RelaySchemas | None = None
        self._boot: Bootstrapper | None = None
        if config.bootstrap_servers:
            self._boot = Bootstrapper(config, session, queue, cache)
        #: relay windows delivered since the last bootstrap (-1: none ran)
        self._since_bootstrap = -1
        #: the pause before bootstrapping again when the relays evicted the last
        #: bootstrap's target before a window came (a bootstrap server behind them)
        self._fell_off_backoff = Backoff(
            config.backoff_initial_s, config.backoff_max_s, config.backoff_multiplier
        )

    @property
    def partition(self) -> str | None:
        return self.stream.partition

    def set_relays(self, relays: tuple[str, ...]) -> None:
        """Read from ``relays`` from now on (see :meth:`.RelayStream.set_relays`)."""
        self.stream.set_relays(relays)

    def set_bootstrap_servers(self, servers: tuple[str, ...]) -> None:
        """Use ``servers`` for bootstraps from now on (see :meth:`.Failover.set_urls`).

        A fetcher that had none (a cluster listed no bootstrap server when it
        started) gets its :class:`~._bootstrap.Bootstrapper` now: a later fall
        off the relays bootstraps instead of raising.
        """
        if self._boot is not None:
            self._boot.set_servers(servers)
        elif servers:
            config = dataclasses.replace(self.config, bootstrap_servers=servers)
            self._boot = Bootstrapper(config, self._session, self._queue, self._cache)

    @property
    def phase(self) -> str:
        """``online``, or the bootstrap phase (``snapshot``, ``catchup``)."""
        return self._boot.phase if self._boot is not None else "online"

    @property
    def bootstraps(self) -> int:
        """How many bootstraps this fetcher ran."""
        return self._boot.bootstraps if self._boot is not None else 0

    def bootstrap_progress(self) -> tuple[int, int, int]:
        """The current (or last) bootstrap's ``(snapshot rows, catch-up SCN, target SCN)``."""
        boot = self._boot
        return (boot.rows, boot.catchup_scn, boot.target_scn) if boot is not None else (0, -1, -1)

    async def run(self) -> None:
        """Fetch until cancelled; a terminal error goes into the queue."""
        try:
            await self._fetch()
        except (asyncio.CancelledError, QueueClosed):
            raise
        except Exception as exc:  # noqa: BLE001 - every terminal error reaches the consumer
            log.debug("fetcher ends: %r", exc)
            await self._queue.fail(exc)

    async def _fetch(self) -> None:
        cfg = self.config
        resume, self._resume = self._resume, None
        if resume is not None and resume.mode is not Mode.ONLINE:
            assert resume.bootstrap is not None
            await self._bootstrap(resume.bootstrap.since_scn, resume)
        elif self.stream.position < 0 and not self._latest and self._boot is not None:
            await self._bootstrap(-1, None)
        while True:
            try:
                await self.stream.run(self._deliver)
                return
            except FellOffRelayError as exc:
                if self._boot is not None:
                    if self._since_bootstrap == 0:
                        # the relays evicted the bootstrap's target before a window came:
                        # the bootstrap server lags them; asking again at once would loop
                        delay = self._fell_off_backoff.next_delay()
                        log.warning(
                            "%s, right after a bootstrap that ended there: the bootstrap"
                            " server's log ends before the relays' oldest window; bootstrapping"
                            " again in %.1f s",
                            exc.message,
                            delay,
                        )
                        await asyncio.sleep(delay)
                    else:
                        log.warning("%s; bootstrapping", exc.message)
                    await self._bootstrap(self.stream.position, None)
                elif cfg.on_fell_off == "latest":
                    log.warning(
                        "%s; jumping to the newest SCN as configured (on_fell_off = latest):"
                        " the changes in between are skipped",
                        exc.message,
                    )
                    self.stream.seek_latest()
                else:
                    raise

    async def _bootstrap(self, since: int, resume: PartitionCheckpoint | None) -> None:
        assert self._boot is not None
        self._boot.partition = self.stream.partition
        target = await self._boot.run(since, resume)
        until = self.config.until_scn
        if until is not None and target >= until:
            # a bounded read the bootstrap completed: fetch nothing more; close() cancels
            await asyncio.Event().wait()
        self._since_bootstrap = 0
        self.stream.learn_partition(self._boot.partition)
        self.stream.seek(target)
        self._schemas = None
        self._cache.clear()  # back to the relays' source ids

    async def _deliver(self, raw: RawWindow, url: str) -> None:
        """The stream's sink: decode ``raw`` (schemas from ``url``) and queue it."""
        source = self._schemas
        if source is None or source.url != url:
            # source ids belong to one relay's registry: a new relay, a new cache
            if source is not None:
                self._cache.clear()
            source = self._schemas = RelaySchemas(
                self._session, url, self.stream.partition, self.stream.config.info_timeout
            )
        window = await decode_window(
            raw, self.stream.partition or "", self._cache, source, columnar=self.config.columnar
        )
        await self._queue.put(window, raw)
        if self._since_bootstrap == 0:
            self._fell_off_backoff.reset()
        self._since_bootstrap += 1
        until = self.config.until_scn
        if until is not None and raw.scn >= until:
            # a bounded read (until_scn) is complete: fetch nothing more; close() cancels
            await asyncio.Event().wait()
