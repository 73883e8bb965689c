"""Switching between relays and bootstrap servers (Databus's snapshot + catch-up).

:class:`Bootstrapper` runs one bootstrap for the consumer's fetcher
(:class:`~._fetch.RelayFetcher`, which calls it when the relays cannot serve
its position, and returns to the relays at the SCN it gives back)::

    relay --410--> start(since) --> snapshot pages (since, ...) --> status: target
          <-- relay after target <-- catch-up windows (start, target] <--+

Phases, and the checkpoint entry that holds after each delivered window
(:attr:`~._model.Window.checkpoint`):

* **snapshot** -- each page of rows changed after ``since`` at their
  latest version becomes one window (``phase = "snapshot"``); after it the
  checkpoint is ``bootstrap-snapshot`` with the page's resume position (and,
  in ``target_scn``, the newest row SCN the pages sent so far when it is past
  ``start``), or, after the last page, ``bootstrap-catchup`` at ``start``
  with the target.
* **catch-up** -- the log windows in ``(start, target]``, validated like
  relay windows (``phase = "catchup"``); checkpoint ``bootstrap-catchup`` at
  the window, and ``online`` at ``target`` after the last one.

Why the end state is consistent: a snapshot row sent at a version newer
than ``start`` has those changes in ``(start, target]``, which the catch-up
replays in order; columns a replayed UPDATE does not carry keep the
snapshot's value, which no change in between touched (docs/protocol.md
section 7.1). The target is the server's newest window, and never before
the newest row SCN the pages sent: a seed stores the rows it copies at its
chunk's tag, which may be ahead of the server's log (a re-seed running
during the snapshot); the catch-up then waits (the server's retriable 503)
until the log gets there. So after the target window the consumer holds the
source state at ``target`` -- as if it had read every window. Nothing is skipped: a
snapshot row is sent only when it changed after ``since`` (a consumer a
little behind gets just the changed keys, deletes as tombstones).

A restart resumes from the checkpoint: the snapshot at its position when the
same server is used (positions are per server), otherwise from the start
with the same ``since``; the catch-up after its last window. A catch-up
whose log was pruned meanwhile (410) restarts the snapshot, with deletes;
on the server the catch-up ran on, a gap it recorded meanwhile does not stop
that (the rows the consumer holds are its store's own, which its re-seed
repairs), a history starting after the snapshot does
(:mod:`._bootstrap_history`). Retriable
failures (connection errors, 5xx, a server not ready yet) move to the next
bootstrap server with backoff: the same :class:`~._failover.Failover` as
relay failover. The requests, and the checks of a page before it is used,
live in :mod:`._bootstrap_api`.

Runs on the consumer's event loop; not thread-safe.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import aiohttp

from changebus.schemas import (
    BootstrapFailedError,
    BootstrapProgress,
    CorruptEventError,
    Mode,
    PartitionCheckpoint,
    ProtocolError,
    TransportError,
)

from ._assembler import RawWindow, WindowAssembler
from ._backoff import Backoff
from ._bootstrap_api import BootstrapApi, check_events, snapshot_page
from ._bootstrap_history import Held, check_history, held_after_restart
from ._config import ConsumerConfig
from ._decode import SchemaCache, decode_window
from ._failover import Failover
from ._http import CatchupPruned, RestartBootstrap, safe_url
from ._info import BootstrapStatus, RelaySchemas
from ._model import ChangeOp, Window
from ._queue import WindowSink
from ._stream import StreamConfig

__all__ = ["Bootstrapper"]

log = logging.getLogger(__name__)


class Bootstrapper:
    """Runs bootstraps from the configured bootstrap servers (module docstring).

    ``partition`` is the partition's name (None: learned from the server);
    ``phase`` the phase of the bootstrap running (``online`` between them).
    """

    def __init__(
        self,
        config: ConsumerConfig,
        session: aiohttp.ClientSession,
        queue: WindowSink,
        cache: SchemaCache,
    ) -> None:
        self.config = config
        self.partition: str | None = config.partition
        #: how many bootstraps ran, and the current phase
        self.bootstraps = 0
        self.phase = "online"
        #: the current (or last) bootstrap's progress, for progress displays: snapshot
        #: rows queued, the catch-up's last SCN queued and its target (-1: not yet)
        self.rows = 0
        self.catchup_scn = -1
        self.target_scn = -1
        self._queue = queue
        self._cache = cache
        #: the requests (with the relays' request timeouts)
        self._api = BootstrapApi(config, session, StreamConfig.of(config).timeout)
        self._failover = Failover(
            config.bootstrap_servers,
            Backoff(config.backoff_initial_s, config.backoff_max_s, config.backoff_multiplier),
            max_attempts=config.max_attempts,
            what="bootstrap server",
            # one server's refusal is final only when every server refused: a re-seeding
            # (503), busy or restarting one is retried (the way out wipes the consumer's
            # state: found by review); max_attempts bounds the wait
            unreachable_rounds=0,
        )
        #: the checkpoint after the last window queued in the current bootstrap
        self._last: PartitionCheckpoint | None = None
        #: the newest row version the consumer may hold from this bootstrap's snapshot
        #: pages (their largest event SCN, -1: none): the catch-up's target is never
        #: before it (module docstring, "Why the end state is consistent")
        self._floor = -1
        #: the pause before a snapshot runs again (a server said to restart it): they
        #: came at once, for ever, with two stores behind one address (review)
        self._restarts = Backoff(
            config.backoff_initial_s, config.backoff_max_s, config.backoff_multiplier
        )

    def set_servers(self, servers: tuple[str, ...]) -> None:
        """Ask ``servers`` from now on (a cluster's table changed); the progress is kept.

        A bootstrap running goes on with the server in use while it is
        listed; otherwise its next request goes to the new list.
        """
        self._failover.set_urls(servers)

    async def run(self, since: int, resume: PartitionCheckpoint | None) -> int:
        """Snapshot then catch-up after ``since``; returns the target SCN reached.

        ``resume``: the stored checkpoint entry of a bootstrap to continue.
        """
        self.bootstraps += 1
        self._last = None
        self.rows, self.catchup_scn, self.target_scn = 0, -1, -1
        # the rows a resumed bootstrap's pages already delivered: in a snapshot its
        # checkpoint's target_scn is their newest SCN so far, in a catch-up the target
        # (kept for a plan on another server too: the consumer holds those rows)
        self._floor = resume.bootstrap.target_scn if resume and resume.bootstrap else -1
        # the consumer holds part of a bootstrap's rows: a new snapshot must carry deletes
        dirty = resume is not None
        # (start, since) of the oldest snapshot the consumer holds rows of, once a restart
        # forgot its checkpoint: a new snapshot must come from a history reaching back to it
        held: Held | None = None
        decoded_for = ""  # the server whose source ids the schema cache holds
        while True:
            url = self._failover.url
            if url != decoded_for:
                # source ids are a server's own (the relay's, or another bootstrap server's)
                self._cache.clear()
                decoded_for = url
            queued = self._queued()
            current = queued or resume  # after a failure: from the last window queued
            try:
                target = await self._run_once(
                    url, since, current, dirty or queued is not None, held
                )
                break
            except RestartBootstrap as exc:
                if self.config.bootstrap_catchup_only:
                    # no snapshot to run again, and a new catch-up from ``since`` would
                    # send the windows queued so far a second time
                    # (another server's log may: the failover raises when none has it)
                    at = current.window_scn if current is not None else since
                    await self._failover.failed(
                        BootstrapFailedError(
                            f"{safe_url(url)}: its log no longer holds the windows after SCN"
                            f" {at} (pruned), and this consumer takes no snapshot"
                            " (bootstrap_catchup_only)"
                        )
                    )
                    continue
                # the log moved on: snapshot again (with deletes: the consumer has rows)
                log.warning("%s", exc.message)
                if self._restarts.failures:  # (the first at once: the log moved on)
                    delay = self._restarts.next_delay()
                    log.warning(
                        "partition %s: snapshot restarted %d times; the next in %.2f s",
                        self.partition,
                        self._restarts.failures,
                        delay,
                    )
                    await asyncio.sleep(delay)
                else:
                    self._restarts.failures = 1
                prior = current.bootstrap if current is not None else None
                held = held_after_restart(held, prior, url, isinstance(exc, CatchupPruned))
                resume, self._last, dirty = None, None, True
                continue
            except Exception as exc:  # noqa: BLE001 - Failover decides, by data
                await self._failover.failed(exc)
        self._failover.succeeded()
        self._restarts.reset()
        self.phase = "online"
        log.info(
            "bootstrap of partition %s done at SCN %d; back to the relays", self.partition, target
        )
        return target

    def _queued(self) -> PartitionCheckpoint | None:
        """The checkpoint after the last window queued in this bootstrap (None: none yet)."""
        return self._last

    def _learn_partition(self, name: str) -> None:
        if self.partition is None:
            self.partition = name
        elif name != self.partition:
            raise ProtocolError(f"asked for partition {self.partition!r}, got {name!r}")

    async def _run_once(
        self,
        url: str,
        since: int,
        resume: PartitionCheckpoint | None,
        dirty: bool,
        held: Held | None = None,
    ) -> int:
        """One attempt on ``url``: continue ``resume`` there, or start (again).

        ``dirty``: the consumer already holds rows of an earlier (partial)
        bootstrap. A new snapshot for it must include deletes even when it
        started from nothing, so it asks for everything after the server's
        ``base_scn`` (all the server holds, tombstones included). ``held``:
        such a snapshot whose checkpoint a restart forgot (:class:`~._bootstrap_history.Held`; the
        server's store was rebuilt meanwhile): its history is checked as for
        another server's (it skipped that check; found by review), its lost
        ranges only when the rows may be another store's.
        """
        prog: BootstrapProgress
        mode = Mode.SNAPSHOT
        if self.partition is None:
            self._learn_partition((await self._api.status(url, self.partition)).partition)
        if resume is not None and resume.mode is Mode.ONLINE and self._queued() is not None:
            return resume.window_scn  # everything was queued before the failure
        # (the checkpoint names the server without its user and password, which reached
        # checkpoint files, on_checkpoint and debug logs: review; older ones with them)
        if (
            resume is not None
            and resume.bootstrap is not None
            and resume.bootstrap.server in (url, safe_url(url))
        ):
            prog = dataclasses.replace(resume.bootstrap, server=safe_url(url))
            mode = resume.mode
        else:
            if resume is not None and resume.bootstrap is not None:
                since = resume.bootstrap.since_scn
                start = resume.bootstrap.start_scn if dirty else -1
                if start >= 0:
                    upto = resume.window_scn if resume.mode is Mode.CATCHUP else None
                    status = await self._api.status(url, self.partition)
                    check_history(status, url, start, since, upto)
            elif resume is None and held is not None:
                own = held.own == safe_url(url)
                status = await self._api.status(url, self.partition)
                check_history(status, url, held.start, held.since, None, lost=not own)
            if resume is not None and resume.mode is Mode.CATCHUP and resume.window_scn >= 0:
                # in the catch-up of another server: the consumer has every change up to
                # its last window, so this one plans from there (the server's own checks
                # and choice, a catch-up after it or a snapshot of what changed since),
                # where a plan from ``since`` sent the windows queued already a second
                # time, SCNs going backwards (found by review)
                since = resume.window_scn
            elif dirty and since < 0:
                since = max((await self._api.status(url, self.partition)).base_scn, 0)
            prog = BootstrapProgress(since_scn=since)
        since = prog.since_scn
        if mode is Mode.SNAPSHOT and prog.start_scn < 0:
            start, snapshot = await self._api.start(url, since, self.partition)
            prog = BootstrapProgress(since_scn=since, start_scn=start, server=safe_url(url))
            if not snapshot:
                mode = Mode.CATCHUP
            log.info(
                "partition %s: bootstrap from %s after SCN %d: %s at SCN %d",
                self.partition,
                safe_url(url),
                since,
                "snapshot" if snapshot else "catch-up only",
                start,
            )
        if mode is Mode.SNAPSHOT:
            prog = await self._snapshot(url, prog)
        after = prog.start_scn
        if (
            resume is not None
            and resume.mode is Mode.CATCHUP
            and resume.bootstrap is not None
            and (resume.bootstrap.since_scn, resume.bootstrap.start_scn)
            == (prog.since_scn, prog.start_scn)
        ):
            after = max(after, resume.window_scn)
        if prog.target_scn < 0:
            status = await self._api.status(url, self.partition)
            # (never before what was queued: a server whose log ends there sends nothing)
            prog = dataclasses.replace(prog, target_scn=self._target(status, prog, after))
        return await self._catchup(url, prog, after)

    def _target(self, status: BootstrapStatus, prog: BootstrapProgress, after: int) -> int:
        """The catch-up's target: the server's newest window, at most ``until_scn`` (a
        bounded read: the catch-up stops there, and the read ends as it does without a
        bootstrap; it went on to the server's newest window: found by review), and never
        before the snapshot's start or ``after``, the last window queued."""
        # (and never before the newest row a snapshot page sent: a seed stores the rows it
        # copies at its chunk's tag, often ahead of the log; online before it, the relay
        # windows up to there took those rows back to older versions: found by review)
        target = max(status.producer_scn, self._floor)
        until = self.config.until_scn
        if until is not None and until >= 0:
            target = min(target, until)
        return max(target, prog.start_scn, after)

    async def _snapshot(self, url: str, prog: BootstrapProgress) -> BootstrapProgress:
        self.phase = "snapshot"
        source = self._api.schemas(url, self.partition)
        self._floor = max(self._floor, prog.target_scn)
        while True:
            params = {
                "since": str(prog.since_scn),
                "start": str(prog.start_scn),
                "max_bytes": str(self.config.bootstrap_page_bytes),
            }
            if prog.snapshot_position:
                params["position"] = prog.snapshot_position
            body, headers = await self._api.page(url, "snapshot", params, self.partition)
            position = headers.get("X-Changebus-Snapshot-Position", "")
            complete = headers.get("X-Changebus-Snapshot-Complete") == "1"
            if not complete and not position:
                # asking again without a position would start over: never loop on page 1
                raise ProtocolError(
                    "a snapshot page came without a position and is not the last",
                    retriable=True,
                )
            raw = snapshot_page(body, prog.start_scn, headers)
            if raw.offsets.size:
                self._floor = max(self._floor, int(raw.headers["scn"].max()))
            if complete:
                target = self._target(
                    await self._api.status(url, self.partition), prog, prog.start_scn
                )
                prog = dataclasses.replace(prog, snapshot_position=None, target_scn=target)
                pc = PartitionCheckpoint(
                    mode=Mode.CATCHUP,
                    window_scn=prog.start_scn,
                    prev_scn=prog.start_scn,
                    bootstrap=prog,
                )
            else:
                # in a snapshot, target_scn holds the newest row SCN sent so far (when
                # past the start): a restart from this checkpoint keeps it (the field
                # every version reads; one before this set no target in a snapshot)
                floor = self._floor if self._floor > prog.start_scn else -1
                prog = dataclasses.replace(prog, snapshot_position=position, target_scn=floor)
                pc = PartitionCheckpoint(
                    mode=Mode.SNAPSHOT,
                    window_scn=prog.since_scn,
                    prev_scn=prog.since_scn,
                    bootstrap=prog,
                )
            await self._put_snapshot_page(raw, pc, source)
            if complete:
                return prog

    async def _put_snapshot_page(
        self, raw: RawWindow, pc: PartitionCheckpoint, source: RelaySchemas
    ) -> None:
        headers = raw.headers
        window = await decode_window(raw, self.partition or "", self._cache, source)
        scns, stamps = headers["scn"].tolist(), headers["timestamp_ns"].tolist()
        events = tuple(
            # a snapshot row is the row's state: its own SCN and commit time, and no
            # before-image (a key change long ago must not delete a key that exists again)
            dataclasses.replace(e, scn=scn, timestamp_ns=ts)
            if e.op in (ChangeOp.DELETE, ChangeOp.TRUNCATE)
            else dataclasses.replace(e, scn=scn, timestamp_ns=ts, before=None, before_not_sent=())
            for e, scn, ts in zip(window.events, scns, stamps, strict=True)
        )
        await self._queue.put(
            dataclasses.replace(window, events=events, phase="snapshot", checkpoint=pc), raw
        )
        self._last = pc
        self.rows += len(events)
        self._failover.succeeded()  # progress: failures are counted afresh

    async def _catchup(self, url: str, prog: BootstrapProgress, after: int) -> int:
        self.phase = "catchup"
        target = self.target_scn = prog.target_scn
        source = self._api.schemas(url, self.partition)
        assembler = WindowAssembler(after, self.config.max_window_bytes)
        last_ts = 0
        online = False
        while after < target:
            params = {
                "after": str(after),
                "target": str(target),
                "max_bytes": str(self.config.bootstrap_page_bytes),
            }
            body, headers = await self._api.page(url, "catchup", params, self.partition)
            raws = assembler.feed(body)
            check_events(headers, assembler.fed_events, "catch-up")
            if assembler.in_window:
                raise CorruptEventError("a catch-up page ends inside a window", retriable=True)
            past = False
            for raw in raws:
                if raw.scn > target:
                    # (a server that ignored the target: the relays send these after it,
                    # so queued here they came twice; review)
                    past = True
                    break
                window = await decode_window(raw, self.partition or "", self._cache, source)
                if raw.scn >= target:
                    pc = PartitionCheckpoint(
                        window_scn=raw.scn, prev_scn=raw.scn, timestamp_ns=raw.timestamp_ns
                    )
                else:
                    pc = PartitionCheckpoint(
                        mode=Mode.CATCHUP,
                        window_scn=raw.scn,
                        prev_scn=raw.scn,
                        timestamp_ns=raw.timestamp_ns,
                        bootstrap=prog,
                    )
                await self._queue.put(
                    dataclasses.replace(window, phase="catchup", checkpoint=pc), raw
                )
                self._last = pc
                after, last_ts, online = raw.scn, raw.timestamp_ns, raw.scn >= target
                self._failover.succeeded()
                self.catchup_scn = after
            if past:
                break
            text = headers.get("X-Changebus-Last-Scn", str(after))
            if not text.lstrip("-").isdigit():
                raise ProtocolError(
                    f"a catch-up page with a bad X-Changebus-Last-Scn header {text[:40]!r}",
                    retriable=True,
                )
            last = int(text)
            if headers.get("X-Changebus-Complete") == "1" or last >= target:
                break
            if not raws:
                raise TransportError("the bootstrap server sent an empty catch-up page")
        if not online:
            # no window at the target was delivered (nothing to replay): go online there
            pc = PartitionCheckpoint(window_scn=target, prev_scn=target, timestamp_ns=last_ts)
            await self._queue.put(
                Window(
                    scn=target,
                    timestamp_ns=last_ts,
                    partition=self.partition or "",
                    phase="catchup",
                    checkpoint=pc,
                )
            )
            self._last = pc
        return target
