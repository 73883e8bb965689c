"""Decode worker processes: rows events transcoded while the stream reads on.

:func:`start_workers` starts them (spawned: the relay has threads) and warms
them up; the assembler hands each rows event to :meth:`WorkerDispatch.submit`,
which submits it to a worker and returns a future of its row changes, kept in
the transaction until its window is made (in the fetcher's thread the
assembler calls :func:`transcode_changes` directly).

Layouts travel by id. A rows event is sent with its table's :func:`layout_id`
(16 bytes, computed once per table layout in the parent), its bytes and its
op; the layout itself goes along only while the parent does not know that
every worker holds it. Each worker keeps the transcoders it compiled in a
least-recently-used cache (:data:`WORKER_LAYOUTS`), so the cost of an event
does not grow with its layout's size, nor with the number of tables a server
cycles through (up to that bound). A worker asked for a layout it does not
hold (never sent to it, or evicted since) answers so, and the parent
transcodes that event itself with the table's own transcoder (transcoders
may be shared between threads): a missing layout costs a little time, never
a wrong change.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import os
import pickle
import threading
from collections import OrderedDict
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from functools import partial
from typing import Any, Final

from ._layout import RowsTranscoder, TableLayout, compile_transcoder

__all__ = [
    "WORKER_LAYOUTS",
    "WorkerDispatch",
    "layout_id",
    "start_workers",
    "transcode_changes",
]

log = logging.getLogger("changebus.fetchers.mysql")

#: transcoders a decode worker keeps compiled, and layouts whose holders the parent
#: tracks (as many as the assembler keeps tables compiled)
WORKER_LAYOUTS: Final = 4096

#: one row change, as :meth:`RowEncoder.encode_many_encoded` takes it
Change = tuple[int, bytes, bytes | None, bytes | None, Any, Any]


def start_workers(workers: int, name: str) -> ProcessPoolExecutor:
    """Decode worker processes (spawned: the relay has threads), started and warmed up
    here so that their start-up (imports) is not in the stream's way."""
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    try:
        for future in [pool.submit(_warm_up) for _ in range(workers)]:
            future.result(timeout=120)
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    log.info("partition %s: %d decode worker processes", name, workers)
    return pool


def _warm_up() -> int:
    from . import _assembler  # everything a worker runs, imported once here

    return len(_assembler.__all__)


def layout_id(layout: TableLayout) -> bytes:
    """A layout's id in the decode workers: a digest of its pickle, the very bytes a
    worker compiles from (so equal ids compile to the same transcoder). Computed once
    per table layout, in the parent (as costly as pickling the layout once)."""
    data = pickle.dumps(layout, protocol=pickle.HIGHEST_PROTOCOL)
    return hashlib.blake2b(data, digest_size=16).digest()


def transcode_changes(
    transcode: RowsTranscoder, raw: bytes, op: int, start: int = 0, end: int = -1
) -> list[Change]:
    """Row changes of one rows event (``raw[start:end]``), ready for
    :meth:`RowEncoder.encode_many_encoded`."""
    images = transcode(raw, start, len(raw) if end < 0 else end)
    if op == 1:
        return [(1, k, r, None, ns or (), ()) for k, r, ns in images]
    if op == 3:
        return [(3, k, None, r, (), ns or ()) for k, r, ns in images]
    out: list[Change] = []
    append = out.append
    for (bk, b, bns), (ak, a, ans) in zip(images[0::2], images[1::2], strict=True):
        append((2, ak, a, b, ans or (), bns or ()))
        if bk != ak:  # a key-changing update: the old key's delete follows (routed by it)
            append((3, bk, None, b, (), bns or ()))
    return out


#: in a decode worker process: layout id -> transcoder, least recently used first
#: (at most :data:`WORKER_LAYOUTS`; one thread per worker process uses it)
_WORKER_TRANSCODERS: OrderedDict[bytes, RowsTranscoder] = OrderedDict()


def _in_worker(
    key: bytes, layout: TableLayout | None, raw: bytes, op: int
) -> tuple[int, list[Change] | None]:
    """A rows event in a decode worker: ``(this process's id, its changes)``, or
    ``(id, None)`` when the worker does not hold layout ``key`` and was not sent it."""
    transcode = _WORKER_TRANSCODERS.get(key)
    if transcode is not None:
        _WORKER_TRANSCODERS.move_to_end(key)
    elif layout is None:
        return os.getpid(), None
    else:
        transcode = compile_transcoder(layout)
        _WORKER_TRANSCODERS[key] = transcode
        if len(_WORKER_TRANSCODERS) > WORKER_LAYOUTS:
            _WORKER_TRANSCODERS.popitem(last=False)
    return os.getpid(), transcode_changes(transcode, raw, op)


class _Holders:
    """What the parent knows of one layout in the workers."""

    __slots__ = ("pids", "sending")

    def __init__(self) -> None:
        #: process ids of the workers that answered an event of it (so hold it)
        self.pids: set[int] = set()
        #: submits carrying the layout that were not answered yet
        self.sending = 0


