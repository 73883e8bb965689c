"""A DATA_LOSS window from the relay is a gap in the bootstrap server's log, never a silent hole.

The relay reports SCNs it knows are lost (a chained relay that fell off its
upstream, an oversized window, a damaged ring at restart) as a DATA_LOSS
window. The bootstrap server's snapshot lacks whatever changed there, so it
records a gap at that window, like a producer that fell off the relay:

* the store: the gap is recorded in the same transaction as the window (a
  replay of it does not open it again);
* a real relay serving a scripted stream with a DATA_LOSS window, and a
  bootstrap server without a seed source: positions before the gap are
  refused (no snapshot lacking the range, no catch-up across it), positions
  after it are served, ``/v1/status`` and the log say what is missing and
  how to repair it, a consumer from nothing is refused with that message;
* Postgres -> relay -> bootstrap server with ``seed.dsn``: the relay restarts
  on a damaged ring while the bootstrap producer is behind, the producer gets
  the DATA_LOSS window, the server seeds itself again, and a new consumer
  ends exactly at the source's rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from changebus.bootstrap import (
    BootstrapConfig,
    BootstrapServer,
    HttpConfig as BootstrapHttp,
    SeedConfig,
    StoreConfig,
)
from changebus.bootstrap._plan import plan_bootstrap
from changebus.bootstrap._store import Store
from changebus.client import Consumer, ConsumerConfig, RelayUnavailableError
from changebus.fetchers import ResumePoint, Window, register_fetcher
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from changebus.schemas import (
    HEADER_SIZE,
    Column,
    DataLoss,
    EndOfWindow,
    Op,
    RowEncoder,
    SchemaChange,
    TableSchema,
    encode_control,
    parse_stream,
)
from waiting import wait_until

pytestmark = pytest.mark.usefixtures("no_blocking")

TABLE = TableSchema(
    "public.items", (Column("id", "long", nullable=False), Column("v", "string")), ("id",), 1
)
SID = 1
LOSS = DataLoss(15, 19, "test: ring damaged at restart")


def window(
    scn: int, rows: Sequence[tuple[int, str]] = (), *, announce: bool = False, loss: bool = False
) -> bytes:
    """A whole window: optionally the table's SCHEMA_CHANGE or the DATA_LOSS signal, rows."""
    ts = time.time_ns()
    events: list[bytes] = []
    if announce:
        change = SchemaChange(SID, TABLE.name, 1, TABLE.fingerprint, _schema_json())
        events.append(encode_control(change, scn, 0, ts, partition=1))
    if loss:
        events.append(encode_control(LOSS, scn, len(events), ts, partition=1))
    enc = RowEncoder(TABLE, source_id=SID, partition=1)
    for key, value in rows:
        events.append(enc.encode(Op.INSERT, scn, len(events), ts, {"id": key, "v": value}, None))
    events.append(
        encode_control(EndOfWindow(len(rows), f"s:{scn}"), scn, len(events), ts, partition=1)
    )
    return b"".join(events)


def _schema_json() -> str:
    return json.dumps(TABLE.to_json(), separators=(",", ":"))


#: the stream: rows in 10..14, SCNs 15..19 lost (reported in window 20), rows after
SCRIPT: list[tuple[int, bytes]] = [
    (10, window(10, [(1, "a"), (2, "b")], announce=True)),
    *[(scn, window(scn, [(scn, f"v{scn}")])) for scn in range(11, 15)],
    (20, window(20, loss=True)),
    (21, window(21, [(21, "after")])),
    (22, window(22, [(1, "a2")])),
]


