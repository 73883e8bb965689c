"""Durable acknowledgement (issue 19): ``durability = "page_cache" | "fsync"`` per partition.

* configuration: the TOML key, and a ConfigError naming the valid modes;
* the grouped syncer: page-aligned circular ranges, many windows covered by
  few syncs, and recovery of an ``fsync`` buffer that rewinds instead of
  owing a DATA_LOSS window;
* the relay: the source is never acknowledged beyond what is synced, acks
  never go backwards, ``/v1/status`` and ``/metrics`` show the figures;
* a simulated OS crash on a real Postgres: test_durability_crash.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from test_recovery_damage import _get, get_json, zero_ring

from changebus.relay import (
    BufferConfig,
    EventBuffer,
    FetcherConfig,
    HttpConfig,
    PartitionConfig,
    Relay,
    RelayConfig,
)
from changebus.relay._meta import MetaFile
from changebus.relay._syncer import GroupSyncer, circular_spans
from changebus.relay._tables import EVENT_DTYPE, CircularTable
from changebus.schemas import (
    ConfigError,
    EndOfWindow,
    Op,
    encode_control,
    encode_event,
    parse_stream,
)
from changebus.schemas.config import load_config_dict
from fix_pg import wait_until

CAP = 1 << 20


def make_window(scn: int, events: int = 2, size: int = 100) -> bytes:
    parts = [
        encode_event(Op.INSERT, scn, i, scn * 1000 + i, f"k{scn}-{i}".encode(), b"v" * size)
        for i in range(events)
    ]
    parts.append(encode_control(EndOfWindow(events, f"pos-{scn}"), scn, events, scn * 1000 + 9))
    return b"".join(parts)


# ---- configuration -------------------------------------------------------------


def test_durability_is_a_partition_setting_with_named_modes() -> None:
    assert PartitionConfig("p").durability == "page_cache"
    assert PartitionConfig("p", durability="fsync").buffer.durability == "fsync"
    with pytest.raises(ConfigError, match="page_cache, fsync"):
        PartitionConfig("p", durability="sometimes")  # type: ignore[arg-type]
    cfg = load_config_dict(
        RelayConfig, {"partitions": [{"name": "p", "durability": "fsync"}]}, "relay"
    )
    assert cfg.partitions[0].durability == "fsync"
    with pytest.raises(ConfigError, match="fsync"):
        load_config_dict(
            RelayConfig, {"partitions": [{"name": "p", "durability": "disk"}]}, "relay"
        )


# ---- the syncer ----------------------------------------------------------------


def test_circular_spans_are_page_aligned_and_wrap() -> None:
    page = 4096
    assert circular_spans(10, 10, CAP) == []
    assert circular_spans(10, 20, CAP) == [(0, page)]
    assert circular_spans(page + 1, 3 * page - 1, CAP) == [(page, 3 * page)]
    # a range over the end of the file: two spans
    assert circular_spans(CAP - 10, CAP + 10, CAP) == [(CAP - page, CAP), (0, page)]
    assert circular_spans(5 * CAP + 3, 5 * CAP + 9, CAP) == [(0, page)]
    # a lap or more: the whole file
    assert circular_spans(7, 7 + CAP, CAP) == [(0, CAP)]
    # a file whose size is not a page multiple ends at its size
    assert circular_spans(0, 100, 1000) == [(0, 1000)]


async def test_one_sync_covers_many_windows(tmp_path: Path) -> None:
    """Windows appended while a sync runs are covered by the next one."""
    buf = EventBuffer(tmp_path, BufferConfig(capacity_bytes=CAP, durability="fsync"))
    buf.set_start(0)
    syncer = GroupSyncer(buf)
    gate = threading.Event()
    real = buf.sync_spans
    calls: list[int] = []

    def slow_spans(since: Any, upto: Any) -> Any:
        calls.append(upto.last_scn)
        if len(calls) == 2:  # hold the second sync until the writer appended much more
            gate.wait(10)
        return real(since, upto)

    buf.sync_spans = slow_spans  # type: ignore[method-assign]
    syncer.start()
    try:
        assert await asyncio.wait_for(syncer.wait_synced(-1), 10) == 0  # the full first sync
        buf.append_window(make_window(1))
        syncer.request()
        await wait_until(lambda: len(calls) == 2)
        for scn in range(2, 502):  # the writer goes on while the sync is held
            buf.append_window(make_window(scn))
            syncer.request()
        assert syncer.synced_scn == 0
        gate.set()
        assert await asyncio.wait_for(syncer.wait_synced(1), 10) >= 1
        while syncer.synced_scn < 501:
            await asyncio.wait_for(syncer.wait_synced(syncer.synced_scn), 10)
        assert syncer.syncs == 3  # whole files, window 1, windows 2..501 in one
        assert calls == [0, 1, 501]
        assert syncer.status() == {
            "mode": "fsync",
            "synced_scn": 501,
            "syncs": 3,
            "sync_seconds_total": pytest.approx(syncer.sync_seconds_total, abs=1e-5),
        }
    finally:
        gate.set()
        await asyncio.to_thread(syncer.stop)
        buf.close()


def test_spans_cover_the_new_bytes_records_and_meta_in_order(tmp_path: Path) -> None:
    buf = EventBuffer(tmp_path, BufferConfig(capacity_bytes=CAP, durability="fsync"))
    buf.set_start(0)
    before = buf.meta
    for scn in range(1, 40):
        buf.append_window(make_window(scn, size=3000))
    after = buf.meta
    spans = buf.sync_spans(before, after)
    assert [name for name, _, _ in spans] == ["ring.dat", "events.dat", "index.dat", "meta.dat"]
    ring = int(buf._ring.ctypes.data)
    (_, addr, length) = spans[0]
    assert addr == ring
    assert length >= after.tail_pos - before.tail_pos
    assert all((a - ring) % 4096 == 0 for _, a, _ in spans[:1])
    whole = buf.sync_spans(None, after)
    assert whole[0] == ("ring.dat", ring, CAP)
    buf.close()


def test_a_flush_syncs_every_file_whole_through_libc(tmp_path: Path, monkeypatch: Any) -> None:
    """The periodic flush msyncs through libc, which lets go of the GIL (``mmap.flush``
    held it: a flush of 256 dirty MiB stopped the event loop for 60-120 ms)."""
    from changebus.relay import _syncer

    real = _syncer._libc_msync()
    calls: list[tuple[int, int]] = []

    def msync(address: int, length: int, flag: int) -> int:
        calls.append((address, length))
        return int(real(address, length, flag))

    monkeypatch.setattr(_syncer, "_libc_msync", lambda: msync)
    buf = EventBuffer(tmp_path, BufferConfig(capacity_bytes=CAP))
    buf.set_start(0)
    buf.append_window(make_window(1, size=3000))
    buf.flush()
    assert calls == [(a, n) for _, a, n in buf.sync_spans(None, buf.meta)]
    assert calls[0] == (int(buf._ring.ctypes.data), CAP)
    buf.close()


# ---- recovery ------------------------------------------------------------------


def _hundred_windows(directory: Path, durability: str) -> BufferConfig:
    """A closed buffer of windows 1..100 (wrapped); its config."""
    cfg = BufferConfig(capacity_bytes=CAP, durability=durability)  # type: ignore[arg-type]
    buf = EventBuffer(directory, cfg)
    buf.set_start(0)
    for scn in range(1, 101):
        buf.append_window(make_window(scn))
    buf.close()
    return cfg


def _damage_ring_from(directory: Path, capacity: int, event: int) -> tuple[int, int]:
    """Zero the ring from event number ``event`` to the tail; (its SCN, last SCN)."""
    meta = MetaFile(directory / "meta.dat").load()
    assert meta is not None
    table = CircularTable(directory / "events.dat", EVENT_DTYPE, meta.event_slots, create=False)
    rec = table.at(event)
    start, scn = int(rec["pos"]), int(rec["scn"])
    table.close()
    zero_ring(directory / "ring.dat", capacity, start, meta.tail_pos)
    return scn, meta.last_scn


@pytest.mark.parametrize("durability", ["fsync", "page_cache", "chained"])
def test_recovery_rewinds_with_fsync_and_owes_data_loss_with_page_cache(
    tmp_path: Path, durability: str
) -> None:
    """``chained``: a page_cache relay following another relay rewinds as with fsync (its
    upstream still has the windows; a DATA_LOSS window stopped its consumers: review)."""
    chained = durability == "chained"
    mode = "page_cache" if chained else durability
    cfg = _hundred_windows(tmp_path, mode)
    # window 71 starts at event (71 - 1) * 3: damage from there on
    bad, last = _damage_ring_from(tmp_path, CAP, 70 * 3)
    assert (bad, last) == (71, 100)
    again = EventBuffer(tmp_path, cfg, replayable=chained)
    m = again.meta
    sel = again.select(-1, -1, 1 << 24)
    assert sel is not None
    data = b"".join(bytes(v) for v in sel.views)
    again.release(sel)
    _, headers = parse_stream(data)
    ops = headers["op"].tolist()
    if durability != "page_cache":
        assert m.last_scn == 70
        assert Op.DATA_LOSS not in ops
        assert again.last_source_position == "pos-70"  # the fetcher resumes there
        again.append_window(make_window(71))  # the source sends 71.. again
        assert again.meta.last_scn == 71
    else:
        assert m.last_scn == 100
        assert ops.count(Op.DATA_LOSS) == 1
    again.close()


@pytest.mark.parametrize("durability", ["fsync", "page_cache"])
def test_damage_before_windows_intact_to_the_tail_keeps_them_with_fsync_too(
    tmp_path: Path, durability: str
) -> None:
    """With fsync, damage in a middle window (an eviction's bytes there: a group placed at
    the next lap's start over a window that follows intact ones, then an OS crash before
    the meta file's sync; or a flipped bit) rewound the buffer to before it: the windows
    after it, synced and acknowledged, were dropped, and the source no longer held them
    (review). Windows that verify to the tail are kept, those before count as evicted."""
    cfg = _hundred_windows(tmp_path, durability)
    meta = MetaFile(tmp_path / "meta.dat").load()
    assert meta is not None
    table = CircularTable(tmp_path / "events.dat", EVENT_DTYPE, meta.event_slots, create=False)
    first = table.at(meta.head_event)
    start, end = int(table.at(70 * 3)["pos"]), int(table.at(71 * 3)["pos"])  # window 71
    oldest = int(first["scn"])
    table.close()
    zero_ring(tmp_path / "ring.dat", CAP, start, end)
    again = EventBuffer(tmp_path, cfg)
    m = again.meta
    assert (m.prev_scn, m.min_scn, m.last_scn) == (71, 72, 100)
    assert again.last_source_position == "pos-100"  # the fetcher resumes where it was
    sel = again.select(71, -1, 1 << 24)
    assert sel is not None
    data = b"".join(bytes(v) for v in sel.views)
    again.release(sel)
    _, headers = parse_stream(data)
    assert Op.DATA_LOSS not in headers["op"].tolist()
    assert sorted(set(headers["scn"].tolist())) == list(range(72, 101))
    assert oldest < 71  # (the windows before the damage were there: counted as evicted)
    again.close()


def test_fsync_recovery_of_a_damaged_oldest_window_starts_after_prev_scn(tmp_path: Path) -> None:
    cfg = BufferConfig(capacity_bytes=CAP, durability="fsync")
    buf = EventBuffer(tmp_path, cfg)
    buf.set_start(40)
    for scn in range(41, 51):
        buf.append_window(make_window(scn))
    buf.close()
    _damage_ring_from(tmp_path, CAP, 0)
    again = EventBuffer(tmp_path, cfg)
    m = again.meta
    assert (m.prev_scn, m.last_scn, m.tail_event - m.head_event) == (40, 40, 0)
    again.append_window(make_window(41))
    assert again.meta.last_scn == 41
    again.close()


# ---- the relay: acknowledgements -----------------------------------------------


def _synthetic_relay(tmp: Path, durability: str) -> RelayConfig:
    fetcher = FetcherConfig(
        "synthetic", {"windows_per_s": 2000, "events_per_window": 2, "row_bytes": 64}
    )
    part = PartitionConfig(
        "syn",
        1,
        capacity_bytes=8 << 20,
        durability=durability,  # type: ignore[arg-type]
        fetcher=fetcher,
    )
    return RelayConfig(data_dir=tmp, http=HttpConfig(port=0), partitions=(part,))


@pytest.mark.usefixtures("no_blocking")
async def test_acks_never_pass_the_synced_scn_and_never_go_backwards(tmp_path: Path) -> None:
    async with Relay(_synthetic_relay(tmp_path, "fsync")) as relay:
        host = relay.hosts["syn"]
        syncer = host.syncer
        assert syncer is not None
        await wait_until(lambda: host.fetcher is not None and host.state == "streaming")
        fetcher = host.fetcher
        assert fetcher is not None
        acks: list[tuple[int, int, int]] = []
        real = fetcher.acknowledge

        async def recording(scn: int) -> None:
            acks.append((scn, syncer.synced_scn, host.buffer.meta.last_scn))
            await real(scn)

        fetcher.acknowledge = recording  # type: ignore[method-assign]
        await wait_until(lambda: len(acks) >= 20, 20)
        await asyncio.sleep(0.3)
        st = host.status()["durability"]
    assert all(scn <= synced for scn, synced, _ in acks), acks[:5]
    assert [a[0] for a in acks] == sorted(a[0] for a in acks)
    # acks trail the appends: grouped syncs, far fewer than windows
    assert st["mode"] == "fsync"
    assert st["syncs"] > 0
    assert st["synced_scn"] > 0
    windows = host.buffer.stats["windows_appended"]
    assert st["syncs"] < windows


@pytest.mark.usefixtures("no_blocking")
async def test_status_and_metrics_show_durability(tmp_path: Path) -> None:
    config = _synthetic_relay(tmp_path, "fsync")
    page = PartitionConfig("plain", 2, capacity_bytes=1 << 20)
    config = RelayConfig(
        data_dir=tmp_path, http=HttpConfig(port=0), partitions=(*config.partitions, page)
    )
    async with Relay(config) as relay:
        host = relay.hosts["syn"]
        await wait_until(lambda: host.syncer is not None and host.syncer.synced_scn > 0)
        status = await asyncio.to_thread(get_json, relay.port, "/v1/status")
        metrics = await asyncio.to_thread(_get, relay.port, "/metrics")
    by_name = {p["name"]: p for p in status["partitions"]}
    durable = by_name["syn"]["durability"]
    assert durable["mode"] == "fsync"
    assert durable["synced_scn"] > 0
    assert durable["syncs"] > 0
    assert durable["sync_seconds_total"] > 0
    assert by_name["plain"]["durability"]["mode"] == "page_cache"
    text = metrics[2].decode()
    assert 'changebus_relay_syncs_total{partition="syn"}' in text
    assert 'changebus_relay_sync_seconds_count{partition="syn"}' in text
    assert 'changebus_relay_synced_scn{partition="syn"}' in text
    assert 'changebus_relay_syncs_total{partition="plain"}' not in text


@pytest.mark.usefixtures("no_blocking")
async def test_page_cache_acknowledges_every_group_as_before(tmp_path: Path) -> None:
    async with Relay(_synthetic_relay(tmp_path, "page_cache")) as relay:
        host = relay.hosts["syn"]
        assert host.syncer is None
        await wait_until(lambda: getattr(host.fetcher, "acknowledged", -1) > 0)
        fetcher = host.fetcher
        await wait_until(
            lambda: host.buffer.meta.last_scn - getattr(fetcher, "acknowledged", -1) < 100
        )


class Fence:
    """A leader's fence the test controls: lease, hold, and refusals heard."""

    def __init__(self) -> None:
        self.valid = True
        self.acks_valid = True
        self.hold = (1 << 63) - 1
        self.refusals: list[str] = []

    def admit(self) -> bool:
        return self.valid

    def ack_scn(self, scn: int) -> int | None:
        return min(scn, self.hold) if self.valid and self.acks_valid else None

    def refused(self, reason: str) -> None:
        self.refusals.append(reason)


@pytest.mark.usefixtures("no_blocking")
async def test_fsync_acks_go_through_the_fence(tmp_path: Path) -> None:
    """ack = min(synced, fence limit); a refusal by the fence at ack time stops the ingest."""
    config = RelayConfig(
        data_dir=tmp_path,
        http=HttpConfig(port=0),
        partitions=(PartitionConfig("syn", 1, capacity_bytes=8 << 20, durability="fsync"),),
    )
    syn = _synthetic_relay(tmp_path, "fsync").partitions[0].fetcher
    async with Relay(config) as relay:
        host = relay.hosts["syn"]
        syncer = host.syncer
        assert syncer is not None
        fence = Fence()
        await host.switch_fetcher(syn, fence=fence)
        await wait_until(lambda: syncer.synced_scn > 0 and host.buffer.meta.windows > 50, 20)
        fetcher = host.fetcher
        assert fetcher is not None
        fence.hold = syncer.synced_scn  # followers hold no more than this
        held = fence.hold
        await wait_until(lambda: syncer.synced_scn > held + 20, 20)
        assert fetcher.status()["acknowledged_scn"] <= held
        fence.hold = (1 << 63) - 1
        await host.acknowledge_held()
        assert held < fetcher.status()["acknowledged_scn"] <= syncer.synced_scn
        fence.acks_valid = False  # the next sync's acknowledgement is refused
        await wait_until(lambda: host.state == "fenced", 10)
        assert len(fence.refusals) == 1
        assert "not acknowledged" in fence.refusals[0]
        assert host.fetcher is None


@pytest.mark.usefixtures("no_blocking")
async def test_a_failed_sync_makes_the_partition_not_ready(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """msync failing for good stops the acknowledgements: /readyz says so (503, the reason)."""
    from changebus.relay import _syncer

    async with Relay(_synthetic_relay(tmp_path, "fsync")) as relay:
        host = relay.hosts["syn"]
        syncer = host.syncer
        assert syncer is not None
        await wait_until(lambda: syncer.synced_scn > 0)
        code, _, _ = await asyncio.to_thread(_get, relay.port, "/readyz")
        assert code == 200

        def failing(spans: list[Any]) -> bool:
            raise OSError(5, f"msync of {spans[0][0]}: Input/output error")

        monkeypatch.setattr(_syncer, "msync_spans", failing)
        await wait_until(lambda: bool(syncer.error))
        code, _, body = await asyncio.to_thread(_get, relay.port, "/readyz")
        assert code == 503
        assert b"sync failed" in body
        stuck = syncer.synced_scn
        await asyncio.sleep(0.3)
        assert syncer.synced_scn == stuck
        # and nothing more is ingested (the fetcher's unacknowledged windows and the
        # source's retained log grew until a restart: review)
        await wait_until(lambda: host.state == "failed")
        assert "ingest stopped" in host.last_error
        last = host.buffer.meta.last_scn
        await asyncio.sleep(0.3)
        assert host.buffer.meta.last_scn == last


def test_a_fsync_follower_registers_the_newest_window_on_its_disk() -> None:
    """A follower's registered ``max_scn`` is what the leader may acknowledge to the source
    up to. It was the newest window in the follower's buffer, also with ``durability =
    "fsync"``, so the leader acknowledged windows that follower would lose in an OS crash
    (review). Now it is the newest synced one; a leader and a page_cache follower say
    their buffer's newest."""
    from types import SimpleNamespace

    from changebus.relay._cluster import PartitionRole

    meta = SimpleNamespace(min_scn=10, last_scn=90)

    def state(plan: str, synced: int | None) -> tuple[str, int]:
        syncer = None if synced is None else SimpleNamespace(synced_scn=synced)
        role = SimpleNamespace(
            host=SimpleNamespace(buffer=SimpleNamespace(meta=meta), syncer=syncer, epoch=4),
            min_epoch=4,
            plan=(plan, 0, ""),
        )
        st = PartitionRole.state(role)  # type: ignore[arg-type]
        return st.role, st.max_scn

    assert state("follow", 70) == ("follower", 70)
    assert state("follow", -1) == ("follower", 0)
    assert state("follow", None) == ("follower", 90)
    assert state("lead", 70) == ("leader", 90)

    # a follower whose syncs failed for good registers nothing (it would hold the
    # leader's acknowledgements back until restarted); a leader still registers
    def registered(plan: str, error: str) -> bool:
        syncer = SimpleNamespace(synced_scn=70, error=error)
        host = SimpleNamespace(syncer=syncer, state="streaming")
        role = SimpleNamespace(host=host, plan=(plan, 0, ""))
        return bool(PartitionRole.registered(role))  # type: ignore[arg-type]

    assert registered("follow", "") and registered("lead", "msync failed")
    assert not registered("follow", "msync failed")


async def test_a_chained_relay_s_buffer_replays_what_recovery_drops(tmp_path: Path) -> None:
    """The host opens a follower's (fetcher ``relay``) buffer as replayable."""
    from changebus.relay._host import PartitionHost

    for kind, options, replayable in (
        ("relay", {"upstream": ["http://127.0.0.1:9"]}, True),
        ("synthetic", {}, False),
    ):
        part = PartitionConfig(
            "syn", 1, capacity_bytes=1 << 20, fetcher=FetcherConfig(kind, options)
        )
        host = PartitionHost(part, tmp_path / kind)
        try:
            assert host.buffer.replayable is replayable
        finally:
            host.buffer.close()


def test_a_sync_never_covers_a_window_the_meta_file_does_not_name_yet(tmp_path: Path) -> None:
    """The writer set the buffer's meta before it wrote the meta file, and the syncer
    reads the meta without the lock: a sync between the two reported the new window
    synced, and the source was acknowledged past what recovery would find after an OS
    crash (review)."""
    from test_buffer import make_window

    from changebus.relay._buffer import BufferConfig, EventBuffer
    from changebus.relay._meta import _SLOT, _newest

    buf = EventBuffer(tmp_path / "b", BufferConfig(capacity_bytes=1 << 20, durability="fsync"))
    buf.set_start(0)
    buf.append_window(make_window(1, [100]))
    syncer = GroupSyncer(buf)
    runner = threading.Thread(target=syncer._run, daemon=True)
    runner.start()
    gate, entered = threading.Event(), threading.Event()
    try:
        deadline = time.monotonic() + 10
        while syncer.synced_scn < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert syncer.synced_scn == 1
        publish = buf._metafile.publish

        def slow(meta: Any) -> None:
            if meta.last_scn == 2:
                entered.set()
                gate.wait(10)
            publish(meta)

        buf._metafile.publish = slow  # type: ignore[method-assign]
        writer = threading.Thread(target=buf.append_window, args=(make_window(2, [100]),))
        writer.start()
        assert entered.wait(10)
        syncer.request()
        time.sleep(0.3)  # (a sync round, had it seen window 2)
        newest = _newest((tmp_path / "b" / "meta.dat").read_bytes(), _SLOT)
        assert newest is not None
        on_disk = newest[1]
        assert syncer.synced_scn <= on_disk.last_scn == 1
        gate.set()
        writer.join(10)
        syncer.request()
        deadline = time.monotonic() + 10
        while syncer.synced_scn < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert syncer.synced_scn == 2
    finally:
        gate.set()
        syncer.stop()
        runner.join(10)
        buf.close()


async def test_a_periodic_flush_runs_one_at_a_time_and_logs_its_failure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The relay's periodic flush was queued on the writer thread every interval, whether
    the one before had ended or not (slow flushes piled up ahead of appends), and its
    result was dropped: a failed msync showed only as an unretrieved future (review)."""
    import asyncio
    import errno
    import logging
    import threading

    from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig

    cfg = RelayConfig(
        data_dir=tmp_path / "relay",
        http=HttpConfig(port=0),
        partitions=(
            PartitionConfig(
                "fl", 1, capacity_bytes=1 << 20, fetcher=FetcherConfig("synthetic", {"tables": 1})
            ),
        ),
        flush_interval_s=0,
    )
    async with Relay(cfg) as relay:
        host = relay.hosts["fl"]
        calls: list[int] = []
        release = threading.Event()

        def slow() -> None:
            calls.append(1)
            release.wait(5)

        host.buffer.flush = slow  # type: ignore[method-assign]
        first = asyncio.create_task(host.flush())
        await asyncio.sleep(0.05)
        await asyncio.gather(host.flush(), host.flush())  # skipped: one is running
        release.set()
        await first
        assert calls == [1]

        def failing() -> None:
            raise OSError(errno.EIO, "Input/output error")

        host.buffer.flush = failing  # type: ignore[method-assign]
        with caplog.at_level(logging.ERROR, logger="changebus.relay.ingest"):
            await host.flush()
        assert "partition fl: flushing the buffer failed" in caplog.text
        del host.buffer.flush  # (the real one closes the buffer)
