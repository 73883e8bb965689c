"""Relay chaining (the ``relay`` fetcher kind) with real relays in process and a real Postgres.

A leader relay reads a source; followers read the leader's ``/v1/stream``
(or another follower's) and must serve the same bytes, the same sources and
schemas, resume without a gap or a duplicate, record falling off their
upstream as one DATA_LOSS window, and refuse an upstream of a stale epoch.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import psycopg
import pytest

from changebus.client import (
    Consumer,
    ConsumerConfig,
    RelayQueries,
    RelayUnavailableError,
    Window as ClientWindow,
)
from changebus.fetchers import ResumePoint
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.relay._chainschemas import KnownSchemas
from changebus.relay.chain import (
    EPOCH_HEADER,
    ChainConfig,
    ChainFetcher,
    StaleUpstreamError,
    fetcher_factory,
)
from changebus.schemas import (
    HEADER_SIZE,
    ConfigError,
    DataLoss,
    EndOfWindow,
    Op,
    SourceConfigError,
    decode_control,
    parse_stream,
)
from fix_pg import caught_up, wait_until

pytestmark = pytest.mark.usefixtures("no_blocking")

PART = "pg"
SYNTHETIC: dict[str, Any] = {
    "windows_per_s": 0,
    "events_per_window": 3,
    "row_bytes": 100,
    "tables": 2,
    "keys": 500,
}


def config(
    data_dir: Path, fetcher: FetcherConfig, *, capacity: int = 16 << 20, pid: int = 1
) -> RelayConfig:
    return RelayConfig(
        data_dir=data_dir,
        http=HttpConfig(port=0, max_wait_s=10),
        partitions=(PartitionConfig(PART, pid, capacity_bytes=capacity, fetcher=fetcher),),
        flush_interval_s=0,
    )


def chain(*upstream: str, **options: Any) -> FetcherConfig:
    opts: dict[str, Any] = {
        "upstream": list(upstream),
        "wait_s": 1.0,
        "backoff_initial_s": 0.02,
        "backoff_max_s": 0.2,
        **options,
    }
    return FetcherConfig("relay", opts, retry_initial_s=0.05, retry_max_s=0.5)


@asynccontextmanager
async def relay(
    data_dir: Path, fetcher: FetcherConfig, *, capacity: int = 16 << 20
) -> AsyncIterator[Relay]:
    async with Relay(config(data_dir, fetcher, capacity=capacity)) as r:
        yield r


def last_scn(r: Relay) -> int:
    return r.hosts[PART].buffer.meta.last_scn


async def same_tail(*relays: Relay, seconds: float = 30) -> None:
    """Wait until every relay holds the first one's newest window."""
    await wait_until(lambda: all(last_scn(r) == last_scn(relays[0]) for r in relays), seconds)


async def stream_bytes(http: aiohttp.ClientSession, r: Relay, scn: int = -1) -> bytes:
    """Everything after ``scn`` in one non-follow answer (the test buffers are small)."""
    params = {"partition": PART, "scn": str(scn), "max_bytes": str(64 << 20)}
    async with http.get(f"{r.url}/v1/stream", params=params) as resp:
        assert resp.status in (200, 204), await resp.text()
        return await resp.read()