class ScriptFetcher:
    """Serves :data:`SCRIPT` (or the windows after the resume point), then finishes."""

    def __init__(self, name: str, partition_id: int, options: Mapping[str, Any]) -> None:
        self.name = name
        self._after = -1

    async def start(self, resume: ResumePoint) -> int:
        self._after = resume.scn
        return max(resume.scn, SCRIPT[0][0] - 1)

    async def windows(self) -> AsyncIterator[Window]:
        for scn, data in SCRIPT:
            if scn > self._after:
                events = len(parse_stream(data)[0])
                yield Window(scn, time.time_ns(), data, events, f"s:{scn}")

    async def acknowledge(self, scn: int) -> None:
        return None

    async def close(self) -> None:
        return None

    def status(self) -> dict[str, Any]:
        return {"kind": "boot-loss-script"}


register_fetcher("boot-loss-script", ScriptFetcher)


# ---- the store ---------------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgres"])
def store(request: Any, tmp_path: Path) -> Iterator[Store]:
    if request.param == "sqlite":
        s = Store.sqlite(tmp_path / "s.db")
    else:
        s = Store.postgres(request.getfixturevalue("pg_dsn"))  # a fresh database
    yield s
    s.close()


def test_a_data_loss_window_opens_a_gap_with_it(store: Store) -> None:
    data = b"".join(d for _s, d in SCRIPT[:6])  # 10..14 and the loss at 20
    assert store.append("p", data, start_scn=9, lost=(14, 20)) == 20
    assert store.gap("p") == 20
    st = store.state("p")
    assert (st.producer_scn, st.log_min_scn, st.base_scn) == (20, 20, 9)
    # positions strictly inside the lost SCNs are lost for good; those around them are not
    assert [store.lost_range("p", p) for p in (-1, 14, 15, 19, 20)] == [
        None,
        None,
        (14, 20),
        (14, 20),
        None,
    ]
    # the applier folds the windows before it (the rows it has are right)
    store.apply("p")
    assert store.state("p").applier_scn == 20
    # a replay of the same windows (a restart) does not open it again once repaired
    store.seed_rows("p", TABLE.name, [], 500)
    store.put_schemas("p", [(SID, 1, TABLE.name, _schema_json())])
    store.seed_rows("p", TABLE.name, [], 500)
    assert store.clear_gap("p") and store.gap("p") is None
    store.append("p", data, start_scn=9, lost=(14, 20))
    assert store.gap("p") is None
    # a later window with a loss opens a new one
    store.append("p", SCRIPT[6][1] + window(30, loss=True), lost=(21, 30))
    assert store.gap("p") == 30 and store.seeded("p") == {}
    assert store.lost_ranges("p") == [(14, 20), (21, 30)]
    # a loss in the very first window: the range starts where the history does
    store.append("q", window(20, loss=True), start_scn=9, lost=(-1, 20))
    assert store.lost_ranges("q") == [(9, 20)] and store.lost_range("q", 9) is None
    assert store.lost_range("p", 20) is None and store.lost_range("p", 29) == (21, 30)


def test_a_gap_on_a_quiet_source_leaves_a_snapshot_a_catch_up_can_follow(store: Store) -> None:
    """A producer that fell off the relay of a source that then went quiet: the log starts
    again at the gap's end with no window after it. The applier stayed before it, so a
    consumer from nothing got a snapshot at an SCN the log no longer holds windows after,
    the catch-up was refused (410, run the snapshot again), and it looped until the source
    wrote again (found by review)."""
    store.append("p", b"".join(d for _s, d in SCRIPT[:5]), start_scn=9)  # 10..14
    store.apply("p")
    store.mark_gap("p", 20)  # fell off: SCNs up to 20 may be missing, no window at 20
    store.put_schemas("p", [(SID, 1, TABLE.name, _schema_json())])
    store.seed_rows("p", TABLE.name, [], 500)
    assert store.clear_gap("p")
    store.apply("p")  # (the applier runs on; no window came)
    st = store.state("p")
    assert (st.applier_scn, st.log_min_scn, st.producer_scn) == (20, 20, 20)
    plan = plan_bootstrap(store, "p", -1, 0.5)
    assert plan["snapshot"] and plan["start_scn"] >= plan["log_min_scn"], plan


