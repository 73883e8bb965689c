"""The tail broadcast's groups, driven directly: a real event buffer, response cache and
copy budget; the transports are in-memory recorders (what the broadcast writes is the
subject here, not the network)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from changebus.relay._broadcast import Parked, TailBroadcast
from changebus.relay._buffer import BufferConfig, EventBuffer
from changebus.relay._respcache import ResponseCache
from changebus.schemas import EndOfWindow, Op, encode_control, encode_event, key_hash
from changebus.schemas.server import CopyBudget


def _event(scn: int, seq: int, size: int, source: int) -> bytes:
    key = f"k{scn}-{seq}".encode()
    return encode_event(
        Op.INSERT, scn, seq, scn * 1000, key, b"x" * size, key_hash=key_hash(key), source_id=source
    )


class _Transport:
    """Records what is written; never has bytes left over."""

    def __init__(self) -> None:
        self.out: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.out.append(bytes(data))

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return 0


class _Host:
    name = "p"

    def __init__(self, buffer: EventBuffer) -> None:
        self.buffer = buffer
        self.listeners: list[Any] = []

    def add_wake_listener(self, listener: Any) -> None:
        self.listeners.append(listener)

    def saw_consumer(self, *_args: Any) -> None:
        pass


class _Metrics:
    def streamed(self, *_args: Any) -> None:
        pass


def _setup(tmp_path: Path) -> tuple[EventBuffer, CopyBudget, TailBroadcast]:
    buffer = EventBuffer(tmp_path / "b", BufferConfig(capacity_bytes=1 << 20, event_slots=4096))
    buffer.set_start(0)
    copies = CopyBudget(64 << 20, 100)
    cache = ResponseCache(8 << 20, 1 << 20)
    broadcast = TailBroadcast(_Host(buffer), cache, copies, _Metrics())  # type: ignore[arg-type]
    return buffer, copies, broadcast


def _parked(transport: _Transport, **kw: Any) -> Parked:
    args: dict[str, Any] = {
        "max_bytes": 1 << 20,
        "filter_text": None,
        "sources": None,
        "budget": 1 << 40,
        "wait": 30.0,
    }
    args.update(kw)
    return Parked(
        SimpleNamespace(remote="127.0.0.1"),  # type: ignore[arg-type]
        transport,  # type: ignore[arg-type]
        args["max_bytes"],
        args["filter_text"],
        None,
        args["sources"],
        "c",
        0,
        -1,
        0,
        args["budget"],
        args["wait"],
        time.monotonic() + args["wait"],
    )


def _chunks(writes: list[bytes]) -> list[int]:
    """The chunk sizes of what a stream got (each write is one whole chunk)."""
    return [int(w.split(b"\r\n", 1)[0], 16) for w in writes]


async def _cancel_parked(tasks: list[Any], copies: CopyBudget) -> None:
    """End the parked streams' tasks; none holds a grant of the copy budget after."""
    for task in tasks:
        task.cancel()
    await asyncio.sleep(0)
    assert copies.parked == 0


async def test_a_push_whose_filter_kept_nothing_writes_no_empty_chunk(tmp_path: Path) -> None:
    """A filtered selection cut before any event it keeps moves the position only. Written
    as a chunk it would be ``0\\r\\n\\r\\n``: the end of the response, with more after it."""
    buffer, copies, broadcast = _setup(tmp_path)
    transport = _Transport()
    stream = _parked(transport, max_bytes=1000, sources=frozenset({2}))
    parked = asyncio.ensure_future(broadcast.park(stream))
    await asyncio.sleep(0)
    # a small source-1 event (filtered out), then a source-2 event larger than max_bytes
    buffer.append_window(
        _event(3, 0, 10, 1)
        + _event(3, 1, 5000, 2)
        + encode_control(EndOfWindow(2, "p"), 3, 2, 3000)
    )
    broadcast._woken()
    await asyncio.sleep(0.05)
    sizes = _chunks(transport.out)
    assert sizes and 0 not in sizes, sizes
    # every byte of the kept event and the window's end arrived, once
    assert sum(sizes) == len(_event(3, 1, 5000, 2)) + len(
        encode_control(EndOfWindow(2, "p"), 3, 2, 3000)
    )
    assert (stream.scn, stream.offset) == (3, -1)
    parked.cancel()
    await asyncio.sleep(0)
    assert copies.parked == 0


async def test_groups_of_streams_that_are_gone_are_forgotten(tmp_path: Path) -> None:
    """Each distinct request (max_bytes, filter, sources) has a group; once its streams are
    gone the group goes too, or any client could grow the table without bound."""
    buffer, copies, broadcast = _setup(tmp_path)
    buffer.append_window(_event(3, 0, 100, 1) + encode_control(EndOfWindow(1, "p"), 3, 1, 3000))
    whys = []
    for i in range(200):  # each ends after one push (its byte budget is 1)
        stream = _parked(_Transport(), max_bytes=100_000 + i, budget=1, filter_text=f"f{i}")
        whys.append(await broadcast.park(stream))
    assert set(whys) == {"budget"}
    assert len(broadcast) == 0 and copies.parked == 0
    assert broadcast._groups == {}


