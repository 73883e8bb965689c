"""Follow streams at the tail: one push, copied once, written to every caught-up follower.

A follow stream that has sent everything there is (its position is the
partition's tail) parks here instead of waiting in its own task
(:meth:`TailBroadcast.park`). When new windows are published, the
broadcast takes, for each group of parked streams that asked for the same
thing (``max_bytes``, filter, sources) at the same position, one selection
and one checked copy (shared through the response cache like any push), frames
it as one HTTP chunk, and writes that chunk to each stream's transport
itself: no task wakes, no timer, no drain per follower and push. With a
thousand followers that is the difference between a few microseconds and
some fifty per push (docs/benchmarks.md, issue 23).

A stream goes back to its task (the future :meth:`park` returns) when the
task has work only it can do:

* ``"drain"``: a write left bytes in the transport (a slow reader); the task
  waits for them under its send watch, then carries on;
* ``"budget"``: it sent ``follow_bytes``; the task ends the response;
* ``"idle"``: nothing new for ``wait`` seconds (checked every
  :data:`SWEEP_S`); the task ends the response;
* ``"closed"``: the connection is closing (seen at a push or a sweep);
* ``"task"``: the push could not be made here (too large for one chunk, an
  error while selecting, the buffer restarted); the task retries it on the
  ordinary path, which reports any error.

Cadence: wake-ups of the partition (:meth:`PartitionHost.add_wake_listener`)
are coalesced into broadcasts at least ``min(n * TICK_PER_STREAM_S,
MAX_TICK_S)`` apart for ``n`` parked streams: each broadcast writes to every
stream, so the system calls per second stay bounded (a thousand followers
get a push every 20 ms, each carrying some 20 windows) while few followers
get every window at once. A push is at most :data:`PUSH_BYTES`, or more
while the relay has only a few follow streams (:meth:`TailBroadcast._push_cap`):
that only matters behind the tail, where a lone follower catching up then
takes 1 MiB pushes instead of sixteen times as many small ones.

Invariants: a parked stream's ``scn``/``offset`` is the position after the
last byte written to its transport, and it is in exactly one group, the one of
that position. Every push written here is a whole chunk, so the response
stays well-formed whatever the task writes next.

Event loop only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web

from changebus.schemas import ChangebusError, PartitionFilter
from changebus.schemas.server import CopyBudget

from ._host import PartitionHost
from ._metrics import RelayMetrics
from ._respcache import CachedResponse, ResponseCache
from ._respond import copy_out
from ._send import PIECE_BYTES

__all__ = ["MAX_TICK_S", "PUSH_BYTES", "SWEEP_S", "TICK_PER_STREAM_S", "Parked", "TailBroadcast"]

log = logging.getLogger("changebus.relay.http")

#: broadcasts are at least this much apart per parked stream ...
TICK_PER_STREAM_S = 0.0001
#: ... and at most this much (the latency a parked follower may gain)
MAX_TICK_S = 0.02
#: how often parked streams are checked for their idle time
SWEEP_S = 0.1
#: the largest broadcast push: about what a follow socket's send buffer takes at once
#: (``_follow._FOLLOW_SNDBUF``), so that a write normally leaves nothing in the transport,
#: where each stream would hold its own copy of the rest
PUSH_BYTES = 64 * 1024
#: pushes beyond PUSH_BYTES may leave at most 1/_SPARE_SHARE of the copy budget's spare
#: bytes unsent in transports (see TailBroadcast._push_cap)
_SPARE_SHARE = 8
#: ... and only while the relay has at most this many follow streams (parked or draining)
_FEW_STREAMS = 16
#: a parked consumer is reported to the host's consumer list at most this often
SEEN_S = 1.0
#: the event loop time one broadcast pass takes at most before it yields (s): the
#: groups it did not reach go first in the next pass, which runs at once after
PASS_S = 0.005

Why = Literal["drain", "budget", "idle", "closed", "task"]


@dataclass(eq=False)
class Parked:
    """One follow stream's state while it is parked (the task's, handed over and back)."""

    request: web.Request
    transport: asyncio.Transport
    max_bytes: int
    filter_text: str | None
    key_filter: PartitionFilter | None
    sources: frozenset[int] | None
    client: str
    scn: int
    offset: int
    #: bytes sent on this response, and the most it may send
    sent: int
    budget: int
    wait: float
    idle_until: float
    future: asyncio.Future[Why] = field(init=False)
    #: when the host last heard of this consumer from here (``saw_consumer``)
    seen_at: float = 0.0
    #: handed back to its task (out of every group)
    released: bool = False
    #: where the scan of a window longer than a scan got to, for the group this stream
    #: leads (-1: none; see ``EventBuffer.select``'s ``skip_to``)
    resume_at: int = -1
    #: the broadcast's number of the last visit of this stream's group, or of the last
    #: push that reached it (0: none yet): a pass serves the lowest first
    pushed: int = 0

    @property
    def key(self) -> tuple[Any, ...]:
        """What the stream asked for: streams with the same key get the same pushes."""
        return (self.max_bytes, self.filter_text, self.sources)


class TailBroadcast:
    """The parked follow streams of one partition (module docstring)."""

    def __init__(
        self,
        host: PartitionHost,
        cache: ResponseCache,
        copies: CopyBudget,
        metrics: RelayMetrics,
    ) -> None:
        self._host = host
        self._cache = cache
        self._copies = copies
        self._metrics = metrics
        #: key -> (scn, offset) -> parked streams
        self._groups: dict[tuple[Any, ...], dict[tuple[int, int], list[Parked]]] = {}
        self._count = 0
        self._tick: asyncio.Handle | None = None
        self._sweep: asyncio.TimerHandle | None = None
        self._last = 0.0
        self._pushes = 0  # pushes written so far (``Parked.pushed``: the order of a pass)
        self._loop = asyncio.get_running_loop()
        host.add_wake_listener(self._woken)

    def __len__(self) -> int:
        return self._count

    async def park(self, stream: Parked) -> Why:
        """Park ``stream`` until its task must take over again; why it must."""
        stream.future = self._loop.create_future()
        stream.released = False
        stream.resume_at = -1  # (parked at a position of its own, maybe a new one)
        self._add(stream)
        if self._sweep is None:
            self._sweep = self._loop.call_later(SWEEP_S, self._idle_sweep)
        self._woken()  # it may be behind the tail: look at the next tick
        try:
            return await stream.future
        finally:
            if not stream.released:  # the task was cancelled: forget the stream
                self._remove(stream)

    # ---- groups ---------------------------------------------------------

    def _add(self, stream: Parked) -> None:
        by_pos = self._groups.setdefault(stream.key, {})
        by_pos.setdefault((stream.scn, stream.offset), []).append(stream)
        self._counted(1)

    def _remove(self, stream: Parked) -> None:
        by_pos = self._groups.get(stream.key)
        if by_pos is None:
            return
        group = by_pos.get((stream.scn, stream.offset))
        if group is None or stream not in group:
            return
        group.remove(stream)
        self._counted(-1)
        if not group:
            del by_pos[(stream.scn, stream.offset)]
            self._forget_if_empty(stream.key, by_pos)

    def _forget_if_empty(self, key: tuple[Any, ...], by_pos: dict[Any, list[Parked]]) -> None:
        """Drop ``key`` once no stream asks for it (a client could grow the table otherwise)."""
        if not by_pos and self._groups.get(key) is by_pos:
            del self._groups[key]

    def _counted(self, delta: int) -> None:
        """``delta`` streams parked (or, negative, no longer): here and relay-wide."""
        self._count += delta
        self._copies.parked += delta

    def _release(self, stream: Parked, why: Why) -> None:
        """Hand ``stream`` back to its task (already out of its group)."""
        stream.released = True
        if not stream.future.done():
            stream.future.set_result(why)

    # ---- timing ---------------------------------------------------------

    def _woken(self) -> None:
        """The partition published windows: broadcast now, or at the next tick."""
        if not self._count or self._tick is not None:
            return
        at = self._last + min(self._count * TICK_PER_STREAM_S, MAX_TICK_S)
        if at <= self._loop.time():
            self._broadcast()
        else:
            self._tick = self._loop.call_at(at, self._broadcast)

    def _idle_sweep(self) -> None:
        """Release streams idle for their ``wait``, or whose connection closes (while any is parked)."""
        self._sweep = None
        now = time.monotonic()
        for by_pos in list(self._groups.values()):
            for group in list(by_pos.values()):
                for stream in [s for s in group if s.idle_until <= now]:
                    self._remove(stream)
                    self._release(stream, "idle")
                for stream in [s for s in group if s.transport.is_closing()]:
                    self._remove(stream)
                    self._release(stream, "closed")
        if self._count:
            self._sweep = self._loop.call_later(SWEEP_S, self._idle_sweep)

    # ---- the broadcast --------------------------------------------------

    def _broadcast(self) -> None:
        self._tick = None
        self._last = self._loop.time()
        cap = self._push_cap()  # (once per pass: see _push_cap)
        # groups at the newest window have nothing to get: skipped before a grant and a
        # select each (a pass made for a group behind the tail visited them all)
        tail = (self._host.buffer.meta.last_scn, -1)
        groups = [
            (by_pos, pos, group)
            for by_pos in self._groups.values()
            for pos, group in by_pos.items()
            if pos != tail
        ]
        # (one filtered select of groups behind costs up to milliseconds: a pass over
        # dozens of them in one callback starved long-polls, probes and ingest; review)
        # A pass yields after PASS_S; the groups pushed longest ago go first, so the next
        # pass, at once, starts with those it did not reach (by position in the list, a
        # group pushed moved behind them, and went first again: review)
        groups.sort(key=lambda g: g[2][0].pushed)
        deadline = time.perf_counter() + PASS_S
        for i, (by_pos, pos, group) in enumerate(groups):
            if i and time.perf_counter() > deadline:
                if self._tick is None:
                    self._tick = self._loop.call_soon(self._broadcast)
                return
            if by_pos.get(pos) is not group:
                continue  # (emptied meanwhile)
            # visited, pushed or not (a group scanning a long window it mostly filters out
            # stayed first, pass after pass, and the others waited: review)
            self._pushes += 1
            group[0].pushed = self._pushes
            self._push(by_pos, pos, group, cap)

    def _push(
        self,
        by_pos: dict[tuple[int, int], list[Parked]],
        pos: tuple[int, int],
        group: list[Parked],
        cap: int,
    ) -> None:
        """One push (at most ``cap``) to every stream of ``group`` (all at ``pos``), or back."""
        first = group[0]
        m = self._host.buffer.meta
        want = min(first.max_bytes, cap)
        cache_key = (*pos, want, first.filter_text, first.sources)
        cached = self._cache.get(m.tail_event, cache_key, m.head_pos)
        charged = self._copies.grant(want if cached is None else len(cached.body))
        try:
            if cached is None or charged < len(cached.body):
                try:
                    selection = self._host.buffer.select(
                        pos[0],
                        pos[1],
                        charged,
                        key_filter=first.key_filter,
                        sources=first.sources,
                        skip_to=first.resume_at,
                    )
                    if selection is None:
                        return  # nothing for this group's filter yet: stays parked
                    if selection.resume_at >= 0:
                        first.resume_at = selection.resume_at
                        # a window longer than a scan, nothing for this group so far: it
                        # stays parked and the next pass, soon, goes on where this one
                        # stopped (one scan for the group, not one per stream)
                        self._host.buffer.release(selection)
                        if self._tick is None:
                            self._tick = self._loop.call_soon(self._broadcast)
                        return
                    cached = copy_out(self._host, selection, self._metrics)
                except ChangebusError:
                    self._hand_back(by_pos, pos, "task")  # the task's own try reports it
                    return
                charged = self._copies.resize(charged, len(cached.body))
                self._cache.put(m.tail_event, cache_key, cached)
            if len(cached.body) > PIECE_BYTES:  # (one event larger than the cap)
                self._hand_back(by_pos, pos, "task")
                return
            self._write(by_pos, pos, group, cached)
        finally:
            self._copies.release(charged)

    def _push_cap(self) -> int:
        """The largest push of a pass: :data:`PUSH_BYTES`, more when few streams share the budget.

        A push only exceeds what is new at the tail for a group behind it (a
        follower catching up), and there a larger push costs less per byte at
        both ends. What a transport cannot send at once stays in it, uncharged
        until the stream's task takes it over (``_follow._drain``, which runs
        before this broadcast's next pass). In one pass a stream gets at most
        one push that leaves bytes behind (such a stream goes back to its
        task), so a pass leaves at most ``parked x cap`` bytes in transports.
        The cap is taken once per pass, over the streams parked in every
        partition (:attr:`CopyBudget.parked`), so that sum stays within an
        eighth of the copy budget's spare bytes, whatever the partitions'
        passes do in turn. Only a few streams (at most :data:`_FEW_STREAMS`,
        parked or draining a push) get more than ``PUSH_BYTES``: with larger
        pushes, a thousand followers that fell behind on a busy machine
        spread over many positions and took seconds to catch up
        (docs/benchmarks.md).
        """
        copies = self._copies
        # (streams draining a push hold a grant: they count, or a herd of slow readers,
        # most of them draining, would leave the few parked ones large pushes)
        streams = copies.parked + copies.holders
        if streams > _FEW_STREAMS:
            return PUSH_BYTES
        share = copies.spare() // (_SPARE_SHARE * max(1, streams))
        return max(PUSH_BYTES, min(PIECE_BYTES, share))

    def _write(
        self,
        by_pos: dict[tuple[int, int], list[Parked]],
        pos: tuple[int, int],
        group: list[Parked],
        push: CachedResponse,
    ) -> None:
        body = push.body
        size = len(body)
        # a push without events only moves the position (the filter kept none of what it
        # passed over): nothing is written, since an empty chunk would end the response
        frame = b"%x\r\n%b\r\n" % (size, body) if size else b""
        key = group[0].key
        del by_pos[pos]
        self._counted(-len(group))
        now = time.monotonic()
        moved: list[Parked] = []
        host = self._host
        reached = -1 if push.to_tail or push.start_pos < 0 else push.start_pos + size
        written = 0
        self._pushes += 1
        for stream in group:
            stream.pushed = self._pushes
            transport = stream.transport
            if transport.is_closing():
                self._release(stream, "closed")
                continue
            if frame:
                transport.write(frame)
                written += 1
            stream.scn, stream.offset = push.next_scn, push.next_offset
            stream.resume_at = -1  # (a new position: no scan of it yet)
            stream.sent += size
            stream.idle_until = now + stream.wait
            if now - stream.seen_at >= SEEN_S:  # (/v1/status's consumer list: a second is fresh)
                stream.seen_at = now
                host.saw_consumer(stream.client, stream.scn, stream.request.remote or "", reached)
            if transport.get_write_buffer_size():
                self._release(stream, "drain")
            elif stream.sent >= stream.budget:
                self._release(stream, "budget")
            else:
                moved.append(stream)
        if written:
            self._metrics.streamed(host.name, size * written, push.events * written)
        new = (push.next_scn, push.next_offset)
        if moved:
            by_pos.setdefault(new, []).extend(moved)
            self._counted(len(moved))
            if not push.to_tail and self._tick is None and new != pos:
                # more than one push behind the tail: go on at once, not at the next window
                self._tick = self._loop.call_soon(self._broadcast)
        self._forget_if_empty(key, by_pos)

    def _hand_back(
        self, by_pos: dict[tuple[int, int], list[Parked]], pos: tuple[int, int], why: Why
    ) -> None:
        group = by_pos.pop(pos)
        self._counted(-len(group))
        self._forget_if_empty(group[0].key, by_pos)
        for stream in group:
            self._release(stream, why)