def test_windows_and_their_gap_commit_together(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure (or a crash) recording the gap keeps none of the windows either."""
    data = b"".join(d for _s, d in SCRIPT[:6])

    def fail(part: str, gap_end: int, *, after: int | None = None) -> None:
        raise RuntimeError("crash while recording the gap")

    monkeypatch.setattr(store, "mark_gap", fail)
    with pytest.raises(RuntimeError):
        store.append("p", data, start_scn=9, lost=(14, 20))
    assert store.state("p").producer_scn == -1
    assert store.counts("p")["log_events"] == 0
    monkeypatch.undo()
    store.append("p", data, start_scn=9, lost=(14, 20))  # the replay after the restart
    assert store.gap("p") == 20 and store.state("p").producer_scn == 20


# ---- a relay with a DATA_LOSS window, a bootstrap server without a seed source ---------


def relay_config(data_dir: Path) -> RelayConfig:
    return RelayConfig(
        data_dir=data_dir,
        http=HttpConfig(port=0, max_wait_s=10),
        partitions=(
            PartitionConfig(
                "syn",
                1,
                capacity_bytes=4 << 20,
                fetcher=FetcherConfig("boot-loss-script", {}),
            ),
        ),
        flush_interval_s=0,
    )


async def get(url: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http, http.get(url) as r:
        if r.content_type == "application/json":
            return r.status, await r.json()
        return r.status, await r.read()


async def test_a_data_loss_window_is_a_gap_positions_before_it_are_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="changebus.bootstrap")
    async with Relay(relay_config(tmp_path / "relay")) as relay:
        await wait_until(lambda: relay.hosts["syn"].buffer.meta.last_scn >= 22, 20, "the relay")
        cfg = BootstrapConfig(
            relays=(relay.url,),
            data_dir=tmp_path / "boot",
            store=StoreConfig(kind="sqlite", path=tmp_path / "boot" / "b.db"),
            http=BootstrapHttp(port=0),
        )
        async with BootstrapServer(cfg) as boot:
            w = boot.service.workers["syn"]
            await wait_until(lambda: w.applier_scn >= 22, 20, "the bootstrap applier")
            assert await boot.service.stores.read(lambda s: s.gap("syn")) == 20
            assert w.data_loss == 1 and w.state == "streaming"
            # /v1/status says the snapshot misses a range, and how to repair it
            status, body = await get(boot.url + "/v1/status")
            part = body["partitions"][0]
            gap = part["gap"]
            assert gap["before_scn"] == 20 and gap["snapshot_complete"] is False
            assert "15..19" in gap["reason"] and LOSS.reason in gap["reason"]
            assert "POST /v1/seed?partition=syn" in gap["repair"]
            assert "seed.dsn" in gap["repair"]
            assert part["data_loss"] == 1 and "15..19" in part["last_error"]
            async with aiohttp.ClientSession() as http, http.get(boot.url + "/metrics") as r:
                text = await r.text()
            assert 'changebus_bootstrap_gap_before_scn{partition="syn"} 20.0' in text
            assert 'changebus_bootstrap_data_loss_total{partition="syn"} 1.0' in text
            # ... and so does the log
            said = [r.getMessage() for r in caplog.records if r.name == "changebus.bootstrap"]
            assert any("15..19" in m and "POST /v1/seed" in m for m in said), said
            base = f"{boot.url}/v1/bootstrap"
            # positions before the gap (and from nothing): no snapshot lacking the range
            for since in (-1, 9, 12, 14):
                status, body = await get(f"{base}/start?partition=syn&since={since}")
                assert status == 503, (since, body)
                assert body["error"] == "not_yet" and body["gap_scn"] == 20
                assert "misses changes up to SCN 20" in body["message"]
                assert "POST /v1/seed?partition=syn" in body["message"]
                status, body = await get(f"{base}/snapshot?partition=syn&since={since}&start=22")
                assert status == 503 and body["gap_scn"] == 20
            # positions inside the lost SCNs: refused for good (no seed repairs them)
            for since in (15, 19):
                for what in ("start?", "snapshot?start=22&"):
                    status, body = await get(f"{base}/{what}partition=syn&since={since}")
                    assert status == 410 and body["lost_upto_scn"] == 20, (since, what, body)
                    assert body["lost_after_scn"] == 14
            # ... and no catch-up across it
            status, body = await get(f"{base}/catchup?partition=syn&after=12&target=22")
            assert status == 410, body
            # a position at or after the gap is served: the windows after it, no loss signal
            status, plan = await get(f"{base}/start?partition=syn&since=20")
            assert status == 200 and plan["snapshot"] is False and plan["start_scn"] == 20
            status, data = await get(f"{base}/catchup?partition=syn&after=20&target=22")
            assert status == 200
            _offsets, headers = parse_stream(data)
            assert sorted(set(headers["scn"].tolist())) == [21, 22]
            assert int(Op.DATA_LOSS) not in headers["op"].tolist()
            # a consumer from nothing is told why, never handed the incomplete snapshot
            ccfg = ConsumerConfig(
                relays=(relay.url,),
                partition="syn",
                bootstrap_servers=(boot.url,),
                max_attempts=2,
                backoff_initial_s=0.01,
                backoff_max_s=0.05,
                wait_s=0.5,
            )
            async with Consumer(ccfg) as consumer:
                with pytest.raises(RelayUnavailableError) as info:
                    await asyncio.wait_for(consumer.__anext__(), 30)
            assert "misses changes up to SCN 20" in str(info.value)
        # a restart keeps the gap and says so again
        caplog.clear()
        async with BootstrapServer(cfg) as boot:
            w = boot.service.workers["syn"]
            assert w.gap is not None and w.gap.before_scn == 20
            status, body = await get(boot.url + "/v1/status")
            assert body["partitions"][0]["gap"]["before_scn"] == 20
            said = [r.getMessage() for r in caplog.records if r.name == "changebus.bootstrap"]
            assert any("up to SCN 20" in m and "POST /v1/seed" in m for m in said), said
            status, body = await get(f"{boot.url}/v1/bootstrap/start?partition=syn&since=12")
            assert status == 503


# ---- Postgres: a relay restarted on a damaged ring, a bootstrap server that re-seeds --------


@pytest.mark.pg
async def test_a_relay_restarted_on_a_damaged_ring_makes_the_bootstrap_seed_again(
    tmp_path: Path, pg_dsn: str
) -> None:
    from boot_e2e import (
        assert_same,
        bootstrap_caught_up,
        consumer_config,
        create_tables,
        replica_rows,
        replica_to,
        source_rows,
        sync_marker,
        workload,
    )

    from changebus.relay._buffer import BufferConfig, EventBuffer

    create_tables(pg_dsn)
    port = _free_port()
    rcfg = RelayConfig(
        data_dir=tmp_path / "relay",
        http=HttpConfig(port=port),
        partitions=(
            PartitionConfig(
                "pg",
                1,
                capacity_bytes=8 << 20,
                fetcher=FetcherConfig("postgres", {"dsn": pg_dsn, "status_interval_s": 0.2}),
            ),
        ),
        flush_interval_s=0,
    )
    bcfg = BootstrapConfig(
        relays=(f"http://127.0.0.1:{port}",),
        data_dir=tmp_path / "boot",
        store=StoreConfig(kind="sqlite", path=tmp_path / "boot" / "b.db"),
        http=BootstrapHttp(port=0),
        seed=SeedConfig(dsn=pg_dsn, chunk_rows=200),
    )
    relay_ctx: contextlib.AsyncExitStack = contextlib.AsyncExitStack()
    relay = await relay_ctx.enter_async_context(Relay(rcfg))
    try:
        await wait_until(lambda: relay.hosts["pg"].state == "streaming")
        async with BootstrapServer(bcfg) as boot:
            w = boot.service.workers["pg"]
            await asyncio.to_thread(workload, pg_dsn, 31, 300)
            marker = sync_marker(pg_dsn)
            await bootstrap_caught_up(boot, marker)
            # the producer stalls; the relay takes more windows, then stops
            producer = w.tasks[0]
            producer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await producer
            await asyncio.to_thread(workload, pg_dsn, 32, 400)
            lost_marker = sync_marker(pg_dsn)
            await wait_until(lambda: relay.hosts["pg"].buffer.meta.last_scn >= lost_marker)
            await relay_ctx.aclose()

            # a bit flips in the ring, in a window the bootstrap server has not read, and
            # one in the newest window (with the windows after the first intact, the
            # relay would count the windows up to it as evicted instead: no DATA_LOSS)
            def damage() -> tuple[int, int]:
                directory = tmp_path / "relay" / "pg"
                buf = EventBuffer(directory, BufferConfig(capacity_bytes=8 << 20))
                try:
                    m = buf.meta
                    k = next(
                        i
                        for i in range(m.head_event, m.tail_event)
                        if int(buf._events.at(i)["scn"]) > w.producer_scn
                    )
                    k += (m.tail_event - k) // 3
                    pos, bad = int(buf._events.at(k)["pos"]), int(buf._events.at(k)["scn"])
                    newest = int(buf._events.at(m.tail_event - 1)["pos"])
                    last = m.last_scn
                finally:
                    buf.close()
                ring = directory / "ring.dat"
                raw = bytearray(ring.read_bytes())
                raw[pos % (8 << 20) + HEADER_SIZE + 1] ^= 1 << 3
                raw[newest % (8 << 20) + 10] ^= 1 << 3
                ring.write_bytes(bytes(raw))
                return bad, last

            bad_scn, last_scn = await asyncio.to_thread(damage)
            assert bad_scn > w.producer_scn
            relay_ctx = contextlib.AsyncExitStack()
            relay = await relay_ctx.enter_async_context(Relay(rcfg))
            await wait_until(lambda: relay.hosts["pg"].state == "streaming")
            assert relay.hosts["pg"].buffer.stats["recovery_events_dropped"] > 0
            # the producer goes on: it gets the DATA_LOSS window and seeds again
            w.tasks[0] = asyncio.create_task(boot.service._produce(w))
            await wait_until(lambda: w.data_loss > 0, 30, "the DATA_LOSS window")
            assert w.seeding is not None
            await wait_until(lambda: w.seed.state in ("done", "failed"), 90, "the re-seed")
            assert w.seed.state == "done", w.seed.error
            assert w.seed.scn >= last_scn
            assert await boot.service.stores.read(lambda s: s.gap("pg")) is None
            assert w.gap is None
            await asyncio.to_thread(workload, pg_dsn, 33, 100)
            marker = sync_marker(pg_dsn)
            await bootstrap_caught_up(boot, marker)
            # a new consumer gets the changes the relay lost, through the seed
            db = tmp_path / "new.db"
            replica = await replica_to(db, consumer_config(relay.url, boot.url), marker)
            assert replica.phases[0] == "snapshot"
            assert_same(replica_rows(db), source_rows(pg_dsn))
    finally:
        await relay_ctx.aclose()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_plan_before_the_applier_folded_anything_says_not_yet(store: Store) -> None:
    """A store whose history starts after the source's (log_min_scn >= 0) and whose
    applier has folded nothing yet planned a snapshot at SCN -1: the client could not
    hold that snapshot's position and stopped with a non-retriable error (review)."""
    from changebus.schemas import NotYetError

    store.append("p", b"".join(d for _s, d in SCRIPT[:5]), start_scn=9)  # 10..14, not folded
    st = store.state("p")
    assert st.applier_scn == -1 and st.log_min_scn >= 0 and st.producer_scn == 14
    with pytest.raises(NotYetError, match="no window yet"):
        plan_bootstrap(store, "p", -1, 0.5)
    store.apply("p")
    plan = plan_bootstrap(store, "p", -1, 0.5)
    assert plan["start_scn"] >= 0, plan