class WorkerDispatch:
    """The parent's side of the decode workers: submits rows events, knows which
    workers hold which layouts (see the module docstring).

    A submit carries its layout while the workers known to hold it plus the
    submits carrying it still unanswered are fewer than the workers: at most
    one layout in flight per worker that may lack it (each idle worker takes
    one event at a time from the pool's queue), none once every worker holds
    it. ``_holders`` is a belief, not the truth: a worker is added when it
    answered an event of the layout, and removed when it answered that it lacks
    it (it never had it, or evicted it since: until that answer, the belief
    over-reports). A worker believed to lack a layout costs the layout sent
    again; one that lacks it against the belief costs one event transcoded in
    the parent, on the :func:`_fallback` thread (not the pool's own thread,
    which hands out work and collects results meanwhile).

    :meth:`submit` is called from the assembler's thread; the futures' callbacks
    run in the pool's own thread (or in the submitting one when the worker was
    done first). Both touch ``_holders`` and the gauges under ``_lock`` only.
    """

    def __init__(self, pool: Executor, workers: int, capacity: int = WORKER_LAYOUTS) -> None:
        self._pool = pool
        self._workers = max(1, workers)
        self._capacity = capacity
        self._lock = threading.Lock()
        #: layout id -> what is known of it, least recently submitted first (at most
        #: ``capacity``: a forgotten id is sent again)
        self._holders: OrderedDict[bytes, _Holders] = OrderedDict()
        #: submits that carried their layout, and events a worker lacked it for (gauges)
        self.layouts_sent = 0
        self.misses = 0

    @classmethod
    def of(cls, pool: Executor) -> WorkerDispatch:
        """A dispatch for ``pool`` (its worker count: a process pool's ``_max_workers``)."""
        return cls(pool, int(getattr(pool, "_max_workers", 1) or 1))

    def submit(
        self, key: bytes, layout: TableLayout, transcode: RowsTranscoder, raw: bytes, op: int
    ) -> Future[list[Change]]:
        """The row changes of rows event ``raw`` (a future), transcoded by a worker;
        ``layout`` (id ``key``) is sent only while some worker may lack it.
        ``transcode`` is the table's own transcoder of it, used if a worker lacks it."""
        with self._lock:
            held = self._holders.get(key)
            if held is None:
                held = self._holders[key] = _Holders()
                if len(self._holders) > self._capacity:
                    self._holders.popitem(last=False)
            else:
                self._holders.move_to_end(key)
            send = len(held.pids) + held.sending < self._workers
            if send:
                held.sending += 1
                self.layouts_sent += 1
        outer: Future[list[Change]] = Future()
        inner = self._pool.submit(_in_worker, key, layout if send else None, raw, op)
        inner.add_done_callback(partial(self._done, outer, key, send, transcode, raw, op))
        return outer

    def _done(
        self,
        outer: Future[list[Change]],
        key: bytes,
        sent: bool,
        transcode: RowsTranscoder,
        raw: bytes,
        op: int,
        inner: Future[tuple[int, list[Change] | None]],
    ) -> None:
        """``inner`` (a worker's answer) is done: ``outer`` gets its changes."""
        answered = not inner.cancelled() and inner.exception() is None
        pid, changes = inner.result() if answered else (0, None)
        with self._lock:
            held = self._holders.get(key)
            if held is not None:
                held.sending = max(0, held.sending - sent)  # (an id forgotten meanwhile)
                if answered and changes is None:
                    held.pids.discard(pid)
                elif answered:
                    held.pids.add(pid)
            if answered and changes is None:
                self.misses += 1
        if inner.cancelled():
            outer.cancel()
            outer.set_running_or_notify_cancel()
            return
        exc = inner.exception()
        if exc is not None:
            outer.set_exception(exc)
            return
        if changes is None:  # the worker lacks the layout: transcoded here, off this thread
            _fallback().submit(_transcode_into, outer, transcode, raw, op)
            return
        outer.set_result(changes)


_FALLBACK: list[ThreadPoolExecutor] = []
_FALLBACK_LOCK = threading.Lock()


def _fallback() -> ThreadPoolExecutor:
    """The thread (one per process, made on first use) transcoding the events a worker
    lacked the layout of: the process pool's own thread calls the futures' callbacks
    between handing out work and collecting results, and must not transcode."""
    with _FALLBACK_LOCK:
        if not _FALLBACK:
            _FALLBACK.append(ThreadPoolExecutor(1, thread_name_prefix="mysql-decode-fallback"))
        return _FALLBACK[0]


def _transcode_into(
    outer: Future[list[Change]], transcode: RowsTranscoder, raw: bytes, op: int
) -> None:
    try:
        changes = transcode_changes(transcode, raw, op)
    except BaseException as e:  # noqa: BLE001 - the future's consumer raises it
        outer.set_exception(e)
        return
    outer.set_result(changes)
