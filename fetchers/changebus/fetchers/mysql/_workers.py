"""Decode worker processes: rows events transcoded while the stream reads on.

:func:`start_workers` starts them (spawned: the relay has threads) and warms
them up; the assembler submits :func:`transcode_changes` to them, one rows
event each, and keeps the futures in the transaction until its window is
made (in the fetcher's thread it calls the function directly).
"""

from __future__ import annotations

import logging
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from ._layout import RowsTranscoder, TableLayout, compile_transcoder

__all__ = ["start_workers", "transcode_changes"]

log = logging.getLogger("changebus.fetchers.mysql")


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


#: transcoders in a decode worker process, by the layout's repr (bounded)
_WORKER_TRANSCODERS: dict[str, RowsTranscoder] = {}


def transcode_changes(
    layout: TableLayout,
    raw: bytes,
    op: int,
    start: int = 0,
    end: int = -1,
    transcode: RowsTranscoder | None = None,
) -> list[tuple[int, bytes, bytes | None, bytes | None, Any, Any]]:
    """Row changes of one rows event, ready for :meth:`RowEncoder.encode_many_encoded`.

    In the fetcher's thread ``transcode`` is the table's; in a decode worker
    process it is compiled from ``layout`` on first use and cached.
    """
    if transcode is None:
        key = repr(layout)
        transcode = _WORKER_TRANSCODERS.get(key)
        if transcode is None:
            if len(_WORKER_TRANSCODERS) > 1024:
                _WORKER_TRANSCODERS.clear()
            transcode = _WORKER_TRANSCODERS[key] = compile_transcoder(layout)
    images = transcode(raw, start, len(raw) if end < 0 else end)
    if op == 1:
        return [(1, k, r, None, ns or (), ()) for k, r, ns in images]
    if op == 3:
        return [(3, k, None, r, (), ns or ()) for k, r, ns in images]
    out: list[tuple[int, bytes, bytes | None, bytes | None, Any, Any]] = []
    append = out.append
    for (bk, b, bns), (ak, a, ans) in zip(images[0::2], images[1::2], strict=True):
        append((2, ak, a, b, ans or (), bns or ()))
        if bk != ak:  # a key-changing update: the old key's delete follows (routed by it)
            append((3, bk, None, b, (), bns or ()))
    return out