async def test_a_pass_for_a_group_behind_skips_the_groups_at_the_tail(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """While a follower catches up, the broadcast runs pass after pass: each selected for
    every group, those at the newest window too (about 2 us each, per pass). A pass now
    selects only for groups behind the tail."""
    buffer, copies, broadcast = _setup(tmp_path)
    for scn in range(1, 41):
        buffer.append_window(
            _event(scn, 0, 2000, 1) + encode_control(EndOfWindow(1, "p"), scn, 1, scn * 1000)
        )
    tail = buffer.meta.last_scn
    waiting = []
    for i in range(50):  # distinct filters: a group each, all at the newest window
        stream = _parked(_Transport(), filter_text=f"f{i}")
        stream.scn = tail
        waiting.append(asyncio.ensure_future(broadcast.park(stream)))
    behind = _parked(_Transport(), max_bytes=4096)  # from the start, 4 KiB a push
    waiting.append(asyncio.ensure_future(broadcast.park(behind)))
    selects = 0
    select = buffer.select

    def counting(*args: Any, **kw: Any) -> Any:
        nonlocal selects
        selects += 1
        return select(*args, **kw)

    monkeypatch.setattr(buffer, "select", counting)
    await asyncio.sleep(0)
    for _ in range(100):
        broadcast._woken()
        await asyncio.sleep(0)
        if behind.scn == tail:
            break
    assert behind.scn == tail  # caught up, a push or so a pass
    assert selects <= 2 * 41  # (before: 51 selects a pass)
    await _cancel_parked(waiting, copies)


async def test_a_pass_yields_after_its_time_and_the_next_goes_on_where_it_stopped(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """One pass pushed to every group behind the tail in one callback: with dozens of
    filtered groups catching up, 100-200 ms of event loop at a time, back to back (review).
    A pass yields after PASS_S; the next one starts with the groups not reached, so every
    group gets its pushes and all of them catch up."""
    from changebus.relay import _broadcast

    monkeypatch.setattr(_broadcast, "PASS_S", 0.0)  # one group a pass
    buffer, copies, broadcast = _setup(tmp_path)
    for scn in range(1, 61):
        buffer.append_window(
            _event(scn, 0, 2000, 1) + encode_control(EndOfWindow(1, "p"), scn, 1, scn * 1000)
        )
    tail = buffer.meta.last_scn
    streams = [_parked(_Transport(), max_bytes=4096, filter_text=f"f{i}") for i in range(8)]
    for scn in (10, 20, 30, 40):  # one key, several positions: a push moves a group to the
        stream = _parked(_Transport(), max_bytes=4096, filter_text="same")  # end of them
        stream.scn = scn
        streams.append(stream)
    waiting = [asyncio.ensure_future(broadcast.park(s)) for s in streams]
    pushes: list[int] = []
    push = broadcast._push

    def counting(by_pos: Any, pos: Any, group: Any, cap: int) -> None:
        pushes.append(id(group[0]))
        push(by_pos, pos, group, cap)

    monkeypatch.setattr(broadcast, "_push", counting)
    per_pass: list[int] = []
    real = broadcast._broadcast

    def counted() -> None:
        before = len(pushes)
        real()
        per_pass.append(len(pushes) - before)

    monkeypatch.setattr(broadcast, "_broadcast", counted)
    await asyncio.sleep(0)
    broadcast._woken()
    for _ in range(2000):
        await asyncio.sleep(0)
        if all(s.scn == tail for s in streams):
            break
    assert all(s.scn == tail for s in streams)
    assert per_pass and max(per_pass) == 1  # each pass yielded after one group
    # round-robin: once every group is parked, each twelve pushes in a row reach all twelve
    assert len(pushes) >= 48
    assert len(set(pushes[12:24])) == len(set(pushes[24:36])) == len(set(pushes[36:48])) == 12
    await _cancel_parked(waiting, copies)


async def test_a_group_scanning_a_long_window_does_not_hold_the_others_back(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """A filtered group scanning a window longer than one scan, which it mostly filters out,
    is not pushed until it finds something: ordered by their last push, it went first in
    every pass that yielded, and a group with a window to get waited for its whole scan
    (review). Groups go by their last visit."""
    from changebus.relay import _broadcast, _reader

    monkeypatch.setattr(_broadcast, "PASS_S", 0.0)  # one group a pass
    monkeypatch.setattr(_reader, "MAX_SCAN_EVENTS", 64)
    monkeypatch.setattr(_reader, "SCAN_CHUNK", 32)
    buffer, copies, broadcast = _setup(tmp_path)
    n = 3000
    buffer.append_window(
        b"".join(_event(1, i, 10, 1) for i in range(n))
        + encode_control(EndOfWindow(n, "p"), 1, n, 1000)
    )
    scanning = _parked(_Transport(), sources=frozenset({99}))  # keeps nothing of it
    waiting = _parked(_Transport())
    waiting.scn = 1  # past the long window
    tasks = [asyncio.ensure_future(broadcast.park(s)) for s in (scanning, waiting)]
    await asyncio.sleep(0)
    buffer.append_window(_event(2, 0, 10, 1) + encode_control(EndOfWindow(1, "p"), 2, 1, 2000))
    visits: list[str] = []
    push = broadcast._push

    def counting(by_pos: Any, pos: Any, group: Any, cap: int) -> None:
        visits.append("scanning" if group[0] is scanning else "waiting")
        push(by_pos, pos, group, cap)

    monkeypatch.setattr(broadcast, "_push", counting)
    broadcast._woken()
    for _ in range(500):
        await asyncio.sleep(0)
        if waiting.scn == 2:
            break
    assert waiting.scn == 2
    assert visits.index("waiting") <= 2, visits[:10]  # not after the whole scan
    await _cancel_parked(tasks, copies)
