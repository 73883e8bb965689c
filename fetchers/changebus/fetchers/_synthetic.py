"""A synthetic fetcher: generated transactions for demos, tests and benchmarks.

It behaves like a real source: windows in increasing SCN order, a
SCHEMA_CHANGE event for every table before its first row, inserts, updates
and deletes over a bounded key space, and resumption after the relay's last
SCN. Generation (Avro encoding) runs in a thread behind a bounded queue.

Options (relay config ``[partitions.fetcher]`` table, kind ``"synthetic"``):
see :class:`SyntheticConfig`.
"""

from __future__ import annotations

import json
import random
import string
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from changebus.schemas import (
    Column,
    EndOfWindow,
    Op,
    RowEncoder,
    SchemaChange,
    SchemaRegistry,
    TableSchema,
    encode_control,
)
from changebus.schemas.config import load_config_dict

from ._base import ResumePoint, Window
from ._threadfeed import ThreadFeed

__all__ = ["SyntheticConfig", "SyntheticFetcher", "fetcher_factory"]


@dataclass(frozen=True)
class SyntheticConfig:
    """Workload shape. Rates per second, sizes in bytes."""

    #: windows generated per second; 0 = as fast as possible
    windows_per_s: float = 100.0
    events_per_window: int = 5
    row_bytes: int = 200
    tables: int = 2
    #: the first table is ``synthetic.t<first_table>`` (two relays with other tables)
    first_table: int = 0
    keys: int = 100_000
    key_distribution: Literal["uniform", "sequential"] = "uniform"
    #: share of changes to existing keys that are updates / deletes
    update_ratio: float = 0.3
    delete_ratio: float = 0.05
    #: stop after this many windows (0 = never)
    max_windows: int = 0
    start_scn: int = 1000
    seed: int = 1

    def __post_init__(self) -> None:
        if self.windows_per_s < 0 or self.events_per_window < 0 or self.row_bytes < 0:
            raise ValueError("rates and sizes must not be negative")
        if not 1 <= self.tables <= 1000 or self.keys < 1:
            raise ValueError("tables must be 1..1000 and keys >= 1")
        if self.first_table < 0:
            raise ValueError("first_table must not be negative")
        if not 0 <= self.update_ratio + self.delete_ratio <= 1:
            raise ValueError("update_ratio + delete_ratio must be within 0..1")


def synthetic_table(index: int) -> TableSchema:
    """The schema of synthetic table ``index``."""
    return TableSchema(
        f"synthetic.t{index}",
        (
            Column("id", "long", nullable=False, source_type="bigint"),
            Column("n", "long", source_type="bigint"),
            Column("payload", "string", source_type="text"),
        ),
        key=("id",),
    )


class SyntheticFetcher:
    """Generates windows; see the module docstring."""

    def __init__(self, name: str, partition_id: int, config: SyntheticConfig) -> None:
        self.name = name
        self.partition_id = partition_id
        self.config = config
        self._registry = SchemaRegistry()
        self._tables = [
            self._registry.register(synthetic_table(config.first_table + i))
            for i in range(config.tables)
        ]
        self._encoders = [
            RowEncoder(t, source_id=self._registry.source_id(t.name), partition=partition_id)
            for t in self._tables
        ]
        self._next_scn = config.start_scn
        self._feed: ThreadFeed[Window] | None = None
        self.acknowledged = -1
        self.generated = 0

    async def start(self, resume: ResumePoint) -> int:
        self._next_scn = max(self.config.start_scn, resume.scn + 1)
        return self._next_scn - 1

    def _produce(self, emit: Callable[[Window], None], stopping: threading.Event) -> None:
        cfg = self.config
        rnd = random.Random(cfg.seed ^ self._next_scn)
        alphabet = string.ascii_letters + string.digits
        filler = "".join(rnd.choices(alphabet, k=max(cfg.row_bytes, 1) * 2))
        live: list[set[int]] = [set() for _ in self._tables]
        seq_key = 0
        interval = 1.0 / cfg.windows_per_s if cfg.windows_per_s else 0.0
        next_at = time.monotonic()
        announce = True
        while not stopping.is_set() and (cfg.max_windows == 0 or self.generated < cfg.max_windows):
            scn = self._next_scn
            ts = time.time_ns()
            events: list[bytes] = []
            if announce:
                for t, enc in zip(self._tables, self._encoders, strict=True):
                    change = SchemaChange(
                        enc.source_id,
                        t.name,
                        t.version,
                        t.fingerprint,
                        json.dumps(t.to_json(), separators=(",", ":")),
                    )
                    events.append(
                        encode_control(change, scn, len(events), ts, partition=self.partition_id)
                    )
                announce = False
            for _ in range(cfg.events_per_window):
                ti = rnd.randrange(len(self._tables))
                keys = live[ti]
                roll = rnd.random()
                if keys and roll < cfg.delete_ratio:
                    key = rnd.choice(tuple(keys)) if len(keys) < 4096 else next(iter(keys))
                    keys.discard(key)
                    op, after, before = Op.DELETE, None, {"id": key, "n": None, "payload": None}
                else:
                    if cfg.key_distribution == "sequential":
                        key, seq_key = seq_key % cfg.keys, seq_key + 1
                    else:
                        key = rnd.randrange(cfg.keys)
                    op = Op.UPDATE if key in keys else Op.INSERT
                    keys.add(key)
                    start = rnd.randrange(len(filler) - cfg.row_bytes + 1)
                    after = {"id": key, "n": scn, "payload": filler[start : start + cfg.row_bytes]}
                    before = None
                events.append(self._encoders[ti].encode(op, scn, len(events), ts, after, before))
            events.append(
                encode_control(
                    EndOfWindow(cfg.events_per_window, f"synthetic:{scn}"),
                    scn,
                    len(events),
                    ts,
                    partition=self.partition_id,
                )
            )
            emit(
                Window(
                    scn,
                    ts,
                    b"".join(events),
                    len(events),
                    f"synthetic:{scn}",
                    # framed here by changebus's encoders: the relay's trusted path
                    event_sizes=tuple(map(len, events)),
                )
            )
            self._next_scn = scn + 1
            self.generated += 1
            if interval:
                next_at += interval
                delay = next_at - time.monotonic()
                if delay > 0:
                    stopping.wait(delay)
                elif delay < -1.0:
                    next_at = time.monotonic()  # fell behind: do not burst

    def window_feed(self) -> ThreadFeed[Window]:
        """Start generating; the windows as a queue (see :class:`WindowFeed`)."""
        self._feed = ThreadFeed(self._produce, maxsize=256, name=f"synthetic-{self.name}")
        return self._feed

    async def windows(self) -> AsyncIterator[Window]:
        async for window in self.window_feed().items():
            yield window

    async def acknowledge(self, scn: int) -> None:
        self.acknowledged = max(self.acknowledged, scn)

    async def close(self) -> None:
        if self._feed is not None:
            await self._feed.close()

    def status(self) -> dict[str, Any]:
        return {
            "kind": "synthetic",
            "generated_windows": self.generated,
            "acknowledged_scn": self.acknowledged,
        }


def fetcher_factory(name: str, partition_id: int, options: Mapping[str, Any]) -> SyntheticFetcher:
    """Build a ``synthetic`` fetcher (the kind's entry in the ``changebus.fetchers`` group)."""
    return SyntheticFetcher(
        name, partition_id, load_config_dict(SyntheticConfig, options, "fetcher")
    )
