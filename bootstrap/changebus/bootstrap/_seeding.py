"""Seeding orchestration: seeds on demand and at start-up, and re-seeds after a gap in the log.

:class:`Seeding` (a base of :class:`~._service.BootstrapService`) starts at
most one seed task per partition (:attr:`~._worker.PartitionWorker.seeding`):
``POST /v1/seed`` (:meth:`Seeding.seed_on_demand`, after
:meth:`Seeding.check_seed_tables`), ``POST /v1/snapshot`` (one table, or its
rows a ``where`` condition or a key list selects: a
:class:`~._chunks.SnapshotScope`), ``seed.on_start``, a gap, and at start-up
the chunked snapshots a stopped (or killed) server left in progress
(:meth:`Seeding.resume_snapshots`). The seed
itself runs in a thread (the source kind's :func:`~._seeders.seeder_for`),
handing each chunk of rows to the store's writer thread and waiting for it.

Lost windows (the producer fell off the relay, or the relay sent a DATA_LOSS
window) record a gap in the store (:mod:`._gaps`): positions before it are
refused until every table is seeded again, which starts by itself with
``seed.dsn`` (also at start-up) and is tried again, with backoff, after a
retriable failure while the gap is open; ``/v1/status`` and the log say how. A gap
recorded while a seed runs restarts it (the tables it copied before the gap
must be copied again). When a seed ends, before it reports ``done``, the
store clears the gap if every known table has been seeded since it.

Thread-safety: everything here runs on the event loop except the seeder,
which touches only its :class:`~._seedtypes.SeedProgress` and the store
through the writer thread; ``_stop_seed`` (a :class:`threading.Event`) asks
a running seeder to stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from changebus.client import RelayInfo
from changebus.schemas import (
    BadRequestError,
    ChangebusError,
    NotYetError,
    SourceConfigError,
    TableSchema,
    UnknownSourceError,
    ended,
)
from changebus.schemas.config import scrub, scrub_exception

from ._chunks import SnapshotScope, SnapshotSink
from ._lost import Gap, repair_hint
from ._seeders import Seeder, seeder_for
from ._seedtypes import SeedProgress, SeedRequest, SeedWriter, table_name_problem
from ._sink import StoreSink
from ._store import Store
from ._storethreads import StoreThreads
from ._upstream import Upstream
from ._worker import PartitionWorker

__all__ = ["Seeding"]

log = logging.getLogger("changebus.bootstrap")

#: first pause before a gap's failed (retriable) seed is tried again; doubles up to the max
_RESEED_RETRY_S = 1.0
_RESEED_RETRY_MAX_S = 30.0
#: how often a gap's re-seed looks whether the applier has passed the gap's start
_APPLIER_POLL_S = 0.2


class Seeding(Upstream):
    """Seed tasks of every partition and gap repair (module docstring); a base of the service."""

    #: what error texts must never show (store and seed DSNs, their passwords)
    secrets: tuple[str, ...]
    stores: StoreThreads
    workers: dict[str, PartitionWorker]
    partition_names: tuple[str, ...]
    _stop_seed: threading.Event

    def _failure(self, exc: BaseException) -> str:
        """``exc`` for ``last_error`` and the log, scrubbed of secrets; a bug (not a
        :class:`ChangebusError`) also leaves its scrubbed traceback at debug level."""
        if isinstance(exc, ChangebusError):
            return scrub(exc.message, self.secrets)
        log.debug("%s", scrub_exception(exc, self.secrets, trace=True))
        return scrub_exception(exc, self.secrets)

    # ---- gaps ------------------------------------------------------------------

    async def _repair_gap(self, w: PartitionWorker, relay: str, evicted: int = -1) -> None:
        """Jump over the windows the relay evicted and seed the snapshot again.

        ``evicted``: the newest SCN the relay said it evicted (its 410), used when
        its status cannot be read now; the status is newer when it answers.
        """
        try:
            gap_end = await self._relay_prev_scn(w, relay)
        except Exception:
            if evicted < 0:
                raise
            gap_end = -1
        gap_end = max(gap_end, evicted)
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
        w.gap = Gap(gap_end, reason, repair_hint(w.name, seed_source=self.seeds(w.name)))
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
        if not self.seeds(w.name):
            return
        old = w.seeding
        if old is not None and not old.done():
            old.cancel()
        w.new_seed()
        w.seeding = asyncio.create_task(self._reseed(w, old), name=f"seed-{w.name}")

    async def _reseed(self, w: PartitionWorker, old: asyncio.Task[None] | None) -> None:
        """Seed every table of ``w`` again, after ``old`` (cancelled) has ended."""
        if old is not None:
            await ended(old)  # (the service's stop cancelling this re-seed is raised)
            w.new_seed()  # the old one's end set it
        # (not "again": the gap forgot every seed; tables seeded since it are done,
        # also when a retry runs after a failure)
        await self._seed_repairing(w, [], False)

    async def _seed_repairing(
        self,
        w: PartitionWorker,
        tables: list[str],
        again: bool,
        scope: SnapshotScope | None = None,
    ) -> None:
        """Seed; while a gap is open, a retriable failure is tried again by itself.

        A gap must be repaired without an operator: a seed that fails with a
        retriable error (the source, or the relay reading it, unavailable for a
        while) runs again after ``_RESEED_RETRY_S`` (doubling up to
        ``_RESEED_RETRY_MAX_S``) as long as the gap is there. Without a gap a
        failed seed stays failed (``/v1/status`` says why).
        """
        pause = _RESEED_RETRY_S
        while True:
            retry = await self._seed(w, tables, again, scope)
            if w.gap is None or not (retry or w.seed.state == "done"):
                return  # repaired; or failed for good (/v1/status says why)
            if retry:
                log.warning(
                    "partition %s: seeding again in %.0f s to repair the gap", w.name, pause
                )
            else:
                # seeded, and the gap is still open: a table appeared meanwhile (its
                # schema came with the stream), or the applier had not passed the gap's
                # start yet; the tables not seeded since the gap are seeded next
                log.info("partition %s: seeding what the gap still needs", w.name)
                tables, again, scope = [], False, None
            await asyncio.sleep(pause)
            pause = min(pause * 2, _RESEED_RETRY_MAX_S)
            w.new_seed()

    async def _gap_applied(self, w: PartitionWorker) -> None:
        """Wait until the applier has folded the log's windows from before the gap: a
        sweep before then misses rows they insert (:meth:`SeedLedger.gap_applied`)."""
        while True:  # (the applier is another task of this loop; it moves on by itself)
            if await self.stores.read(lambda s: s.gap_applied(w.name)):
                return
            await asyncio.sleep(_APPLIER_POLL_S)

    # ---- seeding -------------------------------------------------------------

    def seeds(self, part: str) -> bool:
        """Whether ``seed.dsn`` is the source of partition ``part``.

        It is the source of ``seed.partition``, or of the only partition
        served when that is empty; of no other. (Any partition was seeded from
        it before: a second database of the same Postgres cluster or MySQL
        server passes the seeders' identity checks, so its snapshot was filled
        with the other database's rows, and its real rows swept as deleted;
        found by review.)
        """
        if not self.config.seed.dsn:
            return False
        name = self.config.seed.partition
        if name:
            return part == name
        return bool(self.partition_names == (part,))

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
        self.check_seeds(part)
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

    def check_seeds(self, part: str) -> None:
        """400 unless ``seed.dsn`` is ``part``'s source (:meth:`seeds`)."""
        if not self.config.seed.dsn:
            raise BadRequestError("no source to seed from: set seed.dsn")
        if not self.seeds(part):
            raise BadRequestError(
                f"seed.dsn is not the source of partition {part}: it seeds "
                + (
                    f"partition {self.config.seed.partition}"
                    if self.config.seed.partition
                    else "the only partition served, and this server serves several "
                    "(set seed.partition)"
                )
            )

    def start_seed(
        self,
        part: str,
        tables: list[str],
        *,
        again: bool,
        scope: SnapshotScope | None = None,
    ) -> SeedProgress:
        """Start seeding ``tables`` of ``part`` (all known sources when empty) in the background.

        ``again``: copy them even when seeded before (re-seed on demand).
        ``scope``: one table's rows narrowed by ``where`` or ``keys``.
        """
        self.check_seeds(part)
        w = self.workers[part]
        if w.seeding is not None and not w.seeding.done():
            raise NotYetError(
                f"partition {part} is being seeded already; retry when that run ended "
                "(GET /v1/status, seed.state)"
            )
        w.new_seed()
        w.seeding = asyncio.create_task(
            self._seed_repairing(w, tables, again, scope), name=f"seed-{part}"
        )
        return w.seed

    async def resume_snapshots(self) -> None:
        """At start-up: resume the chunked snapshots stored in progress (``cb_snapjob``).

        With ``seed.dsn`` set, per partition with stored jobs, one background
        task (the partition's seed task) runs, after the seed already started
        for the partition if any (``seed.on_start``, a gap's re-seed; it may
        finish some of the jobs itself): the whole-table jobs in one run,
        then each ``where`` / ``keys`` job in a run of its own. Each table
        continues after its last stored chunk (:func:`~._chunks.run_chunked`).
        """
        for w in self.workers.values():
            if not self.seeds(w.name):
                continue
            jobs = await self.stores.write(lambda s, n=w.name: s.snapshot_jobs(n))  # type: ignore[misc]
            if not jobs:
                continue
            for job in jobs:
                scope = SnapshotScope.from_json(job.scope)
                log.info(
                    "partition %s: the snapshot of %s%s resumes after chunk %d (%d rows stored)",
                    w.name,
                    job.table,
                    "" if scope.whole else " (a where/keys snapshot)",
                    job.chunks,
                    job.rows,
                )
            prior = w.seeding if w.seeding is not None and not w.seeding.done() else None
            if prior is None:
                w.new_seed()
            w.seeding = asyncio.create_task(self._resume(w, prior), name=f"seed-{w.name}")

    async def _resume(self, w: PartitionWorker, prior: asyncio.Task[None] | None) -> None:
        """After ``prior`` (a seed running already), the runs of :meth:`resume_snapshots`."""
        if prior is not None:
            with contextlib.suppress(Exception):
                await prior  # (cancelling this task cancels it too)
        jobs = await self.stores.write(lambda s: s.snapshot_jobs(w.name))
        scopes = [SnapshotScope.from_json(j.scope) for j in jobs]
        whole = [s.table for s in scopes if s.whole]
        runs: list[tuple[list[str], bool, SnapshotScope | None]] = []
        if whole:
            runs.append((whole, False, None))
        runs.extend(([s.table], True, s) for s in scopes if not s.whole)
        for i, (tables, again, scope) in enumerate(runs):
            if i or prior is not None:
                w.new_seed()
            await self._seed_repairing(w, tables, again, scope)

    async def _seed(
        self, w: PartitionWorker, tables: list[str], again: bool, scope: SnapshotScope | None = None
    ) -> bool:
        """One seed run (its result in ``w.seed``); True when it failed and may succeed later.

        ``scope``: a one-table snapshot narrowed by ``where`` or ``keys``
        (its table is ``tables[0]``); None: whole tables.
        """
        scope = scope or SnapshotScope("*")
        cfg = self.config
        try:
            await self._wait_for_schemas(w, tables)
            # (parsed in a reader thread: thousands of versions take seconds, which held
            # the event loop at every seed start and retry; found by review)
            rows, schemas = await self.stores.read(lambda s: _parsed_schemas(s, w.name))
            names = tables or sorted({n for _s, _v, n, _j in rows})
            w.seed_tables = frozenset(names)  # (a consumer from nothing waits for these)
            if again and scope.whole:
                await self.stores.write(lambda s: s.forget_seed(w.name, names))
            gap = await self.stores.write(lambda s: s.gap(w.name))
            if gap is not None:
                await self._gap_applied(w)
            seeded = await self.stores.write(lambda s: s.seeded(w.name))
            # (a seed that ended as the gap came may have stored an older one)
            done = {n for n, scn in seeded.items() if gap is None or scn >= gap}
            if not scope.whole:  # a part of a table: read also when the table was seeded
                done.discard(scope.table)
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
                where=scope.where,
                keys=scope.keys,
                min_tag=-1 if gap is None else gap,
                max_rows_per_s=cfg.seed.max_rows_per_s,
                source_time_budget=cfg.seed.source_time_budget,
                watermark_wait_s=cfg.seed.watermark_wait_s,
                log_every_chunks=cfg.seed.log_every_chunks,
                max_chunk_txn_s=cfg.seed.max_chunk_txn_s,
                max_chunk_bytes=cfg.seed.max_chunk_bytes,
            )
            sink = StoreSink(self.stores, w.name, loop)
            await self._run_seeder(seeder_for(cfg.seed.kind), request, write, w.seed, sink)
            if await self.stores.write(lambda s: s.clear_gap(w.name)):
                log.info(
                    "partition %s: the gap in the log is repaired: the snapshot is complete again",
                    w.name,
                )
                w.gap = None
            w.seed.state = "done"  # only now: "done" promises the gap is repaired too
            log.info("partition %s seeded at SCN %d: %d rows", w.name, w.seed.scn, w.seed.rows)
            return False
        except asyncio.CancelledError:
            w.seed.state = "stopped"
            raise
        except Exception as exc:  # noqa: BLE001 - reported in /v1/status, the daemon goes on
            w.seed.state = "failed"
            w.seed.error = self._failure(exc)
            log.error("partition %s: seeding failed: %s", w.name, w.seed.error)
            return isinstance(exc, ChangebusError) and exc.retriable

    async def _run_seeder(
        self,
        seeder: Seeder | Callable[..., int],
        request: SeedRequest,
        write: SeedWriter,
        progress: SeedProgress,
        sink: SnapshotSink | None = None,
    ) -> None:
        """Run ``seeder`` in a thread; when cancelled, stop it and wait until it ended.

        A thread cannot be cancelled: without the wait, a seed restarted after a new
        gap would run next to the old one's thread, both writing seed rows.
        """
        own = threading.Event()
        if self._stop_seed.is_set():
            own.set()
        thread = asyncio.ensure_future(
            asyncio.to_thread(
                functools.partial(seeder, request, write, progress, stop=own)
                if sink is None
                else functools.partial(seeder, request, write, progress, stop=own, sink=sink)
            )
        )
        try:
            await asyncio.shield(thread)
        except asyncio.CancelledError:
            own.set()  # the seeder looks at it between tables
            with contextlib.suppress(Exception):
                await thread
            raise

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


def _parsed_schemas(
    store: Store, part: str
) -> tuple[list[tuple[Any, ...]], list[tuple[int, TableSchema]]]:
    """The partition's stored schema rows and each parsed (a store thread)."""
    rows = store.schemas(part)
    return rows, [(sid, TableSchema.from_json(json.loads(j))) for sid, _v, _n, j in rows]
