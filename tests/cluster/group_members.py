"""What the consumer-group tests share: a ``Follower`` that acquires and releases as a
consumer does, and the checks of an even, settled assignment (the fixtures that make
members are in conftest.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from changebus.cluster import CoordinationError, GroupMember
from changebus.schemas import Unit

TIMEOUT_S = 1.5
ROOT = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = ("schemas", "cluster", "fetchers", "relay", "bootstrap", "client", "discovery")


class Follower:
    """What a consumer does with its member: acquire the target's units, release the others."""

    def __init__(self, member: GroupMember) -> None:
        self.member = member
        self.lost: list[frozenset[Unit]] = []
        self.targets: list[frozenset[Unit]] = []
        self._acquiring: dict[Unit, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        member.on_target(self._retarget)
        member.on_lost(self.lost.append)

    def _spawn(self, coro: Awaitable[None]) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _retarget(self, target: frozenset[Unit]) -> None:
        self.targets.append(target)
        for unit, task in list(self._acquiring.items()):
            if unit not in target:
                task.cancel()
                del self._acquiring[unit]
        gone = self.member.owned - target
        if gone:
            self._spawn(self.member.release(gone))
        for unit in target - self.member.owned:
            if unit not in self._acquiring or self._acquiring[unit].done():
                self._acquiring[unit] = self._spawn(self._acquire(unit))

    async def _acquire(self, unit: Unit) -> None:
        with contextlib.suppress(CoordinationError):
            await self.member.acquire(unit)

    @property
    def settled(self) -> bool:
        return bool(self.member.member_id) and self.member.owned == self.member.target

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task


MemberFactory = Callable[..., Awaitable[tuple[GroupMember, Follower]]]


def check_even(members: Sequence[GroupMember], units: Sequence[Unit]) -> bool:
    """Targets disjoint, covering ``units``, each floor or ceil of U/M, and owned as targeted."""
    targets = [m.target for m in members]
    flat = [u for t in targets for u in t]
    if sorted(flat) != sorted(units) or len(flat) != len(set(flat)):
        return False
    base = len(units) // len(members)
    return all(len(t) in (base, base + 1) for t in targets)


def settled(pairs: Sequence[tuple[GroupMember, Follower]]) -> bool:
    members = [m for m, _ in pairs]
    return check_even(members, members[0].units) and all(f.settled for _, f in pairs)