async def get_json(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


def window_scns(body: bytes) -> list[int]:
    _, headers = parse_stream(body)
    return [int(h["scn"]) for h in headers if int(h["op"]) == int(Op.END_OF_WINDOW)]


def controls(body: bytes, op: Op) -> list[Any]:
    """The control events ``op`` in a stream answer, decoded, in order."""
    offsets, headers = parse_stream(body)
    return [
        decode_control(op, body[off + HEADER_SIZE : off + int(h["total_length"])])
        for off, h in zip(offsets.tolist(), headers, strict=True)
        if int(h["op"]) == int(op)
    ]


def data_losses(body: bytes) -> list[DataLoss]:
    out = controls(body, Op.DATA_LOSS)
    assert all(isinstance(loss, DataLoss) for loss in out)
    return out


async def same_registry(http: aiohttp.ClientSession, *relays: Relay) -> list[str]:
    """/v1/sources and every /v1/schemas/<t> answer identically on all relays; the names."""
    answers = [await get_json(http, f"{r.url}/v1/sources") for r in relays]
    assert all(a == answers[0] for a in answers), answers
    names = [s["name"] for s in answers[0]["partitions"][0]["sources"]]
    for name in names:
        schemas = [await get_json(http, f"{r.url}/v1/schemas/{name}") for r in relays]
        assert all(s == schemas[0] for s in schemas), name
    return names


async def read_windows(
    url: str, until: Callable[[ClientWindow], bool], **kw: Any
) -> list[ClientWindow]:
    """Decoded windows from ``url`` (earliest first) until ``until(window)``."""
    out: list[ClientWindow] = []
    cfg = ConsumerConfig(relays=(url,), partition=PART, start="earliest", wait_s=1.0, **kw)
    async with asyncio.timeout(60), Consumer(cfg) as consumer:
        async for window in consumer:
            out.append(window)
            if until(window):
                break
    return out


# ---- Postgres: leader -> follower -> follower ----------------------------------

TABLES = """
CREATE TABLE acct (id int PRIMARY KEY, name text, n bigint);
CREATE TABLE item (a int, b int, note text, PRIMARY KEY (a, b));
"""


def workload(dsn: str, txns: int, offset: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for i in range(txns):
            k = (i * 7 + offset) % 50
            with conn.transaction():
                conn.execute(
                    "INSERT INTO acct VALUES (%s, %s, %s) ON CONFLICT (id) DO UPDATE"
                    " SET name = EXCLUDED.name, n = acct.n + 1",
                    (k, f"n{i}", i),
                )
                conn.execute(
                    "INSERT INTO item VALUES (%s, %s, %s) ON CONFLICT (a, b) DO UPDATE"
                    " SET note = EXCLUDED.note",
                    (k, i % 3, "x" * (i % 5)),
                )
                if i % 9 == 0:
                    conn.execute("DELETE FROM acct WHERE id = %s", ((k + 3) % 50,))
                if i % 25 == 0:
                    conn.execute("DELETE FROM item WHERE a = %s", ((k + 1) % 50,))


def source_rows(dsn: str) -> dict[str, dict[tuple[Any, ...], dict[str, Any]]]:
    with psycopg.connect(dsn) as conn:
        acct = conn.execute("SELECT id, name, n, extra FROM acct").fetchall()
        item = conn.execute("SELECT a, b, note FROM item").fetchall()
    return {
        "public.acct": {
            (r[0],): {"id": r[0], "name": r[1], "n": r[2], "extra": r[3]} for r in acct
        },
        "public.item": {(r[0], r[1]): {"a": r[0], "b": r[1], "note": r[2]} for r in item},
    }


def fold(windows: list[ClientWindow]) -> dict[str, dict[tuple[Any, ...], dict[str, Any]]]:
    state: dict[str, dict[tuple[Any, ...], dict[str, Any]]] = {
        "public.acct": {},
        "public.item": {},
    }
    for w in windows:
        for e in w.events:
            rows = state.setdefault(e.table, {})
            key = tuple(e.key.values())
            if e.after is None:
                rows.pop(key, None)
            else:
                rows[key] = {"extra": None, **e.after} if e.table == "public.acct" else e.after
    return state


@pytest.mark.pg
async def test_leader_and_two_chained_followers_serve_identical_bytes(
    tmp_path: Path, pg_dsn: str
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(TABLES)
    leader_fetcher = FetcherConfig("postgres", {"dsn": pg_dsn, "status_interval_s": 0.2})
    async with (
        relay(tmp_path / "leader", leader_fetcher) as leader,
        relay(tmp_path / "f1", chain(leader.url)) as f1,
        relay(tmp_path / "f2", chain(f1.url, follow=False, max_bytes=4096)) as f2,
        aiohttp.ClientSession() as http,
    ):
        # (the slot exists once the fetcher streams: transactions before it are not captured,
        # and a loaded machine took long enough for a third of the workload to pass)
        await wait_until(lambda: leader.hosts[PART].state == "streaming", 30)
        await asyncio.to_thread(workload, pg_dsn, 150, 0)
        with psycopg.connect(pg_dsn, autocommit=True) as conn:  # a second schema version
            conn.execute("ALTER TABLE acct ADD COLUMN extra text")
        await asyncio.to_thread(workload, pg_dsn, 150, 11)
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("UPDATE acct SET extra = 'e' || id WHERE id % 4 = 0")
        await caught_up(leader, pg_dsn)
        await same_tail(leader, f1, f2)

        bodies = [await stream_bytes(http, r) for r in (leader, f1, f2)]
        assert len(window_scns(bodies[0])) >= 300
        assert bodies[1] == bodies[0] and bodies[2] == bodies[0]
        middle = window_scns(bodies[0])[120]
        mids = [await stream_bytes(http, r, middle) for r in (leader, f1, f2)]
        assert mids[0] and mids[1] == mids[0] and mids[2] == mids[0]
        for r in (leader, f1, f2):  # the same bounds, so the same 410s
            m, top = r.hosts[PART].buffer.meta, leader.hosts[PART].buffer.meta
            assert (m.prev_scn, m.min_scn, m.last_scn) == (top.prev_scn, top.min_scn, top.last_scn)
            assert m.evicted == 0  # (prev_scn is where the leader began)

        names = await same_registry(http, leader, f1, f2)
        assert set(names) == {"public.acct", "public.item"}
        acct = await get_json(http, f"{f2.url}/v1/schemas/public.acct")
        assert [v["version"] for v in acct["partitions"][0]["versions"]] == [1, 2]

        status = (await get_json(http, f"{f2.url}/v1/status"))["partitions"][0]["fetcher"]
        assert status["kind"] == "relay" and status["upstream"] == f1.url
        assert status["position"] == last_scn(leader) and status["data_loss_windows"] == 0

        end = last_scn(leader)
        windows = await read_windows(f2.url, lambda w: w.scn >= end)
    assert fold(windows) == source_rows(pg_dsn)


# ---- schemas evicted upstream -----------------------------------------------


async def test_follower_started_after_the_schema_changes_were_evicted(tmp_path: Path) -> None:
    syn = FetcherConfig("synthetic", {**SYNTHETIC, "max_windows": 3000, "row_bytes": 200})
    async with (
        relay(tmp_path / "leader", syn, capacity=256 << 10) as leader,
        aiohttp.ClientSession() as http,
    ):
        await wait_until(lambda: last_scn(leader) == 3999, 60)
        held = await stream_bytes(http, leader)
        _, headers = parse_stream(held)
        assert leader.hosts[PART].buffer.meta.prev_scn > 1000  # the first windows are gone
        assert int(Op.SCHEMA_CHANGE) not in set(headers["op"].tolist())  # and their schemas

        async with relay(tmp_path / "f", chain(leader.url)) as follower:
            await same_tail(leader, follower)
            assert await stream_bytes(http, follower) == held
            # it starts where the leader evicted windows: it says so too (a reader of
            # start times must not take its prev_scn for where the stream began)
            assert (
                leader.hosts[PART].buffer.meta.evicted,
                follower.hosts[PART].buffer.meta.evicted,
            ) == (1, 1)
            # and where the source resumes after it (a follower that leads before its
            # first window checks the source against it): the evicted window's position
            up = leader.hosts[PART].buffer.meta
            assert up.prev_pos == f"synthetic:{up.prev_scn}"
            assert follower.hosts[PART].buffer.meta.prev_pos == up.prev_pos
            status = await get_json(http, f"{leader.url}/v1/status")
            assert [p["prev_position"] for p in status["partitions"]] == [up.prev_pos]
            assert len(await same_registry(http, leader, follower)) == 2
            windows = await read_windows(follower.url, lambda w: w.scn >= 3999)
    assert windows[0].scn == window_scns(held)[0] and windows[-1].scn == 3999
    assert sum(len(w.events) for w in windows) == 3 * len(windows)
    names = {"synthetic.t0", "synthetic.t1"}
    assert {e.table for w in windows for e in w.events} <= names


async def test_a_dead_upstream_in_the_list_delays_the_loss_but_does_not_stop_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A follower asks every upstream before recording a loss; one that never answers
    (a decommissioned URL) kept it reading again for ever (review of this session's
    change): after _CONFIRM_S the loss is recorded, as before."""
    import socket

    from changebus.relay import _chainloss

    monkeypatch.setattr(_chainloss, "_CONFIRM_S", 1.0)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    syn = FetcherConfig("synthetic", {**SYNTHETIC, "windows_per_s": 1000, "max_windows": 4000})
    async with relay(tmp_path / "leader", syn, capacity=256 << 10) as leader:
        async with relay(tmp_path / "f", chain(leader.url), capacity=4 << 20) as follower:
            await wait_until(lambda: last_scn(follower) >= 1100, 30)
            host = follower.hosts[PART]
        stopped_at = host.buffer.meta.last_scn
        await wait_until(lambda: last_scn(leader) == 4999, 60)
        async with relay(tmp_path / "f", chain(leader.url, dead), capacity=4 << 20) as follower:
            await same_tail(leader, follower)
            status = follower.hosts[PART].status()["fetcher"]
            assert status["data_loss_windows"] == 1
            assert last_scn(follower) == 4999 > stopped_at


async def test_two_followers_of_one_process_wait_for_a_dead_upstream_each_on_its_own_clock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wait for a silent upstream was timed per partition name across the process:
    two relays of one process that fell off the same partition at different positions
    reset each other's clock at every retry, and neither ever recorded its loss."""
    import socket

    from changebus.relay import _chainloss

    monkeypatch.setattr(_chainloss, "_CONFIRM_S", 1.0)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    syn = FetcherConfig("synthetic", {**SYNTHETIC, "windows_per_s": 1000, "max_windows": 4000})
    async with relay(tmp_path / "leader", syn, capacity=256 << 10) as leader:
        async with relay(tmp_path / "a", chain(leader.url), capacity=4 << 20) as a:
            await wait_until(lambda: last_scn(a) >= 1100, 30)
            a_host = a.hosts[PART]
        async with relay(tmp_path / "b", chain(leader.url), capacity=4 << 20) as b:
            await wait_until(lambda: last_scn(b) >= a_host.buffer.meta.last_scn + 300, 30)
        await wait_until(lambda: last_scn(leader) == 4999, 60)
        ups = chain(leader.url, dead)
        async with (
            relay(tmp_path / "a", ups, capacity=4 << 20) as a,
            relay(tmp_path / "b", ups, capacity=4 << 20) as b,
        ):
            await same_tail(leader, a, b)
            for r in (a, b):
                assert r.hosts[PART].status()["fetcher"]["data_loss_windows"] == 1
                assert last_scn(r) == 4999


async def test_rows_of_schemas_the_follower_lacks_make_it_learn_them_again(
    tmp_path: Path,
) -> None:
    """A follower reads its upstream's registry when its stream starts; an upstream that
    registered schemas out of band afterwards (its own start or fall-off mirrored them
    from its upstream: no SCHEMA_CHANGE in the stream) sent rows this relay could not
    register, and its readers could not decode (review). The first row of a schema it
    lacks makes it read the registry again. Here the follower's registry read is undone
    after start, as if it had come before the upstream had those schemas."""
    syn = FetcherConfig("synthetic", {**SYNTHETIC, "max_windows": 3000, "row_bytes": 200})
    async with relay(tmp_path / "leader", syn, capacity=256 << 10) as leader:
        await wait_until(lambda: last_scn(leader) == 3999, 60)
        fetcher = ChainFetcher(PART, 1, ChainConfig(upstream=(leader.url,), wait_s=0.2))
        await fetcher.start(ResumePoint())
        try:
            assert {e["schema"]["name"] for e in fetcher._pending} == {
                "synthetic.t0",
                "synthetic.t1",
            }
            fetcher._pending, fetcher._schemas = (), KnownSchemas()
            async with asyncio.timeout(20):
                window = await anext(aiter(fetcher.windows()))
            names = {e["schema"]["name"] for e in window.schemas}
            assert names == {"synthetic.t0", "synthetic.t1"}
        finally:
            await fetcher.close()


async def test_schemas_are_learned_again_from_the_upstream_that_sent_the_rows(
    tmp_path: Path,
) -> None:
    """Rows of unknown schemas made the follower read the registry of the first upstream
    that answered, which may be another one, lacking them (review): it asks the
    upstream whose window held the rows, and the first that answers if that one fails."""
    syn = FetcherConfig("synthetic", {**SYNTHETIC, "max_windows": 50})
    other_syn = FetcherConfig("synthetic", {**SYNTHETIC, "max_windows": 50, "first_table": 5})
    async with (
        relay(tmp_path / "leader", syn) as leader,
        relay(tmp_path / "other", other_syn) as other,
    ):
        await wait_until(lambda: last_scn(leader) >= 1049 and last_scn(other) >= 1049, 30)
        ups = (other.url, leader.url)
        fetcher = ChainFetcher(PART, 1, ChainConfig(upstream=ups, wait_s=0.2))
        await fetcher.start(ResumePoint())
        try:

            def names(entries: tuple[Any, ...]) -> set[str]:
                return {e["schema"]["name"] for e in entries}

            assert names(fetcher._pending) == {"synthetic.t5", "synthetic.t6"}  # the first
            assert names(await fetcher._learn_schemas(leader.url)) == {
                "synthetic.t0",
                "synthetic.t1",
            }
            fetcher._schemas = KnownSchemas()
            with socket.socket() as sock:  # a serving upstream gone since: the first answers
                sock.bind(("127.0.0.1", 0))
                dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
            assert fetcher._queries is not None
            assert fetcher._session is not None
            fetcher._queries = RelayQueries(
                fetcher._session, (dead, *ups), timeout=aiohttp.ClientTimeout(total=2)
            )
            assert names(await fetcher._learn_schemas(dead)) == {"synthetic.t5", "synthetic.t6"}
        finally:
            await fetcher.close()


# ---- restart ------------------------------------------------------------------


async def test_follower_restart_resumes_after_its_newest_window(tmp_path: Path) -> None:
    syn = FetcherConfig("synthetic", {**SYNTHETIC, "windows_per_s": 400, "max_windows": 1200})
    async with relay(tmp_path / "leader", syn) as leader, aiohttp.ClientSession() as http:
        async with relay(tmp_path / "f", chain(leader.url)) as follower:
            await wait_until(lambda: last_scn(follower) >= 1100, 30)
            host = follower.hosts[PART]
        stopped_at = host.buffer.meta.last_scn  # (the buffer stays readable when closed)
        await wait_until(lambda: last_scn(leader) > stopped_at + 200, 30)  # it moved on meanwhile
        async with relay(tmp_path / "f", chain(leader.url)) as follower:
            host = follower.hosts[PART]
            assert host.buffer.meta.last_scn == stopped_at  # the same buffer, reopened
            await same_tail(leader, follower)
            await wait_until(lambda: last_scn(leader) == 2199, 30)
            await same_tail(leader, follower)
            assert await stream_bytes(http, follower) == await stream_bytes(http, leader)
            assert window_scns(await stream_bytes(http, follower)) == list(range(1000, 2200))
            fetcher = host.status()["fetcher"]
            assert fetcher["windows_received"] == 2199 - stopped_at  # nothing twice
            assert fetcher["data_loss_windows"] == 0


async def test_a_follower_gives_up_on_a_black_holed_upstream_soon(tmp_path: Path) -> None:
    """An upstream that accepts connections and answers nothing (a half-open proxy):
    the follower's first request (the upstream's status) waited 30 s for it, the
    stream's head the whole read timeout, though a relay answers both at once."""
    held: list[asyncio.StreamWriter] = []

    def hold(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    silent = await asyncio.start_server(hold, "127.0.0.1", 0)
    hole = f"http://127.0.0.1:{silent.sockets[0].getsockname()[1]}"
    syn = FetcherConfig("synthetic", {**SYNTHETIC, "max_windows": 50})
    try:
        async with relay(tmp_path / "leader", syn) as leader:
            await wait_until(lambda: last_scn(leader) >= 1049, 30)
            started = asyncio.get_running_loop().time()
            options = {"connect_timeout_s": 1.0, "read_margin_s": 2.0, "wait_s": 5.0}
            async with relay(tmp_path / "f", chain(hole, leader.url, **options)) as follower:
                await same_tail(leader, follower, seconds=30)
                took = asyncio.get_running_loop().time() - started
        assert held and took < 10, took  # each answer waited for 1 + 2 / 2 = 2 s at most
    finally:
        for writer in held:
            writer.close()
        silent.close()
        await silent.wait_closed()


# ---- falling off ---------------------------------------------------------------


async def test_follower_that_fell_off_records_one_data_loss_window(tmp_path: Path) -> None:
    syn = FetcherConfig("synthetic", {**SYNTHETIC, "windows_per_s": 1000, "max_windows": 4000})
    async with (
        relay(tmp_path / "leader", syn, capacity=256 << 10) as leader,
        aiohttp.ClientSession() as http,
    ):
        async with relay(tmp_path / "f", chain(leader.url), capacity=4 << 20) as follower:
            await wait_until(lambda: last_scn(follower) >= 1100, 30)
            host = follower.hosts[PART]
        stopped_at = host.buffer.meta.last_scn  # (the buffer stays readable when closed)
        await wait_until(lambda: last_scn(leader) == 4999, 60)
        upstream = leader.hosts[PART].buffer.meta
        assert upstream.prev_scn > stopped_at  # what the follower needs is gone upstream

        async with relay(tmp_path / "f", chain(leader.url), capacity=4 << 20) as follower:
            await same_tail(leader, follower)
            body = await stream_bytes(http, follower, stopped_at)
            assert data_losses(body) == [
                DataLoss(stopped_at + 1, upstream.prev_scn, data_losses(body)[0].reason)
            ]
            assert window_scns(body)[0] == upstream.prev_scn  # the loss window, then on
            # it ends at the upstream's position after prev_scn (a restart resumes there)
            eow = controls(body, Op.END_OF_WINDOW)[0]
            assert isinstance(eow, EndOfWindow)
            assert eow.source_position == upstream.prev_pos == f"synthetic:{upstream.prev_scn}"
            assert body.endswith(await stream_bytes(http, leader))  # the upstream's, as they are
            status = follower.hosts[PART].status()["fetcher"]
            assert status["data_loss_windows"] == 1
            assert status["lost_scns"] == upstream.prev_scn - stopped_at
            assert status["position"] == 4999
            assert len(await same_registry(http, leader, follower)) == 2
            # a consumer sees the gap, not a silent jump
            windows = await read_windows(
                follower.url, lambda w: w.data_loss is not None, on_data_loss="deliver"
            )
            assert windows[-1].data_loss is not None and windows[-1].scn == upstream.prev_scn


async def test_a_loss_ends_where_the_upstream_keeping_the_most_starts(tmp_path: Path) -> None:
    """Two upstreams that both evicted what follows the follower's position, at their own
    pace: the loss ended at the first one's ``prev_scn`` (the stream's 410), and the windows
    the other one still held between the two were recorded lost (review). It ends at the
    smallest ``prev_scn`` of the upstreams, and the rest comes from that one."""
    syn = FetcherConfig("synthetic", {**SYNTHETIC, "windows_per_s": 1000, "max_windows": 4000})
    async with (
        aiohttp.ClientSession() as http,
        relay(tmp_path / "leader", syn, capacity=16 << 20) as leader,
        relay(tmp_path / "small", chain(leader.url), capacity=256 << 10) as small,
        relay(tmp_path / "large", chain(leader.url), capacity=1 << 20) as large,
    ):
        async with relay(tmp_path / "f", chain(leader.url), capacity=16 << 20) as follower:
            await wait_until(lambda: last_scn(follower) >= 1100, 30)
            host = follower.hosts[PART]
        stopped_at = host.buffer.meta.last_scn
        await wait_until(lambda: last_scn(leader) == 4999, 60)
        await same_tail(leader, small, large)
        small_prev = small.hosts[PART].buffer.meta.prev_scn
        large_meta = large.hosts[PART].buffer.meta
        assert small_prev > large_meta.prev_scn > stopped_at  # both lack what it needs
        async with relay(tmp_path / "f", chain(small.url, large.url), capacity=16 << 20) as f:
            await same_tail(leader, f)
            body = await stream_bytes(http, f, stopped_at)
            losses = data_losses(body)
            assert [(d.from_scn, d.to_scn) for d in losses] == [
                (stopped_at + 1, large_meta.prev_scn)
            ]
            eow = controls(body, Op.END_OF_WINDOW)[0]
            assert isinstance(eow, EndOfWindow)
            assert eow.source_position == large_meta.prev_pos
            scns = window_scns(body)
            assert scns == [large_meta.prev_scn, *range(large_meta.prev_scn + 1, 5000)]
            assert f.hosts[PART].status()["fetcher"]["lost_scns"] == (
                large_meta.prev_scn - stopped_at
            )


async def test_an_upstream_down_for_a_moment_is_not_a_data_loss(tmp_path: Path) -> None:
    """Upstreams L (down for a moment: a rolling restart) and P (a small ring, past the
    follower's position): the stream gave up after P's 410 and a few failed tries of L,
    and the follower recorded a DATA_LOSS for windows L held all along (review). It now
    asks every upstream first, and reads again while one may hold them."""
    import dataclasses
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    syn = FetcherConfig("synthetic", {**SYNTHETIC, "windows_per_s": 1000, "max_windows": 4000})
    lcfg = config(tmp_path / "leader", syn, capacity=16 << 20)
    lcfg = dataclasses.replace(lcfg, http=HttpConfig(port=port, max_wait_s=10))
    lurl = f"http://127.0.0.1:{port}"
    async with (
        aiohttp.ClientSession() as http,
        Relay(lcfg) as leader,
        relay(tmp_path / "p", chain(lurl), capacity=256 << 10) as peer,
    ):
        async with relay(tmp_path / "f", chain(lurl), capacity=16 << 20) as follower:
            await wait_until(lambda: last_scn(follower) >= 1100, 30)
            host = follower.hosts[PART]
        stopped_at = host.buffer.meta.last_scn
        await wait_until(lambda: last_scn(leader) == 4999, 60)
        await same_tail(leader, peer)
        assert peer.hosts[PART].buffer.meta.prev_scn > stopped_at  # P lacks them
        purl = peer.url
        # L goes away for a moment; the follower starts meanwhile
        await leader.stop()
        async with relay(tmp_path / "f", chain(lurl, purl), capacity=16 << 20) as follower:
            await asyncio.sleep(3)  # (it gave up within about 0.3 s before)
            # (a DATA_LOSS window would have moved its newest SCN to P's prev_scn)
            assert last_scn(follower) == stopped_at
            assert follower.hosts[PART].state != "failed"
            async with Relay(lcfg) as leader_again:
                await same_tail(leader_again, follower)
                body = await stream_bytes(http, follower, stopped_at)
                assert data_losses(body) == []
                scns = window_scns(body)  # (L's synthetic source goes on after 4999)
                assert scns == list(range(stopped_at + 1, stopped_at + 1 + len(scns)))
                assert scns[-1] >= 4999
                assert (await stream_bytes(http, leader_again, stopped_at)).startswith(body)
                assert follower.hosts[PART].status()["fetcher"]["data_loss_windows"] == 0


# ---- fencing -----------------------------------------------------------------------


async def test_epoch_header_and_stale_upstream_refused(tmp_path: Path) -> None:
    syn = FetcherConfig("synthetic", {**SYNTHETIC, "max_windows": 200})
    async with (
        relay(tmp_path / "stale", syn) as stale,
        relay(
            tmp_path / "current",
            FetcherConfig("synthetic", {**SYNTHETIC, "max_windows": 200, "seed": 7}),
        ) as current,
        aiohttp.ClientSession() as http,
    ):
        await wait_until(lambda: last_scn(stale) == 1199 and last_scn(current) == 1199, 30)
        async with http.get(f"{stale.url}/v1/stream", params={"partition": PART}) as resp:
            assert EPOCH_HEADER not in resp.headers  # no epoch set: no header
        stale.hosts[PART].epoch, current.hosts[PART].epoch = 3, 4
        async with http.get(f"{stale.url}/v1/stream", params={"partition": PART}) as resp:
            assert resp.headers[EPOCH_HEADER] == "3"
        assert await stream_bytes(http, stale) != await stream_bytes(http, current)

        epoch = [4]
        fenced = chain(stale.url, current.url, min_epoch=lambda: epoch[0])
        async with relay(tmp_path / "f", fenced) as follower:
            await same_tail(current, follower)
            assert await stream_bytes(http, follower) == await stream_bytes(http, current)
            status = follower.hosts[PART].status()["fetcher"]
            assert status["refused_answers"] >= 1 and status["min_epoch"] == 4
            assert status["upstream"] == current.url and status["upstream_epoch"] == 4

            # the current one is deposed too: nothing more is appended from anyone
            epoch[0] = 5
            before = status["requests"]
            await wait_until(
                lambda: follower.hosts[PART].status()["fetcher"]["requests"] > before + 2
            )
            assert (
                follower.hosts[PART].status()["fetcher"]["refused_answers"]
                > status["refused_answers"]
            )
            assert last_scn(follower) == 1199


async def test_stale_answer_is_refused_before_any_window(tmp_path: Path) -> None:
    """The fetcher alone: every answer of an upstream below min_epoch is refused, none appended."""
    syn = FetcherConfig("synthetic", {**SYNTHETIC, "max_windows": 50})
    async with relay(tmp_path / "up", syn) as up:
        await wait_until(lambda: last_scn(up) == 1049, 30)
        up.hosts[PART].epoch = 1
        cfg = ChainConfig(upstream=(up.url,), wait_s=0.2, backoff_initial_s=0.01, max_attempts=3)
        fetcher = ChainFetcher(PART, 1, cfg, min_epoch=lambda: 2)
        await fetcher.start(ResumePoint())
        try:

            async def first_window() -> None:
                async with asyncio.timeout(20):
                    async for _ in fetcher.windows():
                        raise AssertionError("a window of a stale upstream was handed over")

            with pytest.raises(RelayUnavailableError) as info:
                await first_window()
            assert isinstance(info.value.__cause__, StaleUpstreamError)
            assert fetcher.refused == 3 and fetcher.windows_received == 0
        finally:
            await fetcher.close()


def test_options_are_checked() -> None:
    with pytest.raises(ConfigError):
        fetcher_factory(PART, 1, {})
    with pytest.raises(ConfigError):
        fetcher_factory(PART, 1, {"upstream": ["ftp://x"]})
    with pytest.raises(ConfigError):
        fetcher_factory(PART, 1, {"upstream": "http://x:1", "min_epoch": 3})
    fetcher = fetcher_factory(PART, 1, {"upstream": "http://x:1/", "partition": "up"})
    assert isinstance(fetcher, ChainFetcher)
    assert fetcher.config.upstream == ("http://x:1",) and fetcher.upstream_partition == "up"


async def test_partition_id_must_match_the_upstream(tmp_path: Path) -> None:
    syn = FetcherConfig("synthetic", {**SYNTHETIC, "max_windows": 10})
    async with relay(tmp_path / "up", syn) as up:
        fetcher = ChainFetcher(PART, 9, ChainConfig(upstream=(up.url,)))
        with pytest.raises(SourceConfigError):
            await fetcher.start(ResumePoint())
        await fetcher.close()


# ---- switching roles at run time ------------------------------------------------------


async def test_a_follower_takes_over_as_leader_and_back(tmp_path: Path) -> None:
    """switch_fetcher: follower -> leader (its own source) -> follower, nothing lost or doubled."""
    options = {**SYNTHETIC, "windows_per_s": 300, "max_windows": 3000}
    async with (
        relay(tmp_path / "a", FetcherConfig("synthetic", options)) as a,
        relay(tmp_path / "b", chain(a.url)) as b,
        aiohttp.ClientSession() as http,
    ):
        host = b.hosts[PART]
        await wait_until(lambda: last_scn(b) >= 1150, 30)
        await a.hosts[PART].switch_fetcher(FetcherConfig())  # the old leader stops reading
        await same_tail(a, b)
        handed_over = last_scn(b)
        assert await stream_bytes(http, b) == await stream_bytes(http, a)

        await host.switch_fetcher(FetcherConfig("synthetic", options))  # b leads now
        await wait_until(lambda: last_scn(b) >= handed_over + 100, 30)
        assert host.status()["fetcher"].get("kind") != "relay"
        await a.hosts[PART].switch_fetcher(chain(b.url))  # and a follows it
        await wait_until(lambda: last_scn(a) >= handed_over + 150, 30)

        await host.switch_fetcher(FetcherConfig())  # b steps down; a catches up, then leads
        await same_tail(b, a)
        await a.hosts[PART].switch_fetcher(FetcherConfig("synthetic", options))
        await host.switch_fetcher(chain(a.url))  # and b follows it
        await wait_until(lambda: last_scn(a) >= handed_over + 300, 30)
        await a.hosts[PART].switch_fetcher(FetcherConfig())  # a still stream, to compare
        await same_tail(a, b)
        body = await stream_bytes(http, b)
        assert window_scns(body) == list(range(1000, last_scn(a) + 1))  # none lost or twice
        assert body == await stream_bytes(http, a)
        assert host.status()["fetcher"]["kind"] == "relay" and host.state == "streaming"
        assert host.status()["fetcher"]["data_loss_windows"] == 0


async def test_an_upstream_whose_registry_numbers_tables_otherwise_is_refused(
    tmp_path: Path,
) -> None:
    """A follower whose registry names t0 source id 2 and t1 source id 1, following an
    upstream that numbers them the other way round (an upstream rebuilt, or another
    relay's): entries of tables it knew were dropped as known, and the upstream's rows
    were appended as they came, decoded as the other table (review). It is refused."""
    syn = FetcherConfig("synthetic", {**SYNTHETIC, "max_windows": 50})
    async with relay(tmp_path / "leader", syn) as leader:
        await wait_until(lambda: last_scn(leader) >= 1049, 30)
        entries = leader.hosts[PART].registry.to_json()
        assert {e["source_id"] for e in entries} == {1, 2}
        swapped = tuple({**e, "source_id": 3 - e["source_id"]} for e in entries)
        fetcher = ChainFetcher(PART, 1, ChainConfig(upstream=(leader.url,), wait_s=0.2))
        with pytest.raises(SourceConfigError, match="schema registry is not this relay's"):
            await fetcher.start(ResumePoint(scn=1049, schemas=swapped))
        # the same registry: followed
        same = ChainFetcher(PART, 1, ChainConfig(upstream=(leader.url,), wait_s=0.2))
        await same.start(ResumePoint(scn=1049, schemas=tuple(entries)))
        await same.close()


def test_the_largest_window_taken_from_the_upstream_is_an_option() -> None:
    """It was the client's 512 MiB, and no option could change it: an upstream's bigger
    window stopped the follower for good (review)."""
    from changebus.schemas.config import load_config_dict

    cfg = load_config_dict(
        ChainConfig, {"upstream": "http://127.0.0.1:1", "max_window_bytes": "1GiB"}
    )
    fetcher = ChainFetcher(PART, 1, cfg)
    assert fetcher._stream_config.max_window_bytes == 1 << 30


async def test_rows_of_schemas_no_upstream_gives_are_not_appended(tmp_path: Path) -> None:
    """Rows of schemas this relay lacks make it read the registry again; when that read
    did not bring them (a lagging upstream answered), they were marked known all the
    same and the window appended, its rows undecodable here for good (review). The
    window is fetched again instead, until a registry holds them."""
    syn = FetcherConfig("synthetic", {**SYNTHETIC, "max_windows": 50})
    async with relay(tmp_path / "leader", syn) as leader:
        await wait_until(lambda: last_scn(leader) >= 1049, 30)
        fetcher = ChainFetcher(PART, 1, ChainConfig(upstream=(leader.url,), wait_s=0.2))
        await fetcher.start(ResumePoint(scn=1020))  # (past the SCHEMA_CHANGE events)
        try:
            learned = fetcher._learn_schemas
            asked: list[str | None] = []

            async def lagging(serving: str | None = None) -> tuple[Any, ...]:
                asked.append(serving)
                return () if len(asked) < 3 else await learned(serving)

            fetcher._pending, fetcher._schemas = (), KnownSchemas()
            fetcher._learn_schemas = lagging  # type: ignore[method-assign]
            async with asyncio.timeout(30):
                window = await anext(aiter(fetcher.windows()))
            # the first two reads brought nothing: the window waited for the third
            assert len(asked) == 3
            assert {e["schema"]["name"] for e in window.schemas} == {
                "synthetic.t0",
                "synthetic.t1",
            }
        finally:
            await fetcher.close()
