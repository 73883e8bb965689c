"""Fixtures of the client tests: real relays on 127.0.0.1, started in-process.

* ``make_relay(**options)`` -- an async context manager starting a relay with
  the synthetic fetcher (options as in ``SyntheticConfig``) on a free port;
* ``scripted_relay(windows)`` -- a relay fed by a fetcher that serves exactly
  the given encoded windows (``ScriptedWindow``), for streams with schema
  changes, data loss and hand-made rows;
* ``wait_windows(relay, n)`` -- wait until the relay holds ``n`` windows.

Everything started is stopped when the ``async with`` block ends.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from changebus.fetchers import ResumePoint, Window, register_fetcher
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.schemas import (
    DataLoss,
    EndOfWindow,
    Op,
    RowEncoder,
    SchemaChange,
    TableSchema,
    encode_control,
)

SYNTHETIC: dict[str, Any] = {
    "windows_per_s": 0,
    "max_windows": 300,
    "events_per_window": 3,
    "row_bytes": 60,
    "tables": 2,
    "keys": 1000,
}


@dataclass
class ScriptedWindow:
    """One window to serve: row changes of registered tables, plus control signals.

    ``rows`` items are ``(table, source_id, op, after, before)``; tables must be
    registered schemas (version set). ``announce`` lists ``(source_id, table)``
    to send as SCHEMA_CHANGE first.
    """

    scn: int
    rows: list[tuple[TableSchema, int, Op, dict[str, Any] | None, dict[str, Any] | None]] = field(
        default_factory=list
    )
    announce: list[tuple[int, TableSchema]] = field(default_factory=list)
    loss: DataLoss | None = None

    def encode(self, partition_id: int) -> Window:
        ts = time.time_ns()
        events: list[bytes] = []
        for sid, table in self.announce:
            change = SchemaChange(
                sid,
                table.name,
                table.version,
                table.fingerprint,
                json.dumps(table.to_json(), separators=(",", ":")),
            )
            events.append(encode_control(change, self.scn, len(events), ts, partition=partition_id))
        if self.loss is not None:
            events.append(
                encode_control(self.loss, self.scn, len(events), ts, partition=partition_id)
            )
        for table, sid, op, after, before in self.rows:
            enc = RowEncoder(table, source_id=sid, partition=partition_id)
            events.append(enc.encode(op, self.scn, len(events), ts, after, before))
        events.append(
            encode_control(
                EndOfWindow(len(self.rows), f"script:{self.scn}"),
                self.scn,
                len(events),
                ts,
                partition=partition_id,
            )
        )
        return Window(self.scn, ts, b"".join(events), len(events), f"script:{self.scn}")


_SCRIPTS: dict[str, Sequence[ScriptedWindow]] = {}
_script_ids = itertools.count()


class ScriptedFetcher:
    """Serves a prepared list of windows, then finishes."""

    def __init__(self, name: str, partition_id: int, options: Mapping[str, Any]) -> None:
        self.name = name
        self._partition_id = partition_id
        self._script = _SCRIPTS[str(options["script"])]
        self._after = -1

    async def start(self, resume: ResumePoint) -> int:
        self._after = resume.scn
        return max(resume.scn, self._script[0].scn - 1)

    async def windows(self) -> AsyncIterator[Window]:
        for w in self._script:
            if w.scn > self._after:
                yield w.encode(self._partition_id)

    async def acknowledge(self, scn: int) -> None:
        return None

    async def close(self) -> None:
        return None

    def status(self) -> dict[str, Any]:
        return {"kind": "client-script"}


register_fetcher("client-script", ScriptedFetcher)


def _config(data_dir: Path, kind: str, options: dict[str, Any], capacity_bytes: int) -> RelayConfig:
    return RelayConfig(
        data_dir=data_dir,
        http=HttpConfig(port=0, max_wait_s=10),
        partitions=(
            PartitionConfig(
                "syn", 1, capacity_bytes=capacity_bytes, fetcher=FetcherConfig(kind, options)
            ),
        ),
        flush_interval_s=0,
    )


async def wait_for_windows(relay: Relay, n: int, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while relay.hosts["syn"].buffer.meta.windows < n and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert relay.hosts["syn"].buffer.meta.windows >= n


MakeRelay = Callable[..., AbstractAsyncContextManager[Relay]]


@pytest.fixture
def make_relay(tmp_path: Path) -> MakeRelay:
    """``async with make_relay(max_windows=..., ...) as relay`` (synthetic source)."""
    counter = itertools.count()

    @asynccontextmanager
    async def factory(
        *, capacity_bytes: int = 4 << 20, wait: bool = True, **options: Any
    ) -> AsyncIterator[Relay]:
        opts = {**SYNTHETIC, **options}
        cfg = _config(tmp_path / f"relay{next(counter)}", "synthetic", opts, capacity_bytes)
        async with Relay(cfg) as relay:
            if wait and opts["max_windows"]:
                await wait_for_windows(relay, min(opts["max_windows"], 1))
                while relay.hosts["syn"].state != "finished":
                    await asyncio.sleep(0.01)
            yield relay

    return factory


ScriptedRelay = Callable[[Sequence[ScriptedWindow]], AbstractAsyncContextManager[Relay]]


@pytest.fixture
def scripted_relay(tmp_path: Path) -> ScriptedRelay:
    """``async with scripted_relay([ScriptedWindow(...), ...]) as relay``."""

    @asynccontextmanager
    async def factory(windows: Sequence[ScriptedWindow]) -> AsyncIterator[Relay]:
        name = f"s{next(_script_ids)}"
        _SCRIPTS[name] = windows
        cfg = _config(tmp_path / name, "client-script", {"script": name}, 4 << 20)
        try:
            async with Relay(cfg) as relay:
                await wait_for_windows(relay, len(windows))
                yield relay
        finally:
            del _SCRIPTS[name]

    return factory


@pytest.fixture
def wait_windows() -> Callable[[Relay, int], Awaitable[None]]:
    return wait_for_windows


@pytest.fixture
def window_type() -> type[ScriptedWindow]:
    """The :class:`ScriptedWindow` class (tests cannot import conftest)."""
    return ScriptedWindow
