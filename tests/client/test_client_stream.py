"""The consumer against real relays: order, completeness, positions, failover, 410."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from changebus.client import (
    AsyncCallbacks,
    ChangeOp,
    Consumer,
    ConsumerConfig,
    FellOffRelayError,
    FileCheckpointPersister,
    MemoryCheckpointPersister,
    RelayStream,
    RelayUnavailableError,
    StreamConfig,
    SyncConsumer,
    Window,
)
from changebus.client._assembler import RawWindow
from changebus.relay import Relay
from changebus.schemas import Checkpoint, ScnNotFoundError, TransportError
from waiting import wait_until

MakeRelay = Callable[..., AbstractAsyncContextManager[Relay]]
FAST: dict[str, Any] = {"wait_s": 0.3, "backoff_initial_s": 0.01, "backoff_max_s": 0.05}


def config(*relays: str, **kw: Any) -> ConsumerConfig:
    return ConsumerConfig(relays=relays, **{"partition": "syn", **FAST, **kw})


async def take(consumer: Consumer, n: int) -> list[Window]:
    out: list[Window] = []
    async for window in consumer:
        out.append(window)
        if len(out) == n:
            break
    return out


async def relay_ndjson(relay: Relay) -> list[dict[str, Any]]:
    """Every data event as the relay itself decodes it (format=ndjson)."""
    rows: list[dict[str, Any]] = []
    scn = -1
    async with aiohttp.ClientSession() as http:
        while True:
            params = {"partition": "syn", "scn": str(scn), "format": "ndjson"}
            async with http.get(f"{relay.url}/v1/stream", params=params) as resp:
                if resp.status == 204:
                    return rows
                text = await resp.text()
                scn = int(resp.headers["X-Changebus-Next-Scn"])
            rows.extend(
                e
                for e in map(json.loads, text.splitlines())
                if e["op"] in ("insert", "update", "delete")
            )


@pytest.mark.parametrize(("follow", "max_bytes"), [(True, 1 << 20), (False, 300), (True, 300)])
async def test_every_window_in_order_exactly_once(
    make_relay: MakeRelay, follow: bool, max_bytes: int
) -> None:
    async with make_relay() as relay:
        expected = await relay_ndjson(relay)
        async with Consumer(config(relay.url, follow=follow, max_bytes=max_bytes)) as c:
            windows = await take(c, 300)
    scns = [w.scn for w in windows]
    assert scns == list(range(1000, 1300))  # the synthetic source's SCNs, none twice
    events = [e for w in windows for e in w.events]
    assert all(len(w.events) == 3 and w.partition == "syn" for w in windows)
    assert len({e.dedupe_key for e in events}) == len(events) == 900
    got = [
        {
            "scn": e.scn,
            "seq": e.seq,
            "op": e.op.value,
            "source": e.table,
            "key": e.key,
            "after": e.after,
            "before": e.before,
        }
        for e in events
    ]
    assert got == [{k: r[k] for k in got[0]} for r in expected]
    assert {e.op for e in events} >= {ChangeOp.INSERT, ChangeOp.UPDATE}


async def test_start_latest_and_scn_and_schema_fetch(make_relay: MakeRelay) -> None:
    async with make_relay(max_windows=0, windows_per_s=200, wait=False) as relay:
        await asyncio.sleep(0.2)
        last = relay.hosts["syn"].buffer.meta.last_scn
        async with Consumer(config(relay.url, start="latest")) as c:
            windows = await take(c, 5)
            # the SCHEMA_CHANGE was in the first window: schemas came from /v1/schemas
            assert c.stats()["schema_fetches"] >= 1
        assert windows[0].scn > last
        assert [w.scn for w in windows] == list(range(windows[0].scn, windows[0].scn + 5))
        async with Consumer(config(relay.url, start=str(last))) as c:
            windows = await take(c, 3)
        assert [w.scn for w in windows] == [last + 1, last + 2, last + 3]
        assert all(e.after is None or e.after["n"] == e.scn for w in windows for e in w.events)


async def test_checkpoint_file_restart_resumes_without_loss(
    make_relay: MakeRelay, tmp_path: Path
) -> None:
    path = tmp_path / "ckpt" / "consumer.json"
    async with make_relay() as relay:
        async with Consumer(config(relay.url), persister=FileCheckpointPersister(path)) as c:
            first = await take(c, 100)
        # the last window yielded was not committed: at-least-once
        stored = Checkpoint.parse(path.read_text())
        assert stored.get("syn").window_scn == first[-2].scn
        assert not path.with_name("consumer.json.tmp").exists()
        async with Consumer(config(relay.url), persister=FileCheckpointPersister(path)) as c:
            rest = await take(c, 300 - 99)
    assert rest[0].scn == first[-1].scn  # replayed once
    seen = [w.scn for w in first[:-1]] + [w.scn for w in rest]
    assert seen == list(range(1000, 1300))
    assert Checkpoint.parse(path.read_text()).get("syn").window_scn == rest[-2].scn


async def test_partitioned_consumers_cover_the_stream_exactly_once(make_relay: MakeRelay) -> None:
    async with make_relay() as relay:
        async with Consumer(config(relay.url)) as whole:
            everything = {e.dedupe_key for w in await take(whole, 300) for e in w.events}
        parts: list[set[tuple[int, int]]] = []
        for bucket in range(3):
            cfg = config(relay.url, filter=f"mod:3:{bucket}", yield_empty_windows=True)
            async with Consumer(cfg) as c:
                windows = await take(c, 300)  # every window reaches every consumer
            assert [w.scn for w in windows] == list(range(1000, 1300))
            parts.append({e.dedupe_key for w in windows for e in w.events})
    assert all(parts)
    assert sum(len(p) for p in parts) == len(everything) == 900
    assert set().union(*parts) == everything


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


async def test_failover_to_the_second_relay(make_relay: MakeRelay) -> None:
    async with make_relay() as relay, Consumer(config(dead_url(), relay.url)) as c:
        windows = await take(c, 300)
        stats = c.stats()
    assert [w.scn for w in windows] == list(range(1000, 1300))
    assert stats["failovers"] >= 1 and stats["relay"] == relay.url


async def test_failover_mid_stream_continues_without_gap(make_relay: MakeRelay) -> None:
    # two relays with the same synthetic source (same seed: same windows)
    async with make_relay() as second, contextlib.AsyncExitStack() as stack:
        first = await stack.enter_async_context(make_relay())
        cfg = config(first.url, second.url, queue_windows=4, follow=False, max_bytes=2000)
        async with Consumer(cfg) as c:
            windows = await take(c, 50)
            await stack.aclose()  # the first relay goes away mid-stream
            windows += await take(c, 250)
            assert c.stats()["relay"] == second.url
    assert [w.scn for w in windows] == list(range(1000, 1300))


async def test_all_relays_dead_gives_up_after_max_attempts() -> None:
    cfg = config(dead_url(), dead_url(), max_attempts=5)
    async with Consumer(cfg) as c:
        with pytest.raises(RelayUnavailableError) as info:
            await take(c, 1)
    assert info.value.retriable and "5 attempts" in info.value.message


async def test_fell_off_the_relay_raises_typed_410(make_relay: MakeRelay) -> None:
    async with make_relay(max_windows=400, row_bytes=2000, capacity_bytes=128 << 10) as relay:
        m = relay.hosts["syn"].buffer.meta
        assert m.min_scn > 1001
        c = Consumer(config(relay.url), persister=MemoryCheckpointPersister())
        # a stored checkpoint long evicted
        c.persister = MemoryCheckpointPersister(
            Checkpoint.parse('{"v":1,"partitions":{"syn":{"window_scn":1000,"prev_scn":1000}}}')
        )
        async with c:
            with pytest.raises(FellOffRelayError) as info:
                await take(c, 1)
    err = info.value
    assert isinstance(err, ScnNotFoundError)
    assert (err.oldest_scn, err.prev_scn, err.requested_scn) == (m.min_scn, m.prev_scn, 1000)
    assert err.partition == "syn" and err.details["oldest_scn"] == m.min_scn
    # where the source resumes after prev_scn (a follower relay restarts its buffer there)
    assert err.prev_position == m.prev_pos == f"synthetic:{m.prev_scn}"


async def test_sync_consumer_iterates_in_a_thread(make_relay: MakeRelay) -> None:
    async with make_relay() as relay:

        def consume() -> list[int]:
            with SyncConsumer(config(relay.url)) as c:
                scns = []
                for window in c:
                    scns.append(window.scn)
                    if len(scns) == 120:
                        break
                assert c.checkpoint.get("syn").window_scn == scns[-2]
                return scns

        scns = await asyncio.to_thread(consume)
    assert scns == list(range(1000, 1120))


async def test_flow_control_bounds_the_queue(make_relay: MakeRelay) -> None:
    async with make_relay() as relay, Consumer(config(relay.url, queue_windows=5)) as c:
        await take(c, 1)
        await asyncio.sleep(0.3)  # the application is slow: the fetcher must wait
        stats = c.stats()
        assert stats["queued_windows"] <= 5
        assert stats["queue_full_waits"] >= 1
        assert stats["fetch_position"] < 1299
        rest = await take(c, 299)
    assert rest[-1].scn == 1299


async def _stream_into(
    stream: RelayStream, sink: Callable[[Any, str], Any], until: Callable[[], bool]
) -> None:
    """Run ``stream`` into ``sink`` until ``until()``: a stream that ends first fails."""
    task = asyncio.create_task(stream.run(sink))
    try:
        async with asyncio.timeout(20):
            while not until():
                assert not task.done(), task.exception()
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_follow_takes_windows_larger_than_follow_bytes(make_relay: MakeRelay) -> None:
    """A follow response ends after ``follow_bytes``, in a window's middle when the
    window is larger: asking again for the window whole in follow mode ended there
    again, forever (thousands of requests a second, no window, no error)."""
    async with make_relay(max_windows=5, events_per_window=50) as relay:
        await wait_until(lambda: relay.hosts["syn"].buffer.meta.windows >= 5, 20, "windows")
        cfg = StreamConfig(
            relays=(relay.url,), partition="syn", follow=True, follow_bytes=2000,
            max_bytes=1000, max_attempts=3, **FAST,
        )  # fmt: skip
        got: list[RawWindow] = []

        async def sink(raw: RawWindow, _url: str) -> None:
            got.append(raw)

        async with aiohttp.ClientSession() as http:
            stream = RelayStream(cfg, http)
            await _stream_into(stream, sink, lambda: len(got) == 5)
    assert [w.scn for w in got] == list(range(got[0].scn, got[0].scn + 5))
    assert all(len(w.offsets) >= 50 for w in got)  # whole: every row and the end marker
    assert stream.requests < 200


@pytest.mark.parametrize("follow", [True, False])
async def test_windows_handed_over_count_as_progress_between_failures(
    make_relay: MakeRelay, follow: bool
) -> None:
    """``max_attempts`` bounds failures in a row. A follow response can last for days
    and hand over millions of windows: a blip now and then must not add up to the
    limit (it did in follow mode: the count was reset only when a response ended)."""
    async with make_relay(max_windows=300) as relay:
        await wait_until(lambda: relay.hosts["syn"].buffer.meta.windows >= 300, 20, "windows")
        cfg = StreamConfig(
            relays=(relay.url,), partition="syn", follow=follow, max_bytes=3000,
            max_attempts=3, **FAST,
        )  # fmt: skip
        got: list[int] = []
        calls = 0

        async def sink(raw: RawWindow, _url: str) -> None:
            nonlocal calls
            calls += 1
            if calls % 20 == 0:  # a blip after every 19 windows
                raise TransportError("a simulated blip")
            got.append(raw.scn)

        async with aiohttp.ClientSession() as http:
            stream = RelayStream(cfg, http)
            await _stream_into(stream, sink, lambda: len(got) == 300)
    assert got == list(range(got[0], got[0] + 300))  # each once, in order


async def test_latest_survives_a_failure_before_the_first_window(make_relay: MakeRelay) -> None:
    """``start="latest"`` by long-poll: a failure before any window was handed over
    asked again from the relay's oldest window."""
    async with make_relay(max_windows=0, windows_per_s=100) as relay:
        await wait_until(lambda: relay.hosts["syn"].buffer.meta.windows >= 20, 20, "windows")
        last = relay.hosts["syn"].buffer.meta.last_scn
        cfg = StreamConfig(relays=(relay.url,), partition="syn", max_attempts=3, **FAST)
        got: list[int] = []
        failed = False

        async def sink(raw: RawWindow, _url: str) -> None:
            nonlocal failed
            if not failed:
                failed = True
                raise TransportError("a simulated schema fetch timing out")
            got.append(raw.scn)

        async with aiohttp.ClientSession() as http:
            stream = RelayStream(cfg, http, latest=True)
            await _stream_into(stream, sink, lambda: len(got) >= 3)
    assert failed and got[0] > last


