"""The per-partition tasks: producer (relay -> queue), log writer (queue -> log), applier.

Structure::

    relay --HTTP--> producer (RelayStream, raw windows) --asyncio.Queue--> log writer
                                                                               |
                     applier (log -> snapshot) <---- wake-up ------------------+

The queue between the producer and the log writer is bounded
(``producer.batch_windows`` x 2 windows, and ``producer.batch_bytes`` x 2
bytes of them: :class:`_QueuedBytes`): a slow store slows reading from the
relay, it never grows memory. A log transaction takes at most
``batch_windows`` windows and ``batch_bytes`` bytes (one bigger window
alone). The log writer appends a batch of windows and
the producer SCN in one store transaction, copies the relay's schemas of
any (source, version) it has not seen first, and turns DATA_LOSS windows
into a gap (:class:`~._seeding.Seeding`); the applier folds the log into the
snapshot in the writer thread and sleeps until woken (or ``applier.idle_s``).
On restart the producer resumes after the log's newest window (the relay
skips what came before) and the applier after its last one.

In a relay cluster the producers read the relays the routing table lists
for their partition and are moved
(:meth:`~changebus.client.RelayStream.set_relays`) when the table changes.
When the producer falls off the relay with ``seed.dsn`` set, it records
the gap, jumps over it and seeds again; without, it says so and retries
after ``producer.fell_off_retry_s``.

Thread-safety: the tasks run on the event loop and update only their own
:class:`~._worker.PartitionWorker`; store calls go through the writer
thread (:mod:`._storethreads`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import replace

import aiohttp

from changebus.client import (
    FellOffRelayError,
    RawWindow,
    RelayStream,
    StreamConfig,
    safe_url,
)
from changebus.schemas import (
    FIRST_CONTROL_OP,
    ChangebusError,
    DataLoss,
    SchemaError,
    TransportError,
    stop_task,
)
from changebus.schemas.config import scrub

from ._lost import DATA_LOSS_OP, loss_in, loss_reason
from ._registrycheck import describe, registry_conflicts, relay_registry
from ._seeding import Seeding
from ._store import PartitionState, Store
from ._worker import PartitionWorker

__all__ = ["Pipelines"]

log = logging.getLogger("changebus.bootstrap")

#: the applier's pause after a failed store transaction (a lost store connection)
_APPLIER_RETRY_S = 1.0
#: a new log asks the relay of its first window where its history starts this many
#: times, this far apart, before it starts just before that window (_first_prev_scn)
_PREV_SCN_TRIES = 10
_PREV_SCN_PAUSE_S = 3.0


class _QueuedBytes:
    """Bytes of the windows between the producer and the end of their log transaction.

    :meth:`reserve` waits while ``limit`` would be passed, unless nothing is
    held (one window bigger than the limit still goes through, alone);
    :meth:`release` is called once the log writer stored them. Windows of up
    to the relay's window limit (hundreds of MiB) made a queue counted in
    windows hold gigabytes behind a slow store (review). Event loop only.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._freed = asyncio.Event()

    async def reserve(self, n: int) -> None:
        while self.held and self.held + n > self.limit:
            self._freed.clear()
            await self._freed.wait()
        self.held += n

    def release(self, n: int) -> None:
        self.held -= n
        self._freed.set()


