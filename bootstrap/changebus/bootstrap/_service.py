"""The bootstrap server's moving parts: producer and applier per partition, store threads.

Structure::

    relay --HTTP--> producer (RelayStream, raw windows) --asyncio.Queue--> log writer
                                                                               |
                     applier (log -> snapshot) <---- wake-up ------------------+
    HTTP handlers --> reader threads (own store connections) --> pages

Threads. Store calls block (SQLite, psycopg), so none runs on the event
loop: every write (log appends, applier transactions, schema rows) runs in
one *writer* thread that owns the writer :class:`~._store.Store`; reads for
HTTP pages run in a small pool of *reader* threads, each with its own
connection (SQLite in WAL mode and Postgres both let readers run beside the
writer). The queue between the producer and the log writer is bounded
(``producer.batch_windows`` x 2): a slow store slows reading from the
relay, it never grows memory.

Crash safety comes from the store: a batch of windows and the producer SCN
commit together, and the applier moves the snapshot and its position in one
transaction. On restart the producer resumes after the log's newest window
(the relay skips what came before) and the applier after its last one, so a
``kill -9`` anywhere loses or doubles nothing.

Lost windows (the producer fell off the relay, or the relay sent a DATA_LOSS
window) record a gap in the store (:mod:`._gaps`): positions before it are
refused until every table is seeded again, which starts by itself with
``seed.dsn`` (also at start-up); ``/v1/status`` and the log say how.

In a relay cluster (``[cluster]``) the service holds a
:class:`~._member.ClusterMember`: without configured ``relays`` the
producers read the relays the routing table lists for their partition and
are moved (:meth:`~changebus.client.RelayStream.set_relays`) when the table
changes; every ``_PUBLISH_S`` the applier and producer SCNs of each
partition are published in the server's member node.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import aiohttp

from changebus.client import (
    FellOffRelayError,
    RawWindow,
    RelayInfo,
    RelayQueries,
    RelaySchemas,
    RelayStream,
    StreamConfig,
    open_session,
    safe_url,
)
from changebus.schemas import (
    FIRST_CONTROL_OP,
    BadRequestError,
    ChangebusError,
    DataLoss,
    NotYetError,
    SourceConfigError,
    TableSchema,
    UnknownSourceError,
)
from changebus.schemas.config import scrub, scrub_exception, secret_values

from ._config import BootstrapConfig
from ._lost import DATA_LOSS_OP, Gap, loss_in, loss_reason, repair_hint
from ._member import ClusterMember
from ._seeders import seeder_for
from ._seedtypes import SeedProgress, SeedRequest, table_name_problem
from ._store import PartitionState, Store

__all__ = ["BootstrapService", "PartitionWorker"]

log = logging.getLogger("changebus.bootstrap")

T = TypeVar("T")

#: per JSON question to a relay (status, sources, schemas)
_INFO_TIMEOUT = aiohttp.ClientTimeout(total=10)

#: how often the partitions' SCNs are published in a cluster (ZooKeeper writes are throttled)
_PUBLISH_S = 0.5


def open_store(config: BootstrapConfig) -> Store:
    """A new connection to the configured store (tables created when missing)."""
    if config.store.kind == "postgres":
        return Store.postgres(config.store.dsn)
    return Store.sqlite(config.sqlite_path)


class _StoreThreads:
    """The writer thread and the reader pool, each thread with its own :class:`Store`."""

    def __init__(self, config: BootstrapConfig, readers: int = 2) -> None:
        self._config = config
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="bootstrap-writer")
        self._readers = ThreadPoolExecutor(readers, thread_name_prefix="bootstrap-reader")
        self._local = threading.local()
        self._opened: list[Store] = []
        self._lock = threading.Lock()

    def _store(self) -> Store:
        store: Store | None = getattr(self._local, "store", None)
        if store is None:
            store = open_store(self._config)
            self._local.store = store
            with self._lock:
                self._opened.append(store)
        return store

    async def write(self, fn: Callable[[Store], T]) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._writer, lambda: fn(self._store()))

    async def read(self, fn: Callable[[Store], T]) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._readers, lambda: fn(self._store()))

    def close(self) -> None:
        self._writer.shutdown(wait=True, cancel_futures=True)
        self._readers.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            for store in self._opened:
                with contextlib.suppress(Exception):
                    store.close()
            self._opened.clear()


@dataclass
class PartitionWorker:
    """Producer and applier of one partition, and their figures (event loop only)."""

    name: str
    state: str = "starting"
    producer_scn: int = -1
    applier_scn: int = -1
    log_min_scn: int = -1
    base_scn: int = -1
    lag_events: int = 0
    windows_appended: int = 0
    events_appended: int = 0
    events_applied: int = 0
    fell_off: int = 0
    #: DATA_LOSS windows received from the relay
    data_loss: int = 0
    last_error: str = ""
    #: a gap in the log not repaired yet: positions before it are refused
    gap: Gap | None = None
    last_window_ts_ns: int = 0
    applied_at: float = field(default_factory=time.monotonic)
    seed: SeedProgress = field(default_factory=SeedProgress)
    seeding: asyncio.Task[None] | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def status(self) -> dict[str, Any]:
        return {
            "partition": self.name,
            "state": self.state,
            "producer_scn": self.producer_scn,
            "applier_scn": self.applier_scn,
            "log_min_scn": self.log_min_scn,
            "base_scn": self.base_scn,
            "applier_lag_events": self.lag_events,
            "windows_appended": self.windows_appended,
            "events_appended": self.events_appended,
            "events_applied": self.events_applied,
            "fell_off": self.fell_off,
            "data_loss": self.data_loss,
            "last_error": self.last_error,
            "gap": self.gap.as_dict() if self.gap is not None else None,
            "seed": self.seed.as_dict(),
        }


class BootstrapService:
    """Producers and appliers of every partition, over one store (module docstring)."""

    def __init__(self, config: BootstrapConfig) -> None:
        self.config = config
        #: what error texts must never show (store and seed DSNs, their passwords)
        self.secrets = secret_values(config)
        self.stores = _StoreThreads(config)
        self.workers: dict[str, PartitionWorker] = {}
        self._session: aiohttp.ClientSession | None = None
        self._stop_seed = threading.Event()
        #: membership of a relay cluster (``[cluster]``), from :meth:`start` on
        self.member: ClusterMember | None = None
        self._publisher: asyncio.Task[None] | None = None

    async def start(self) -> None:
        cfg = self.config
        await self.stores.write(lambda s: None)  # open the writer store (creates tables)
        self._session = await open_session(cfg.upstream)
        if cfg.cluster is not None:
            self.member = ClusterMember(cfg.cluster, static=cfg.relays)
            await self.member.start()
            self._publisher = asyncio.create_task(self._publish(), name="cluster-publisher")
        names = list(cfg.partitions) or await self._relay_partitions()
        for name in names:
            w = PartitionWorker(name)
            st = await self.stores.write(lambda s, n=name: s.state(n))  # type: ignore[misc]
            w.producer_scn, w.applier_scn = st.producer_scn, st.applier_scn
            w.log_min_scn, w.base_scn = st.log_min_scn, st.base_scn
            w.lag_events = await self.stores.write(
                lambda s, n=name: s.unapplied_events(n)  # type: ignore[misc]
            )
            gap = await self.stores.write(lambda s, n=name: s.gap(n))  # type: ignore[misc]
            if gap is not None:
                hint = repair_hint(name, seed_source=bool(cfg.seed.dsn))
                w.gap = Gap(gap, "recorded before this server restarted", hint)
            self.workers[name] = w
            w.tasks.append(asyncio.create_task(self._produce(w), name=f"producer-{name}"))
            w.tasks.append(asyncio.create_task(self._apply(w), name=f"applier-{name}"))
        if cfg.seed.on_start:
            self.start_seed(self._seed_partition(), list(cfg.seed.tables), again=False)
        for w in self.workers.values():
            if w.gap is not None:  # still open from before: repair it now (or say how)
                log.error(
                    "partition %s: the snapshot misses changes up to SCN %d (a gap recorded "
                    "before this restart); %s",
                    w.name,
                    w.gap.before_scn,
                    w.gap.repair,
                )
                if cfg.seed.dsn and (w.seeding is None or w.seeding.done()):
                    self.start_seed(w.name, [], again=False)
        log.info(
            "bootstrap serving partitions %s from %s",
            ", ".join(self.workers) or "(none)",
            ", ".join(safe_url(u) for u in self._relay_urls()) or "(the routing table)",
        )

    async def stop(self) -> None:
        self._stop_seed.set()
        for w in self.workers.values():
            if w.seeding is not None:
                w.tasks.append(w.seeding)
            for t in w.tasks:
                t.cancel()
        for w in self.workers.values():
            for t in w.tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
        if self._publisher is not None:
            self._publisher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._publisher
            self._publisher = None
        if self.member is not None:
            await self.member.stop()
            self.member = None
        if self._session is not None:
            await self._session.close()
            self._session = None
        await asyncio.get_running_loop().run_in_executor(None, self.stores.close)

    @property
    def ready(self) -> bool:
        return bool(self.workers) and all(w.state == "streaming" for w in self.workers.values())

    def _relay_urls(self, partition: str | None = None) -> tuple[str, ...]:
        """The relays now: the routing table's (then the configured ones) in a cluster."""
        if self.member is None:
            return self.config.relays
        return self.member.relays(partition)

    def _relays(self, *, max_attempts: int | None = None) -> RelayQueries:
        """The relays, asked in order (each once unless ``max_attempts``)."""
        assert self._session is not None
        return RelayQueries(
            self._session,
            self._relay_urls(),
            timeout=_INFO_TIMEOUT,
            max_attempts=max_attempts,
            backoff_initial_s=0.2,
            backoff_max_s=2.0,
        )

    async def _relay_partitions(self) -> list[str]:
        """The partitions of the first relay that answers; waits for one (with backoff)."""
        if self.member is not None:
            await self.member.wait_relays()
        log.info(
            "no partitions configured: asking the relays (%s) for theirs, waiting for one to answer",
            ", ".join(safe_url(u) for u in self._relay_urls()),
        )
        return list(await self._relays(max_attempts=0).first(RelayInfo.sources))

    # ---- producer -------------------------------------------------------

    async def _produce(self, w: PartitionWorker) -> None:
        cfg = self.config
        assert self._session is not None
        sink: asyncio.Queue[tuple[RawWindow, str]] = asyncio.Queue(cfg.producer.batch_windows * 2)
        relays = cfg.relays
        current: list[RelayStream] = []
        if self.member is not None:
            relays = await self.member.wait_relays(w.name)

            def moved(urls: tuple[str, ...]) -> None:
                if current:
                    current[0].set_relays(urls)

            self.member.follow(w.name, moved)
        stream_cfg = StreamConfig(
            relays=relays,
            partition=w.name,
            follow=True,
            wait_s=cfg.producer.wait_s,
            max_bytes=cfg.producer.max_bytes,
            follow_bytes=1 << 40,
            client_id=f"bootstrap-producer-{w.name}",
        )

        async def put(raw: RawWindow, relay: str) -> None:
            await sink.put((raw, relay))

        writer = asyncio.create_task(self._write_log(w, sink), name=f"log-writer-{w.name}")
        try:
            while True:
                # a fresh reader after the newest window in the log
                if self.member is not None:  # the table's relays now
                    stream_cfg = replace(
                        stream_cfg, relays=self.member.relays(w.name) or stream_cfg.relays
                    )
                stream = RelayStream(stream_cfg, self._session, position=w.producer_scn)
                current[:] = [stream]
                w.state = "streaming"
                try:
                    await stream.run(put)
                except FellOffRelayError as exc:
                    # the relay dropped windows this log never got: the log has a gap
                    w.state = "fell_off"
                    w.fell_off += 1
                    w.last_error = scrub(exc.message, self.secrets)
                    log.error(
                        "partition %s: the producer fell off the relay: %s", w.name, w.last_error
                    )
                    if cfg.seed.dsn:
                        await sink.join()
                        await self._repair_gap(w, stream.relay)
                        continue
                except ChangebusError as exc:
                    w.state = "error"
                    w.last_error = scrub(exc.message, self.secrets)
                    log.error("partition %s: producer stopped: %s", w.name, w.last_error)
                await asyncio.sleep(cfg.producer.fell_off_retry_s)
                # resume after what was written (the sink may still be draining)
                await sink.join()
        finally:
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await writer

    async def _write_log(
        self, w: PartitionWorker, sink: asyncio.Queue[tuple[RawWindow, str]]
    ) -> None:
        known: set[tuple[int, int]] = {
            (sid, v) for sid, v, _n, _j in await self.stores.write(lambda s: s.schemas(w.name))
        }
        start_scn: int | None = None
        while True:
            batch = [await sink.get()]
            while len(batch) < self.config.producer.batch_windows and not sink.empty():
                batch.append(sink.get_nowait())
            wanted: set[tuple[int, int]] = set()
            losses: list[tuple[int, DataLoss]] = []
            for raw, _url in batch:
                ops = raw.headers["op"]
                h = raw.headers[ops < FIRST_CONTROL_OP]
                wanted.update(
                    zip(h["source_id"].tolist(), h["schema_version"].tolist(), strict=True)
                )
                if (ops == DATA_LOSS_OP).any():
                    losses.append((raw.scn, loss_in(raw)))
            if not wanted <= known:
                known |= await self._sync_schemas(w, batch[-1][1])
            if start_scn is None and w.producer_scn < 0:
                start_scn = await self._relay_prev_scn(w, batch[0][1])
            data = b"".join(raw.body for raw, _ in batch)
            events = sum(len(raw.offsets) for raw, _ in batch)
            first = start_scn if start_scn is not None else -1
            # the gap a DATA_LOSS window opens ends at that window (the last one's)
            lost_upto = max(scn for scn, _l in losses) if losses else None

            def append(
                s: Store, d: bytes = data, f: int = first, lost: int | None = lost_upto
            ) -> int:
                return s.append(w.name, d, start_scn=f, lost_upto=lost)

            before = w.producer_scn
            await self.stores.write(append)
            if lost_upto is not None and lost_upto > before:
                w.data_loss += len(losses)
                self._gap_recorded(w, lost_upto, loss_reason(losses))
            st = await self.stores.write(lambda s: s.state(w.name))
            w.producer_scn, w.log_min_scn, w.base_scn = st.producer_scn, st.log_min_scn, st.base_scn
            w.windows_appended += len(batch)
            w.events_appended += events
            w.lag_events += events
            w.last_window_ts_ns = batch[-1][0].timestamp_ns
            w.wake.set()
            for _ in batch:
                sink.task_done()

    async def _relay_prev_scn(self, w: PartitionWorker, url: str) -> int:
        """The relay's "complete after" SCN: the log's history starts there."""
        assert self._session is not None
        status = await RelayInfo(self._session, url, timeout=_INFO_TIMEOUT).status()
        part = status.get(w.name)
        return part.prev_scn if part is not None else -1

    async def _sync_schemas(self, w: PartitionWorker, url: str) -> set[tuple[int, int]]:
        """Copy the relay's table schemas of the partition into the store."""
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=30)
        source = RelaySchemas(self._session, url, w.name, timeout)
        names = await source.source_names()
        entries: list[tuple[int, int, str, str]] = []
        for name in sorted(set(names.values())):
            for sid, schema in await source.source_schemas(name):
                entries.append((sid, schema.version, schema.name, json.dumps(schema.to_json())))
        await self.stores.write(lambda s: s.put_schemas(w.name, entries))
        log.info("partition %s: %d schema versions copied from the relay", w.name, len(entries))
        return {(sid, v) for sid, v, _n, _j in entries}

    async def _publish(self) -> None:
        """Publish each partition's applier and producer SCNs in the member node."""
        assert self.member is not None
        while True:
            self.member.publish(
                {n: (w.applier_scn, w.producer_scn) for n, w in self.workers.items()}
            )
            await asyncio.sleep(_PUBLISH_S)

    # ---- applier ---------------------------------------------------------

    async def _apply(self, w: PartitionWorker) -> None:
        batch = self.config.applier.batch_events
        while True:
            before = w.applier_scn

            def step(
                s: Store, before: int = before, keep: int = self.config.applier.log_keep_events
            ) -> tuple[PartitionState, int, int]:
                done = s.applied_events
                st = s.apply(w.name, batch)
                if keep and st.applier_scn != before:
                    s.prune_to(w.name, keep)
                    st = s.state(w.name)
                return st, s.applied_events - done, s.unapplied_events(w.name)

            st, applied, left = await self.stores.write(step)
            if st.applier_scn != before:
                w.events_applied += applied
                w.lag_events = left
                w.applier_scn, w.log_min_scn = st.applier_scn, st.log_min_scn
                w.applied_at = time.monotonic()
                continue
            w.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(w.wake.wait(), self.config.applier.idle_s)

    async def _repair_gap(self, w: PartitionWorker, relay: str) -> None:
        """Jump over the windows the relay evicted and seed the snapshot again."""
        gap_end = await self._relay_prev_scn(w, relay)
        st = await self.stores.write(lambda s: s.mark_gap(w.name, gap_end))
        w.producer_scn, w.log_min_scn = st.producer_scn, st.log_min_scn
        self._gap_recorded(
            w,
            gap_end,
            f"the producer fell off the relay: windows up to SCN {gap_end} were evicted "
            "there before this server read them",
        )

    def _gap_recorded(self, w: PartitionWorker, gap_end: int, reason: str) -> None:
        """A gap ending at ``gap_end`` is in the store: say so, and seed again when possible.

        A seed running is restarted: it may have copied tables before the
        gap was recorded (and every table must be copied after it).
        """
        w.gap = Gap(gap_end, reason, repair_hint(w.name, seed_source=bool(self.config.seed.dsn)))
        w.last_error = reason
        log.error(
            "partition %s: %s; the snapshot misses the changes lost there, so positions "
            "before SCN %d are refused (no silent catch-up across the gap) and the producer "
            "goes on after it; %s",
            w.name,
            reason,
            gap_end,
            w.gap.repair,
        )
        if not self.config.seed.dsn:
            return
        old = w.seeding
        if old is not None and not old.done():
            old.cancel()
        w.seed = SeedProgress(state="starting")
        w.seeding = asyncio.create_task(self._reseed(w, old), name=f"seed-{w.name}")

    async def _reseed(self, w: PartitionWorker, old: asyncio.Task[None] | None) -> None:
        """Seed every table of ``w`` again, after ``old`` (cancelled) has ended."""
        if old is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await old
            w.seed = SeedProgress(state="starting")  # the old one's end set it
        await self._seed(w, [], True)

    # ---- seeding -------------------------------------------------------------

    def _seed_partition(self) -> str:
        name = self.config.seed.partition
        if name:
            if name not in self.workers:
                raise UnknownSourceError(f"seed.partition {name!r} is not served here")
            return name
        if len(self.workers) != 1:
            raise BadRequestError("name the partition to seed (seed.partition)")
        return next(iter(self.workers))

    async def seed_on_demand(self, part: str, tables: list[str]) -> SeedProgress:
        """``POST /v1/seed``: check ``tables`` (400 naming a bad one), then re-seed them."""
        await self.check_seed_tables(part, tables)
        return self.start_seed(part, tables, again=True)

    async def check_seed_tables(self, part: str, tables: list[str]) -> None:
        """Raise 400 for a reserved or malformed table name, or one the partition lacks.

        Known tables: those whose schemas the store holds, else those the
        relays list for ``part`` (a table the relay knew before this server
        copied its schema). No relay answering: 503, retriable.
        """
        for table in tables:
            problem = table_name_problem(table)
            if problem is not None:
                raise BadRequestError(problem)
        rows = await self.stores.read(lambda s: s.schemas(part))
        unknown = sorted(set(tables) - {n for _s, _v, n, _j in rows})
        if not unknown:
            return

        async def names(info: RelayInfo) -> set[str] | None:
            found = (await info.sources()).get(part)
            return {s.name for s in found.sources} if found is not None else None

        try:
            relay_names = await self._relays().search(names)
        except ChangebusError as exc:
            raise NotYetError(f"cannot check the tables with a relay: {exc.message}") from None
        if relay_names is None:
            raise NotYetError(f"no relay lists partition {part} yet; retry soon")
        unknown = sorted(set(unknown) - relay_names)
        if unknown:
            shown = ", ".join(repr(t[:80]) for t in unknown[:10])
            raise BadRequestError(
                f"partition {part} has no table(s) {shown} (tables are schema.table names "
                "the relay has seen a change of)"
            )

    def start_seed(self, part: str, tables: list[str], *, again: bool) -> SeedProgress:
        """Start seeding ``tables`` of ``part`` (all known sources when empty) in the background.

        ``again``: copy them even when seeded before (re-seed on demand).
        """
        if not self.config.seed.dsn:
            raise BadRequestError("no source to seed from: set seed.dsn")
        w = self.workers[part]
        if w.seeding is not None and not w.seeding.done():
            raise BadRequestError(f"partition {part} is being seeded already")
        w.seed = SeedProgress(state="starting")
        w.seeding = asyncio.create_task(self._seed(w, tables, again), name=f"seed-{part}")
        return w.seed

    async def _seed(self, w: PartitionWorker, tables: list[str], again: bool) -> None:
        cfg = self.config
        try:
            await self._wait_for_schemas(w, tables)
            rows = await self.stores.write(lambda s: s.schemas(w.name))
            schemas = [(sid, TableSchema.from_json(json.loads(j))) for sid, _v, _n, j in rows]
            names = tables or sorted({n for _s, _v, n, _j in rows})
            if again:
                await self.stores.write(lambda s: s.forget_seed(w.name, names))
            done = set(await self.stores.write(lambda s: s.seeded(w.name)))
            part_id = await self._relay_partition_id(w.name)
            loop = asyncio.get_running_loop()

            def write(table: str, events: list[bytes], scn: int) -> None:
                # from the seeder's thread: hand over to the writer thread and wait
                asyncio.run_coroutine_threadsafe(
                    self.stores.write(lambda s: s.seed_rows(w.name, table, events, scn)), loop
                ).result()

            request = SeedRequest(
                cfg.seed.dsn,
                part_id,
                tuple(names),
                schemas=tuple(schemas),
                done=frozenset(done),
                chunk_rows=cfg.seed.chunk_rows,
                relay_fetcher=await self._relay_fetcher(w.name),
                column_policy=cfg.seed.column_rules(),
            )
            await asyncio.to_thread(
                seeder_for(cfg.seed.kind), request, write, w.seed, stop=self._stop_seed
            )
            if await self.stores.write(lambda s: s.clear_gap(w.name)):
                log.info(
                    "partition %s: the gap in the log is repaired: the snapshot is complete again",
                    w.name,
                )
                w.gap = None
            w.seed.state = "done"  # only now: "done" promises the gap is repaired too
            log.info("partition %s seeded at SCN %d: %d rows", w.name, w.seed.scn, w.seed.rows)
        except asyncio.CancelledError:
            w.seed.state = "stopped"
            raise
        except Exception as exc:  # noqa: BLE001 - reported in /v1/status, the daemon goes on
            w.seed.state = "failed"
            w.seed.error = (
                scrub(exc.message, self.secrets)
                if isinstance(exc, ChangebusError)
                else scrub_exception(exc, self.secrets)
            )
            log.error("partition %s: seeding failed: %s", w.name, w.seed.error)
            if not isinstance(exc, ChangebusError):  # a bug: its traceback, scrubbed
                log.debug("%s", scrub_exception(exc, self.secrets, trace=True))

    async def _wait_for_schemas(self, w: PartitionWorker, tables: list[str]) -> None:
        """Until the store knows the schemas of ``tables`` (any, when empty) from the relay.

        Raises :class:`SourceConfigError` naming what is missing after
        ``seed.schema_wait_s``: a seed never goes on without them.
        """
        deadline = time.monotonic() + self.config.seed.schema_wait_s
        while True:
            rows = await self.stores.write(lambda s: s.schemas(w.name))
            names = {n for _s, _v, n, _j in rows}
            if (set(tables) <= names) if tables else names:
                return
            if time.monotonic() >= deadline:
                missing = sorted(set(tables) - names) if tables else []
                what = (
                    f"the schemas of {', '.join(repr(t[:80]) for t in missing[:10])}"
                    if missing
                    else "any table schema"
                )
                raise SourceConfigError(
                    f"partition {w.name}: gave up after {self.config.seed.schema_wait_s:g}s "
                    f"waiting for {what} from the relay (it has not seen a change of them); "
                    "nothing was seeded"
                )
            await asyncio.sleep(0.1)

    async def _relay_fetcher(self, name: str) -> dict[str, Any] | None:
        """The fetcher status of partition ``name`` on the first relay that reports one."""

        async def fetcher(info: RelayInfo) -> dict[str, Any] | None:
            part = (await info.status()).get(name)
            return dict(part.fetcher) if part is not None and part.fetcher is not None else None

        return await self._relays().search(fetcher)

    async def _relay_partition_id(self, name: str) -> int:
        """The id of partition ``name`` on the first relay that names it."""

        async def partition_id(info: RelayInfo) -> int | None:
            part = (await info.sources()).get(name)
            return part.id if part is not None else None

        found = await self._relays().search(partition_id)
        if found is None:
            raise UnknownSourceError(f"no relay names partition {name!r}", retriable=True)
        return found