async def test_a_follow_request_into_a_black_hole_fails_over_quickly(
    make_relay: MakeRelay,
) -> None:
    """A relay (or a proxy before it) that accepts the connection and never answers:
    a follow request waited the body's read timeout (wait_s + read_margin_s) for its
    head, though a relay answers a follow head at once. It now gives up after
    ``connect_timeout_s + read_margin_s / 2`` and moves to the next relay."""
    held: list[asyncio.StreamWriter] = []

    def hold(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # (read nothing, answer nothing)

    silent = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    try:
        async with make_relay(max_windows=5) as relay:
            await wait_until(lambda: relay.hosts["syn"].buffer.meta.windows >= 5, 20, "windows")
            cfg = StreamConfig(
                relays=(f"http://127.0.0.1:{port}", relay.url), partition="syn", follow=True,
                wait_s=10.0, connect_timeout_s=1.0, read_margin_s=2.0, max_attempts=3,
            )  # fmt: skip
            assert cfg.head_timeout_s == 2.0
            got: list[int] = []

            async def sink(raw: RawWindow, _url: str) -> None:
                got.append(raw.scn)

            async with aiohttp.ClientSession() as http:
                stream = RelayStream(cfg, http)
                started = time.monotonic()
                await _stream_into(stream, sink, lambda: len(got) == 5)
                took = time.monotonic() - started
        assert took < 8, took  # the body's read timeout alone is 12 s
        assert stream.relay == relay.url
        assert held  # the black hole was asked first
    finally:
        for writer in held:
            writer.close()
        silent.close()
        await silent.wait_closed()


async def test_a_seek_forgets_the_relays_fell_off_answers() -> None:
    """After a bootstrap the stream continues at a new position: the relays' earlier
    410s were about the old one. Kept, one 410 afterwards made it look as if every
    relay had refused, and the consumer bootstrapped again without asking the others."""
    cfg = StreamConfig(relays=("http://a.test:1", "http://b.test:1"), partition="p", **FAST)
    async with aiohttp.ClientSession() as http:
        stream = RelayStream(cfg, http)
        fell = FellOffRelayError(
            "fell off", partition="p", requested_scn=5, oldest_scn=9, prev_scn=8, relay="a"
        )
        await stream._failover.failed(fell)  # relay a: 410 for position 5
        stream.seek(100)  # a bootstrap brought it to 100
        await stream._failover.failed(fell)  # relay b: 410 for 100; a was not asked again
        with pytest.raises(FellOffRelayError):
            await stream._failover.failed(fell)  # now a too: every relay refused


async def test_a_jump_to_latest_forgets_the_relays_fell_off_answers() -> None:
    """``on_fell_off="latest"``: after every relay answered 410 the stream jumps to the
    newest window. The 410s were kept, so any failure of the next request (a relay
    restarting) raised the old 410 again at once, without backoff, attempts or another
    relay: a hot loop for ever (review). Now a failure there is an ordinary one."""
    cfg = StreamConfig(relays=("http://a.test:1", "http://b.test:1"), partition="p", **FAST)
    async with aiohttp.ClientSession() as http:
        stream = RelayStream(cfg, http)
        fell = FellOffRelayError(
            "fell off", partition="p", requested_scn=5, oldest_scn=9, prev_scn=8, relay="a"
        )
        await stream._failover.failed(fell)
        with pytest.raises(FellOffRelayError):
            await stream._failover.failed(fell)  # every relay refused: on_fell_off decides
        stream.seek_latest()
        url = stream._failover.url
        await stream._failover.failed(TransportError("connection refused"))  # retried
        assert stream._failover.attempts == 1 and stream._failover.url != url


async def test_a_close_while_the_consumer_starts_ends_it(make_relay: MakeRelay) -> None:
    """close() while start() awaited its checkpoint (a SIGTERM handler) found nothing to
    release and returned; the start then opened its session and fetcher, and the
    iteration went on delivering windows of a closed consumer, its task and session
    leaked (review). The start sees the close now: nothing is opened, iteration ends."""

    class SlowLoad(MemoryCheckpointPersister):
        def __init__(self) -> None:
            super().__init__()
            self.entered, self.go = asyncio.Event(), asyncio.Event()

        async def load(self) -> Checkpoint | None:
            self.entered.set()
            await self.go.wait()
            return None

    async with make_relay(max_windows=20) as relay:
        slow = SlowLoad()
        consumer = Consumer(config(relay.url), persister=slow)
        first = asyncio.ensure_future(consumer.__anext__())
        await asyncio.wait_for(slow.entered.wait(), 5)
        await consumer.close()
        slow.go.set()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(first, 5)
        assert consumer._task is None and consumer._session is None
        with pytest.raises(StopAsyncIteration):
            await consumer.__anext__()


async def test_sync_consumer_stats_from_its_own_loop_and_after_close(
    make_relay: MakeRelay,
) -> None:
    """``stats()`` handed the work to the consumer's loop and waited for it: called from
    an async callback (on that loop) it waited for itself for ever."""
    async with make_relay() as relay:

        def consume() -> tuple[dict[str, Any], dict[str, Any]]:
            seen: list[dict[str, Any]] = []
            with SyncConsumer(config(relay.url)) as c:

                class Inside(AsyncCallbacks):
                    async def on_end_window(self, window: Window) -> None:
                        seen.append(c.stats())  # on the consumer's own loop
                        c.stop()

                c.run(Inside())
            return seen[0], c.stats()  # and after close

        inside, after = await asyncio.wait_for(asyncio.to_thread(consume), 30)
    assert inside["windows_fetched"] >= 1
    assert after["windows_fetched"] >= inside["windows_fetched"]


async def test_a_jump_ends_the_long_poll_for_a_large_window() -> None:
    """A follow stream long-polls one window larger than follow_bytes; a jump (to the
    newest SCN after a fall-off, or to a bootstrap's target) is past that window: it
    follows again, and a from=latest answer is read as a follow answer's start."""
    cfg = StreamConfig(relays=("http://a.test:1",), partition="p", follow=True, **FAST)
    async with aiohttp.ClientSession() as http:
        stream = RelayStream(cfg, http)
        for jump in (stream.seek_latest, lambda: stream.seek(100)):
            stream._whole_window = True
            assert "follow" not in stream._params()
            jump()
            assert stream._params().get("follow") == "1"


@pytest.mark.parametrize("follow", [False, True], ids=["long_poll", "follow"])
async def test_a_latest_start_says_where_it_resolved(make_relay: MakeRelay, follow: bool) -> None:
    """``resolved_latest``: where "from now on" began, so a group unit moved before its
    lane handed anything out is stored there, not skipped to the next owner's own newest
    window (review)."""
    async with make_relay(max_windows=0, windows_per_s=100) as relay:
        await wait_until(lambda: relay.hosts["syn"].buffer.meta.windows >= 20, 20, "windows")
        last = relay.hosts["syn"].buffer.meta.last_scn
        cfg = StreamConfig(relays=(relay.url,), partition="syn", follow=follow, **FAST)
        got: list[int] = []

        async def sink(raw: RawWindow, _url: str) -> None:
            got.append(raw.scn)

        async with aiohttp.ClientSession() as http:
            stream = RelayStream(cfg, http, latest=True)
            before = stream.resolved_latest
            await _stream_into(stream, sink, lambda: len(got) >= 3)
    resolved = stream.resolved_latest
    assert before is None and resolved is not None and last <= resolved < got[0]
