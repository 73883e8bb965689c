"""Decode workers: what a rows event costs does not grow with its table's layout.

Every rows event pickled the table's whole layout to a worker, which took
``repr(layout)`` as its cache key (15 KB and 0.6 ms an event for 500 columns),
and the worker's cache was cleared whole past 1,024 layouts, so a server
cycling through more tables recompiled at every event (found by review). An
event now carries a 16-byte layout id; the layout goes along only while some
worker may lack it, and a worker that lacks it anyway (evicted) answers so and
the parent transcodes that event itself. Counted, not timed.
"""

from __future__ import annotations

import pickle
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
from test_mysql_announce import binlog_of
from test_mysql_fetcher import execute
from test_mysql_oversized import feed

from changebus.fetchers.mysql import BinlogAssembler, DeclaredTypes, EmbeddedMariaDB, _workers
from changebus.fetchers.mysql._columns import T_LONG, ColumnLayout, TableLayout
from changebus.fetchers.mysql._layout import compile_transcoder, layout_from_table_map
from changebus.fetchers.mysql._workers import start_workers
from changebus.schemas import SchemaRegistry

_COLUMNS = 150


def _feed(assembler: BinlogAssembler, events: list[Any]) -> list[Any]:
    """The windows (or pending windows) ``events`` make."""
    return [w for w in (feed(assembler, e) for e in events) if w is not None]


def _wide_table_events(server: EmbeddedMariaDB, db: str) -> list[Any]:
    """One transaction of 30 rows events (inserts, updates, deletes) on a wide table."""
    cols = ", ".join(f"c{i} varchar(12)" for i in range(_COLUMNS))
    execute(server, db, f"CREATE TABLE w (id int PRIMARY KEY, {cols}) CHARSET latin1")
    values = ", ".join(f"'v{i}'" for i in range(_COLUMNS))
    events: list[Any] = binlog_of(
        server,
        db,
        "BEGIN",
        *(f"INSERT INTO w VALUES ({r}, {values})" for r in range(10)),
        *(f"UPDATE w SET c7 = 'u{r}' WHERE id = {r}" for r in range(10)),
        *(f"DELETE FROM w WHERE id = {r}" for r in range(10)),
        "COMMIT",
    )
    return events


@pytest.mark.mysql
def test_rows_events_carry_a_layout_id_not_the_layout(
    mysql_server: EmbeddedMariaDB, mysql_db: str
) -> None:
    events = _wide_table_events(mysql_server, mysql_db)
    (expected,) = _feed(
        BinlogAssembler(1, SchemaRegistry(), DeclaredTypes(), databases=(mysql_db,)), events
    )
    pool = start_workers(1, "layout-ids")
    sizes: list[int] = []  # pickled bytes of each submit, besides the event's own
    submit = pool.submit

    def recording(fn: Any, /, *args: Any) -> Future[Any]:
        size = len(pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL))
        sizes.append(size - sum(len(a) for a in args if isinstance(a, bytes)))
        return submit(fn, *args)

    try:
        pool.submit = recording  # type: ignore[method-assign,assignment]
        assembler = BinlogAssembler(
            1, SchemaRegistry(), DeclaredTypes(), databases=(mysql_db,), pool=pool
        )
        (pending,) = _feed(assembler, events)
        window = pending.resolve()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    assert window.data == expected.data  # the same window as transcoded in this thread
    layout = next(iter(assembler._tables.latest.values())).layout
    layout_bytes = len(pickle.dumps(layout, protocol=pickle.HIGHEST_PROTOCOL))
    assert len(sizes) == 30 and layout_bytes > 5000
    # the layout went once (one worker); each other event: its bytes and under 300
    assert sum(s > layout_bytes for s in sizes) == 1, sizes
    assert max(sorted(sizes)[:-1]) < 300, sizes


@pytest.mark.mysql
def test_a_worker_lacking_the_layout_gives_the_same_changes(
    mysql_server: EmbeddedMariaDB, mysql_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Here the "worker" is a thread of this process, whose cache is emptied between
    events (as a worker evicting the layout): the event it lacks the layout for is
    transcoded by the parent, and the next one carries the layout again."""
    from changebus.fetchers.mysql._workers import WorkerDispatch, layout_id

    events = _wide_table_events(mysql_server, mysql_db)
    table_map = next(e for e in events if type(e).__name__ == "TableMapEvent")
    rows = next(e for e in events if type(e).__name__ == "UpdateRowsEvent")
    layout = layout_from_table_map(table_map)
    transcode = compile_transcoder(layout)
    data = rows.packet.packet._data
    raw = bytes(data[rows.packet.packet._position : len(data) - 4])
    expected = _workers.transcode_changes(transcode, raw, 2)
    assert len(expected) == 1
    monkeypatch.setattr(_workers, "_WORKER_TRANSCODERS", type(_workers._WORKER_TRANSCODERS)())
    with ThreadPoolExecutor(1) as pool:
        dispatch = WorkerDispatch(pool, 1)
        key = layout_id(layout)
        first = dispatch.submit(key, layout, transcode, raw, 2).result()
        assert (dispatch.layouts_sent, dispatch.misses) == (1, 0)
        _workers._WORKER_TRANSCODERS.clear()
        threads: list[str] = []

        def watched(buf: bytes, start: int, end: int) -> Any:
            threads.append(threading.current_thread().name)
            return transcode(buf, start, end)

        lacked = dispatch.submit(key, layout, watched, raw, 2).result()
        assert (dispatch.layouts_sent, dispatch.misses) == (1, 1)
        # (transcoded on a thread of its own, not the pool's, which collects results)
        assert len(threads) == 1 and threads[0].startswith("mysql-decode-fallback")
        again = dispatch.submit(key, layout, transcode, raw, 2).result()
        assert (dispatch.layouts_sent, dispatch.misses) == (2, 1)
        dispatch.submit(key, layout, transcode, raw, 2).result()
        assert (dispatch.layouts_sent, dispatch.misses) == (2, 1)
    assert first == lacked == again == expected


def _layout(n: int) -> TableLayout:
    return TableLayout(
        "db",
        f"t{n}",
        (ColumnLayout("id", T_LONG, False, False, "", (), (), "int", "int"),),
        ("id",),
    )


def test_the_worker_cache_evicts_the_least_recently_used_layout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A layout used between every two others stays compiled while more layouts than
    the cache holds go through it (the cache was cleared whole when full)."""
    from changebus.fetchers.mysql._workers import layout_id

    monkeypatch.setattr(_workers, "WORKER_LAYOUTS", 8)
    monkeypatch.setattr(_workers, "_WORKER_TRANSCODERS", type(_workers._WORKER_TRANSCODERS)())
    compiled: list[str] = []

    def counting(layout: TableLayout) -> Any:
        compiled.append(layout.table)
        return compile_transcoder(layout)

    monkeypatch.setattr(_workers, "compile_transcoder", counting)
    hot, cold = _layout(0), [_layout(n) for n in range(1, 41)]
    hot_id = layout_id(hot)
    for layout in cold:
        assert _workers._in_worker(hot_id, hot, b"", 1)[1] == []
        assert _workers._in_worker(layout_id(layout), layout, b"", 1)[1] == []
    assert compiled.count("t0") == 1 and len(compiled) == 41
    assert len(_workers._WORKER_TRANSCODERS) == 8
    # eight layouts going round: compiled once each
    compiled.clear()
    for _ in range(3):
        for layout in cold[:8]:
            _workers._in_worker(layout_id(layout), layout, b"", 1)
    assert len(compiled) <= 8
