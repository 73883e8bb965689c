"""A stop while a SQLite store call runs long: the call is interrupted after
``store.stop_grace_s`` and the threads close.

Before, only a Postgres store's calls could be cut; a long SQLite statement
(a scan of a huge table, a slow disk) kept ``StoreThreads.close`` returning
with the call still running, and the store's connection open for ever.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

import pytest

from changebus.bootstrap import BootstrapConfig, StoreConfig
from changebus.bootstrap._store import Store
from changebus.bootstrap._storethreads import StoreThreads

#: a statement that runs for minutes: counts to 10^10 in a recursive CTE
_FOREVER = (
    "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 10000000000)"
    " SELECT count(*) FROM n"
)


def _forever(store: Store) -> int:
    return int(store._one(_FOREVER)[0])


async def test_a_long_sqlite_call_is_interrupted_by_a_stop(tmp_path: Path) -> None:
    cfg = BootstrapConfig(
        relays=("http://127.0.0.1:1",),
        data_dir=tmp_path / "boot",
        store=StoreConfig(kind="sqlite", stop_grace_s=0.3),
    )
    threads = StoreThreads(cfg)
    call = asyncio.ensure_future(threads.write(_forever))
    reading = asyncio.ensure_future(threads.read(_forever))
    await asyncio.sleep(0.5)  # (both calls run their statement)
    assert not call.done() and not reading.done()
    began = time.monotonic()
    await asyncio.to_thread(threads.close)
    took = time.monotonic() - began
    assert took < 5, took  # the grace, then the interrupt ends both calls
    for fut in (call, reading):
        with pytest.raises(sqlite3.OperationalError, match="interrupt"):
            await asyncio.wait_for(fut, 5)
    assert threads._in_call == {} and threads._opened == []  # every connection closed
