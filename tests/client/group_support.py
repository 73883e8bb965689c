"""What the in-loop consumer-group tests share: the group's config, a plain consumer's
view of the relay, the bucket of an event, and a :class:`Recorder` checking what the
members deliver (each unit's windows in SCN order, each event in its key's unit)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from changebus.client import (
    Consumer,
    ConsumerConfig,
    Window,
)
from changebus.relay import Relay
from changebus.schemas import RowEncoder, Unit, key_hash

MakeRelay = Callable[..., AbstractAsyncContextManager[Relay]]
FAST: dict[str, Any] = {"wait_s": 0.3, "backoff_initial_s": 0.01, "backoff_max_s": 0.05}
BUCKETS = 16


def group_config(relay: Relay, zk: str, group: str, **kw: Any) -> ConsumerConfig:
    return ConsumerConfig(
        relays=(relay.url,),
        **{
            "partition": "syn",
            "group": group,
            "zookeeper": zk,
            "buckets": BUCKETS,
            "zookeeper_session_timeout_s": 2.0,
            "commit_interval_s": 0.1,
            **FAST,
            **kw,
        },
    )


def new_group() -> str:
    return f"g{uuid.uuid4().hex[:10]}"


def bucket_of(event: Any, buckets: int = BUCKETS) -> int:
    """The bucket of an event's key, computed the way the fetcher hashed it."""
    if not event.key:
        return 0
    encoder = RowEncoder(event.schema, source_id=event.source_id)
    return key_hash(encoder._key_bytes(event.key)) % buckets


async def everything(relay: Relay) -> set[tuple[int, int]]:
    """What a plain consumer reads: every event of the relay, by (scn, seq)."""
    seen: set[tuple[int, int]] = set()
    cfg = ConsumerConfig(relays=(relay.url,), partition="syn", **FAST)
    target = relay.hosts["syn"].buffer.meta.last_scn
    async with Consumer(cfg) as c:
        async for window in c:
            seen.update(e.dedupe_key for e in window.events)
            if window.scn >= target:
                break
    return seen


class Recorder:
    """Delivered windows of several members, checked as they come."""

    def __init__(self, buckets: int = BUCKETS) -> None:
        self.buckets = buckets
        self.keys: list[tuple[int, int]] = []
        self.last_scn: dict[str, int] = {}
        self.by_member: dict[str, list[Window]] = defaultdict(list)
        self.errors: list[str] = []

    def take(self, member: str, window: Window) -> None:
        unit = Unit.parse(window.unit)
        if window.scn <= self.last_scn.get(window.unit, -1) and not self._replay_ok:
            self.errors.append(
                f"{window.unit}: SCN {window.scn} after {self.last_scn[window.unit]}"
            )
        self.last_scn[window.unit] = max(window.scn, self.last_scn.get(window.unit, -1))
        for event in window.events:
            bucket = bucket_of(event, self.buckets)
            if bucket != unit.bucket:
                self.errors.append(f"event {event.dedupe_key} of bucket {bucket} in {unit}")
        self.keys.extend(e.dedupe_key for e in window.events)
        self.by_member[member].append(window)

    _replay_ok = False

    def distinct(self) -> set[tuple[int, int]]:
        return set(self.keys)


@asynccontextmanager
async def iterating(
    consumer: Consumer, name: str, rec: Recorder
) -> AsyncIterator[asyncio.Task[None]]:
    async def loop() -> None:
        async for window in consumer:
            rec.take(name, window)

    task = asyncio.create_task(loop())
    try:
        yield task
    finally:
        consumer.stop()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
        await consumer.close()