class Pipelines(Seeding):
    """Producer, log writer and applier tasks (module docstring); a base of the service."""

    # ---- producer -------------------------------------------------------

    async def _produce(self, w: PartitionWorker) -> None:
        cfg = self.config
        assert self._session is not None
        sink: asyncio.Queue[tuple[RawWindow, str]] = asyncio.Queue(cfg.producer.batch_windows * 2)
        queued = _QueuedBytes(cfg.producer.batch_bytes * 2)
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

        checked: list[str] = []  # the relay whose registry was held against the log's

        async def put(raw: RawWindow, relay: str) -> None:
            if checked != [relay]:
                # the windows (and schemas) of the relay before are stored first
                await sink.join()
                await self._sync_schemas(w, relay)
                checked[:] = [relay]
            await queued.reserve(len(raw.body))
            w.queued_bytes = queued.held
            await sink.put((raw, relay))

        writer = asyncio.create_task(self._write_log(w, sink, queued), name=f"log-writer-{w.name}")
        try:
            while True:
                # a fresh reader after the newest window in the log
                if self.member is not None:  # the table's relays now
                    stream_cfg = replace(
                        stream_cfg, relays=self.member.relays(w.name) or stream_cfg.relays
                    )
                stream = RelayStream(stream_cfg, self._session, position=w.producer_scn)
                current[:] = [stream]
                w.stream = stream
                w.state = "streaming"  # ("connecting" until a relay answers: current_state)
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
                    if self.seeds(w.name):
                        await sink.join()
                        try:
                            # (the relay that answered 410, not the one in use: a relay
                            # down counts as gone too, and asking it failed for ever; review)
                            said = next(  # (the error names it without credentials)
                                (u for u in stream.relays if safe_url(u) == exc.relay),
                                stream.relay,
                            )
                            await self._repair_gap(w, said, exc.prev_scn)
                        except Exception as failed:  # noqa: BLE001 - the relay, the store: again
                            w.state = "error"
                            w.last_error = self._failure(failed)
                            log.error(
                                "partition %s: the gap could not be recorded yet (%s); "
                                "trying again",
                                w.name,
                                w.last_error,
                            )
                        else:
                            continue
                except ChangebusError as exc:
                    w.state = "error"
                    w.last_error = scrub(exc.message, self.secrets)
                    log.error("partition %s: producer stopped: %s", w.name, w.last_error)
                except Exception as exc:  # noqa: BLE001 - a producer that died would stall for ever
                    # (a store error in the schema copy, not a ChangebusError, ended the
                    # task for good while the partition still said "streaming"; review)
                    w.state = "error"
                    w.last_error = self._failure(exc)
                    log.error("partition %s: producer failed (retrying): %s", w.name, w.last_error)
                await asyncio.sleep(cfg.producer.fell_off_retry_s)
                # resume after what was written (the sink may still be draining)
                await sink.join()
        finally:
            await stop_task(writer)

    async def _write_log(
        self,
        w: PartitionWorker,
        sink: asyncio.Queue[tuple[RawWindow, str]],
        queued: _QueuedBytes,
    ) -> None:
        known: set[tuple[int, int]] | None = None  # the (source id, version) pairs stored
        start_scn: int | None = None
        cfg = self.config.producer
        carried: tuple[RawWindow, str] | None = None  # taken, over the last batch's bytes
        while True:
            batch = [carried if carried is not None else await sink.get()]
            carried = None
            size = len(batch[0][0].body)
            while len(batch) < cfg.batch_windows and not sink.empty():
                item = sink.get_nowait()
                size += len(item[0].body)
                if size > cfg.batch_bytes:
                    carried = item
                    break
                batch.append(item)
            failed = False
            while True:  # the batch stays until it is stored; the producer waits on the queue
                try:
                    if known is None:
                        rows = await self.stores.write(lambda s: s.schemas(w.name))
                        known = {(sid, v) for sid, v, _n, _j in rows}
                    start_scn = await self._store_batch(w, batch, known, start_scn)
                    break
                except Exception as exc:  # noqa: BLE001 - a writer that died would stall for ever
                    failed = True
                    w.state = "error"
                    w.last_error = self._failure(exc)
                    log.error(
                        "partition %s: cannot store windows (retrying): %s", w.name, w.last_error
                    )
                    await asyncio.sleep(self.config.producer.fell_off_retry_s)
            if failed and w.state == "error":
                w.state = "streaming"
            for raw, _url in batch:
                queued.release(len(raw.body))
                sink.task_done()
            w.queued_bytes = queued.held

    async def _store_batch(
        self,
        w: PartitionWorker,
        batch: list[tuple[RawWindow, str]],
        known: set[tuple[int, int]],
        start_scn: int | None,
    ) -> int | None:
        """Append ``batch`` to the log (and the schemas it needs); returns the stream's start.

        ``known`` grows by the schemas copied. Idempotent: windows at or
        below the producer SCN are skipped, so a batch may be stored again
        after a failure whose commit went through.
        """
        wanted: set[tuple[int, int]] = set()
        losses: list[tuple[int, DataLoss]] = []
        received: list[int] = []  # SCNs of the windows before the first loss
        for raw, _url in batch:
            ops = raw.headers["op"]
            h = raw.headers[ops < FIRST_CONTROL_OP]
            wanted.update(zip(h["source_id"].tolist(), h["schema_version"].tolist(), strict=True))
            if (ops == DATA_LOSS_OP).any():
                losses.append((raw.scn, loss_in(raw)))
            elif not losses:
                received.append(raw.scn)
        if not wanted <= known:
            known |= await self._sync_schemas_from(w, batch[-1][1], wanted - known)
        if start_scn is None and w.producer_scn < 0:
            start_scn = await self._first_prev_scn(w, batch[0][0].scn, batch[0][1])
        data = b"".join(raw.body for raw, _ in batch)
        events = sum(len(raw.offsets) for raw, _ in batch)
        first = start_scn if start_scn is not None else -1
        # the gap a DATA_LOSS window opens ends at that window (the last one's), and its
        # lost range starts at the newest window this server has before the first one
        lost_upto = max(scn for scn, _l in losses) if losses else None
        lost_after = max([w.producer_scn, first, *received])

        def append(s: Store) -> PartitionState:
            s.append(w.name, data, start_scn=first, lost=(lost_after, lost_upto))
            return s.state(w.name)

        # (w.producer_scn moves only once a batch is stored: a retried batch whose
        # commit went through still has its gap handled, which the failure skipped)
        before = w.producer_scn
        st = await self.stores.write(append)
        if lost_upto is not None and lost_upto > before:
            w.data_loss += len(losses)
            self._gap_recorded(w, lost_upto, loss_reason(losses))
        w.producer_scn, w.log_min_scn, w.base_scn = st.producer_scn, st.log_min_scn, st.base_scn
        w.windows_appended += len(batch)
        w.events_appended += events
        w.lag_events += events
        w.last_window_ts_ns = batch[-1][0].timestamp_ns
        w.wake.set()
        return start_scn

    async def _sync_schemas_from(
        self, w: PartitionWorker, url: str, missing: set[tuple[int, int]]
    ) -> set[tuple[int, int]]:
        """The schemas of ``missing`` from the relay ``url`` that sent them, else from the
        stream's other relays (the ``(source, version)`` pairs now stored).

        A relay that sent a window and died before its batch was stored made
        the log writer ask it again every few seconds, for ever: the stream had
        moved to another relay and waited for the writer. A relay cluster
        shares one registry, and a registry that disagrees is refused
        (:meth:`_sync_schemas`), so any relay may answer. The first error is
        raised when no relay answered.
        """
        others = [u for u in (w.stream.relays if w.stream is not None else ()) if u != url]
        got: set[tuple[int, int]] = set()
        first: Exception | None = None
        for candidate in (url, *others):
            try:
                got |= await self._sync_schemas(w, candidate)
            except SchemaError:
                raise
            except Exception as exc:  # noqa: BLE001 - the next relay may answer
                first = first or exc
                log.warning(
                    "partition %s: relay %s could not give its schemas: %s",
                    w.name,
                    safe_url(candidate),
                    self._failure(exc),
                )
                continue
            if missing <= got:
                break
        if not missing <= got:
            # (a lagging relay answered without the newest versions: the batch waits,
            # rather than be stored with events no stored schema decodes; review)
            why = f" ({self._failure(first)})" if first is not None else ""
            raise TransportError(
                f"partition {w.name}: no relay gave the schemas of "
                f"{', '.join(f'{sid} v{v}' for sid, v in sorted(missing - got)[:5])}{why}",
                retriable=True,
            )
        return got

    async def _first_prev_scn(self, w: PartitionWorker, first_scn: int, url: str) -> int:
        """Where a new log's history starts: the ``prev_scn`` of relay ``url``, which sent
        its first window (``first_scn``). When that relay does not answer any more (it
        died meanwhile, and the writer asked it for ever: review), just before that
        window: true of any source (no window lies between), if later than the relay
        could have said, so consumers at positions between are refused, never served
        a catch-up that lacks windows. (Another relay's ``prev_scn`` says nothing of
        what this one had evicted.)"""
        reason = ""
        for attempt in range(_PREV_SCN_TRIES):
            if attempt:
                await asyncio.sleep(_PREV_SCN_PAUSE_S)
            try:
                return await self._relay_prev_scn(w, url)
            except Exception as exc:  # noqa: BLE001 - a blip, or the relay died
                reason = self._failure(exc)
        log.warning(
            "partition %s: relay %s did not say where its history starts (%s); the log's "
            "starts just before its first window, SCN %d",
            w.name,
            safe_url(url),
            reason,
            first_scn,
        )
        return first_scn - 1

    async def _sync_schemas(self, w: PartitionWorker, url: str) -> set[tuple[int, int]]:
        """Copy the relay's table schemas of the partition into the store.

        Raises a non-retriable :class:`SchemaError` when the relay's registry
        disagrees with the stored one (:mod:`._registrycheck`); nothing is
        copied then.
        """
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=30)
        entries = await relay_registry(self._session, url, w.name, timeout)
        stored = await self.stores.write(lambda s: s.schemas(w.name))
        # (parses every schema: thousands of versions are seconds, not for the loop)
        conflicts = await asyncio.to_thread(registry_conflicts, stored, entries)
        if conflicts:
            raise SchemaError(
                f"partition {w.name}: the schema registry of relay {safe_url(url)} is not the "
                f"one this log was written with ({describe(conflicts)}); its windows are not "
                "stored. Point the bootstrap server at relays that share one registry (a relay "
                "cluster), or rebuild the bootstrap store from this relay"
            )
        have = {(sid, v) for sid, v, _n, _j in stored}
        new = [e for e in entries if (e[0], e[1]) not in have]
        if new:
            await self.stores.write(lambda s: s.put_schemas(w.name, new))
            log.info("partition %s: %d schema versions copied from the relay", w.name, len(new))
        return {(sid, v) for sid, v, _n, _j in entries}

    # ---- applier ---------------------------------------------------------

    async def _apply(self, w: PartitionWorker) -> None:
        batch = self.config.applier.batch_events
        purge_at = time.monotonic()
        keep = self.config.applier.log_keep_events
        # the log is pruned once a tenth of ``keep`` more events came: finding the cut
        # walks ``keep`` index entries, and after every step of the applier (even one
        # window's) that was a second per step at 10M events kept (review)
        pruned_at = -keep
        while True:
            before = w.applier_scn
            prune = bool(keep) and w.events_appended - pruned_at >= max(keep // 10, 1)
            purging = False  # (a purge step found more to do: its next one comes at once)
            if self.config.applier.tombstone_keep_s and time.monotonic() >= purge_at:
                purging = await self._purge(w)
                purge_at = time.monotonic()
                if not purging:
                    purge_at += self.config.applier.purge_interval_s

            def step(
                s: Store, before: int = before, prune: bool = prune
            ) -> tuple[PartitionState, int, int]:
                done = s.applied_events
                st = s.apply(w.name, batch, self.config.applier.batch_bytes)
                if prune and st.applier_scn != before:
                    s.prune_to(w.name, keep)
                    st = s.state(w.name)
                return st, s.applied_events - done, s.unapplied_events(w.name)

            try:
                st, applied, left = await self.stores.write(step)
            except Exception as exc:  # noqa: BLE001 - an applier that died would stall for ever
                w.last_error = f"applier: {self._failure(exc)}"
                log.error("partition %s: %s (retrying)", w.name, w.last_error)
                await asyncio.sleep(_APPLIER_RETRY_S)
                continue
            if st.applier_scn != before:
                if prune:
                    pruned_at = w.events_appended
                w.events_applied += applied
                w.lag_events = left
                w.applier_scn, w.log_min_scn = st.applier_scn, st.log_min_scn
                w.applied_at = time.monotonic()
                continue
            if purging:
                continue
            w.wake.clear()
            # asyncio.timeout, not wait_for: Python 3.11's wait_for loses a
            # cancellation that arrives as the wake-up completes, and the
            # applier would then never stop
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.applier.idle_s):
                    await w.wake.wait()

    async def _purge(self, w: PartitionWorker) -> bool:
        """One bounded step purging tombstones older than ``tombstone_keep_s``
        (:mod:`._purge`); whether another would find more. The applier takes its own
        steps in between: a first purge of a big store (thousands of steps) held it
        back for minutes. A failure waits for the next round."""
        cutoff_ns = time.time_ns() - int(self.config.applier.tombstone_keep_s * 1e9)
        try:
            purged, more, w.tomb_scn = await self.stores.write(
                lambda s: (*s.purge_tombstones(w.name, cutoff_ns), s.tomb_scn(w.name))
            )
        except Exception as exc:  # noqa: BLE001 - the applier must go on
            log.error("partition %s: purging tombstones: %s", w.name, self._failure(exc))
            return False
        w.tombstones_purged += purged
        return bool(more)
