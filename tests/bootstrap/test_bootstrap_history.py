"""A consumer holding rows of a snapshot does not continue it on a server with a shorter history.

It was part way through a snapshot that started at SCN T on server A, and A is
gone. Server B answers with tombstones for the deletes after its own
``base_scn``; when that is after T, a row the consumer holds that was deleted
between T and B's base would stay for good. The consumer refuses B with a
clear error instead.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from synthetic_boot import synthetic_boot

from changebus.client import ConsumerConfig
from changebus.client._bootstrap import Bootstrapper
from changebus.client._decode import SchemaCache
from changebus.client._queue import WindowQueue
from changebus.schemas import (
    BootstrapFailedError,
    BootstrapProgress,
    Mode,
    NotYetError,
    PartitionCheckpoint,
)
from stub_http import serve_routes

pytestmark = pytest.mark.usefixtures("no_blocking")


async def test_a_server_whose_history_starts_later_is_refused(tmp_path: Path) -> None:
    async with synthetic_boot(tmp_path, 40) as (relay, boot), aiohttp.ClientSession() as http:
        last = relay.hosts["syn"].buffer.meta.last_scn
        base = boot.service.workers["syn"].base_scn
        config = ConsumerConfig(relays=(relay.url,), partition="syn", bootstrap_servers=(boot.url,))
        queue = WindowQueue(1 << 16, 1 << 30)  # (large: the snapshot is queued, not read)
        runner = Bootstrapper(config, http, queue, SchemaCache())

        def held(start: int) -> PartitionCheckpoint:
            progress = BootstrapProgress(
                since_scn=-1, start_scn=start, snapshot_position="0:7", server="http://a.gone:1"
            )
            return PartitionCheckpoint(
                window_scn=start, prev_scn=start, mode=Mode.SNAPSHOT, bootstrap=progress
            )

        # rows of a snapshot that started before this server's history: refused
        with pytest.raises(BootstrapFailedError, match=f"starts at SCN {base}"):
            await runner._run_once(boot.url, -1, held(base - 5), True)
        # one that started within it: this server goes on with a snapshot of its own
        target = await asyncio.wait_for(runner._run_once(boot.url, -1, held(base), True), 30)
    assert base > 0 and target >= last


async def test_a_snapshot_position_of_another_store_restarts_the_snapshot(
    tmp_path: Path,
) -> None:
    """Row ids are a store's own. Behind one load-balanced URL (or after a store was
    rebuilt under it) a position from store A resumed on store B and skipped rows:
    positions now name their store, and another store's is a 410 that restarts
    the snapshot (the client's RestartBootstrap), not a terminal failure."""
    from changebus.client._http import RestartBootstrap, response_error

    async with synthetic_boot(tmp_path, 30) as (_relay, boot), aiohttp.ClientSession() as http:
        url = f"{boot.url}/v1/bootstrap/snapshot"
        async with http.get(f"{boot.url}/v1/bootstrap/start", params={"partition": "syn"}) as r:
            start = str((await r.json())["start_scn"])
        base = {"partition": "syn", "start": start, "max_bytes": "200"}
        async with http.get(url, params=base) as resp:
            assert resp.status == 200
            position = resp.headers["X-Changebus-Snapshot-Position"]
        source, row, store = position.split(":")
        assert len(store) == 16
        for pos, status in (
            (position, 200),  # its own store
            (f"{source}:{row}", 200),  # (a position of an older server: no store named)
            (f"{source}:{row}:{'0' * 16}", 410),  # another store's
        ):
            async with http.get(url, params={**base, "position": pos}) as resp:
                assert resp.status == status, (pos, await resp.text())
                if status == 410:
                    error = await response_error(resp, "b", kind="bootstrap")
    assert isinstance(error, RestartBootstrap)


async def test_a_restarted_snapshot_checks_the_history_of_the_store_behind_the_url(
    tmp_path: Path,
) -> None:
    """A consumer part way through a snapshot that started at T is told by its own
    server's URL that the position is another store's (the store was rebuilt, or
    another server answers there): the snapshot restarts. The restart forgot T and
    skipped the history check, so a store whose history starts after T was taken,
    and rows deleted in between stayed for good (found by review)."""
    async with synthetic_boot(tmp_path, 40) as (relay, boot), aiohttp.ClientSession() as http:
        base = boot.service.workers["syn"].base_scn
        config = ConsumerConfig(relays=(relay.url,), partition="syn", bootstrap_servers=(boot.url,))

        def held(start: int) -> PartitionCheckpoint:
            progress = BootstrapProgress(  # (a position of another store behind this URL)
                since_scn=-1, start_scn=start, snapshot_position="0:7:" + "0" * 16, server=boot.url
            )
            return PartitionCheckpoint(
                window_scn=-1, prev_scn=-1, mode=Mode.SNAPSHOT, bootstrap=progress
            )

        runner = Bootstrapper(config, http, WindowQueue(1 << 16, 1 << 30), SchemaCache())
        with pytest.raises(BootstrapFailedError, match=f"starts at SCN {base}, after SCN"):
            await asyncio.wait_for(runner.run(-1, held(base - 5)), 30)
        runner = Bootstrapper(config, http, WindowQueue(1 << 16, 1 << 30), SchemaCache())
        assert await asyncio.wait_for(runner.run(-1, held(base)), 30) >= base  # within it


async def test_a_server_whose_history_starts_too_late_passes_to_the_next(tmp_path: Path) -> None:
    """Its refusal (410: the position is older than its history) is the server's own;
    it stopped the consumer although the next configured server could serve it."""
    async with (
        synthetic_boot(tmp_path / "late", 20, start_scn=5000) as (_late_relay, late),
        synthetic_boot(tmp_path / "full", 40) as (relay, full),
        aiohttp.ClientSession() as http,
    ):
        last = relay.hosts["syn"].buffer.meta.last_scn
        config = ConsumerConfig(
            relays=(relay.url,), partition="syn", bootstrap_servers=(late.url, full.url)
        )
        runner = Bootstrapper(config, http, WindowQueue(1 << 16, 1 << 30), SchemaCache())
        assert await asyncio.wait_for(runner.run(1010, None), 30) >= last
        # with the late server alone, its refusal ends the bootstrap
        alone = ConsumerConfig(relays=(relay.url,), partition="syn", bootstrap_servers=(late.url,))
        runner = Bootstrapper(alone, http, WindowQueue(1 << 16, 1 << 30), SchemaCache())
        with pytest.raises(BootstrapFailedError, match="older than this bootstrap server"):
            await asyncio.wait_for(runner.run(1010, None), 30)


async def test_a_position_in_a_servers_lost_range_is_refused_and_passes_to_the_next(
    tmp_path: Path,
) -> None:
    """A server that never received SCNs (its producer fell off the relay, or the relay
    reported them lost) cannot serve a consumer whose position, or the start of
    the snapshot it holds rows of, lies inside them: the consumer may hold a row
    inserted and deleted there, which the server can send no delete for. Its
    410 passes the consumer to the next server; alone, it ends the bootstrap
    with the reason and the way out."""
    async with (
        synthetic_boot(tmp_path / "gap", 40) as (_gap_relay, gappy),
        synthetic_boot(tmp_path / "full", 40) as (relay, full),
        aiohttp.ClientSession() as http,
    ):
        last = relay.hosts["syn"].buffer.meta.last_scn
        await gappy.service.stores.write(lambda s: s.mark_gap("syn", 1030, after=1020))
        async with http.get(f"{gappy.url}/v1/bootstrap/status?partition=syn") as r:
            assert (await r.json())["lost_ranges"] == [[1020, 1030]]
        for since, status in ((1020, 503), (1021, 410), (1029, 410), (1030, 200)):
            params = {"partition": "syn", "since": str(since)}
            async with http.get(f"{gappy.url}/v1/bootstrap/start", params=params) as r:
                assert r.status == status, (since, await r.text())
                if status == 410:
                    body = await r.json()
                    assert (body["lost_after_scn"], body["lost_upto_scn"]) == (1020, 1030)
                    assert "never received" in body["message"]
        config = ConsumerConfig(
            relays=(relay.url,), partition="syn", bootstrap_servers=(gappy.url, full.url)
        )
        runner = Bootstrapper(config, http, WindowQueue(1 << 16, 1 << 30), SchemaCache())
        assert await asyncio.wait_for(runner.run(1025, None), 30) >= last
        alone = ConsumerConfig(relays=(relay.url,), partition="syn", bootstrap_servers=(gappy.url,))
        runner = Bootstrapper(alone, http, WindowQueue(1 << 16, 1 << 30), SchemaCache())
        with pytest.raises(BootstrapFailedError, match="never received") as info:
            await asyncio.wait_for(runner.run(1025, None), 30)
        assert "reset the consumer's state" in str(info.value)

        # rows of another server's bootstrap that may come from the range: refused too --
        # a snapshot that started inside it, or before it (its pages carry rows at their
        # latest version), or a catch-up that went past its start
        def held(mode: Mode, start: int, window: int) -> PartitionCheckpoint:
            progress = BootstrapProgress(
                since_scn=1000,
                start_scn=start,
                target_scn=1040 if mode is Mode.CATCHUP else -1,
                snapshot_position="0:7" if mode is Mode.SNAPSHOT else "",
                server="http://a.gone:1",
            )
            return PartitionCheckpoint(
                window_scn=window, prev_scn=window, mode=mode, bootstrap=progress
            )

        for mode, start, window in (
            (Mode.SNAPSHOT, 1025, 1025),
            (Mode.SNAPSHOT, 1010, 1010),
            (Mode.CATCHUP, 1010, 1022),
        ):
            with pytest.raises(BootstrapFailedError, match="never received SCNs 1020 < SCN < 1030"):
                await runner._run_once(gappy.url, -1, held(mode, start, window), True)
        # a catch-up that stopped before the range holds nothing from it: that check passes
        # (the gap not repaired yet, without a seed source, is what refuses it then)
        with pytest.raises(NotYetError, match="misses changes up to SCN 1030"):
            await runner._run_once(gappy.url, -1, held(Mode.CATCHUP, 1010, 1020), True)


async def test_snapshot_rows_keep_their_commit_time(tmp_path: Path) -> None:
    """A snapshot row is the row's state: its own SCN and its own commit time. The time
    was the page's (0): every row read from a snapshot said 1970-01-01 (the Spark
    source's ``_commit_timestamp`` too), found by review."""
    import time

    from changebus.client import Consumer

    async with synthetic_boot(tmp_path, 40) as (relay, boot):
        config = ConsumerConfig(relays=(relay.url,), partition="syn", bootstrap_servers=(boot.url,))
        async with Consumer(config) as consumer:
            window = await asyncio.wait_for(consumer.__anext__(), 30)
    assert window.phase == "snapshot" and window.events
    now = time.time_ns()
    assert all(0 < now - e.timestamp_ns < 600 * 10**9 for e in window.events)


async def test_a_bounded_read_s_catch_up_stops_at_until_scn(tmp_path: Path) -> None:
    """``until_scn`` ended a read at the first relay window at or past it, but a
    bootstrap's catch-up went on to the server's newest window and delivered windows
    past it (found by review). The catch-up now stops there."""
    async with synthetic_boot(tmp_path, 40) as (relay, boot), aiohttp.ClientSession() as http:
        last = relay.hosts["syn"].buffer.meta.last_scn
        since, until = 1005, 1015  # (the synthetic source's windows: SCNs from 1001)
        assert until < last
        config = ConsumerConfig(
            relays=(relay.url,), partition="syn", bootstrap_servers=(boot.url,), until_scn=until
        )
        queue = WindowQueue(1 << 16, 1 << 30)
        runner = Bootstrapper(config, http, queue, SchemaCache())
        target = await asyncio.wait_for(runner._run_once(boot.url, since, None, False), 30)
        scns = [w.scn for w in queue._items if w.events]
    assert target == until
    assert scns and max(scns) <= until


async def test_a_catch_up_goes_on_after_its_last_window_on_another_server(
    tmp_path: Path,
) -> None:
    """A catch-up that failed over to another bootstrap server was planned again there
    from its ``since``: the windows queued already came a second time, SCNs going
    backwards (found by review). It goes on after the last window queued."""
    async with synthetic_boot(tmp_path, 40) as (relay, boot), aiohttp.ClientSession() as http:
        last = relay.hosts["syn"].buffer.meta.last_scn
        since, done = last - 6, last - 3  # (windows the server's log keeps)
        log_min = (await boot.service.stores.read(lambda s: s.state("syn"))).log_min_scn
        assert log_min <= since
        for catchup_only in (False, True):
            config = ConsumerConfig(
                relays=(relay.url,),
                partition="syn",
                bootstrap_servers=(boot.url,),
                bootstrap_catchup_only=catchup_only,
            )
            queue = WindowQueue(1 << 16, 1 << 30)
            runner = Bootstrapper(config, http, queue, SchemaCache())
            progress = BootstrapProgress(
                since_scn=since, start_scn=since, target_scn=last, server="http://a.gone:1"
            )
            resume = PartitionCheckpoint(
                window_scn=done, prev_scn=done, mode=Mode.CATCHUP, bootstrap=progress
            )
            target = await asyncio.wait_for(runner._run_once(boot.url, since, resume, True), 30)
            scns = [w.scn for w in queue._items if w.events]
            assert target >= last
            assert scns == sorted(scns) and scns[0] == done + 1, (catchup_only, scns[:3])


async def test_a_bounded_read_through_a_bootstrap_ends_at_until_scn(tmp_path: Path) -> None:
    """A consumer from the earliest window with ``until_scn`` at the source's last
    window: the bootstrap's catch-up reached it, but the read ended only on a relay
    window, so it waited for the next change of a quiet source for ever (review)."""
    from changebus.client import Consumer

    async with synthetic_boot(tmp_path, 40) as (relay, boot):
        last = relay.hosts["syn"].buffer.meta.last_scn
        config = ConsumerConfig(
            relays=(relay.url,),
            partition="syn",
            bootstrap_servers=(boot.url,),
            start="earliest",
            until_scn=last,
        )
        seen = []

        async def read() -> None:
            async with Consumer(config) as consumer:
                async for window in consumer:
                    seen.append((window.phase, window.scn))

        await asyncio.wait_for(read(), 30)
    assert seen[0][0] == "snapshot" and seen[-1][1] == last


async def test_an_older_server_refusing_mode_catchup_is_failed_over(tmp_path: Path) -> None:
    """A server from before mode=catchup refuses the parameter (400, not retriable): a
    catch-up-only consumer stopped at once instead of trying the next server (review).
    It is a BootstrapFailedError now, which the failover moves on from."""
    from aiohttp import web

    async def start(request: web.Request) -> web.Response:
        return web.json_response(
            {"error": "bad_request", "message": "unknown parameter(s): mode", "retriable": False},
            status=400,
        )

    async with serve_routes({"/v1/bootstrap/start": start}) as old:
        config = ConsumerConfig(
            relays=("http://127.0.0.1:9",),
            partition="syn",
            bootstrap_servers=(old,),
            bootstrap_catchup_only=True,
        )
        async with aiohttp.ClientSession() as http:
            boot = Bootstrapper(config, http, WindowQueue(16, 1 << 20), SchemaCache())
            with pytest.raises(BootstrapFailedError, match="cannot plan a catch-up only"):
                await boot._api.start(old, 5, boot.partition)


async def test_a_checkpoint_names_the_bootstrap_server_without_its_password(
    tmp_path: Path,
) -> None:
    """The checkpoint's ``server`` was the configured URL, user and password included: they
    reached checkpoint files, ``on_checkpoint`` and debug logs (review). A checkpoint
    written so still resumes on that server."""
    async with synthetic_boot(tmp_path, 40) as (relay, boot), aiohttp.ClientSession() as http:
        last = relay.hosts["syn"].buffer.meta.last_scn
        secret_url = boot.url.replace("http://", "http://reader:s3cret@")
        config = ConsumerConfig(
            relays=(relay.url,), partition="syn", bootstrap_servers=(secret_url,)
        )
        queue = WindowQueue(1 << 16, 1 << 30)
        runner = Bootstrapper(config, http, queue, SchemaCache())
        assert await asyncio.wait_for(runner.run(-1, None), 30) >= last
        first = await queue.get()
        queued = first.checkpoint
        assert first.phase == "snapshot"
        assert queued is not None and queued.bootstrap is not None
        text = repr(queued)
        assert "s3cret" not in str(text) and "reader@" not in str(text)
        assert queued.bootstrap.server == boot.url
        # an older checkpoint naming the server with its password resumes there too
        old = PartitionCheckpoint(
            window_scn=-1,
            prev_scn=-1,
            mode=Mode.SNAPSHOT,
            bootstrap=BootstrapProgress(
                since_scn=-1, start_scn=queued.bootstrap.start_scn, server=secret_url
            ),
        )
        queue = WindowQueue(1 << 16, 1 << 30)
        again = Bootstrapper(config, http, queue, SchemaCache())
        assert await asyncio.wait_for(again.run(-1, old), 30) >= last
        resumed = (await queue.get()).checkpoint
        assert (
            resumed is not None and resumed.bootstrap is not None and "s3cret" not in repr(resumed)
        )
        # (on another server it would plan afresh from -1, a new start)
        assert resumed.bootstrap.start_scn == queued.bootstrap.start_scn
        assert resumed.bootstrap.server == boot.url
