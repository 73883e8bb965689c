"""Old tombstones are purged: a store with churn stops growing, and no consumer is misled.

A tombstone tells a consumer at an older position that a row was deleted.
Kept for ever, a table whose rows are inserted and deleted again made the
store grow for ever. Now tombstones older than ``applier.tombstone_keep_s``
and below the log's start are deleted, and positions before the purged
deletes are refused (410: start from nothing), since a snapshot could no
longer name the rows deleted after them.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from synthetic_boot import synthetic_relay
from test_store import (
    SID,
    full_bootstrap,
    replay,
    store as store,  # the fixture: both dialects
    window,
)

from changebus.bootstrap import (
    ApplierConfig,
    BootstrapConfig,
    BootstrapServer,
    HttpConfig,
    StoreConfig,
)
from changebus.bootstrap._plan import check_position
from changebus.bootstrap._store import Store
from changebus.client import ConsumerConfig
from changebus.client._bootstrap import Bootstrapper
from changebus.client._decode import SchemaCache
from changebus.client._queue import WindowQueue
from changebus.relay import Relay
from changebus.schemas import (
    BootstrapFailedError,
    BootstrapProgress,
    Mode,
    Op,
    PartitionCheckpoint,
    ScnNotFoundError,
    decode_header,
)
from waiting import wait_until


def _switch(
    relay_url: str, boot_url: str, http: aiohttp.ClientSession
) -> Callable[[int], Awaitable[int]]:
    """A consumer that holds rows of a snapshot another (gone) server started at an SCN
    resuming its bootstrap on ``boot_url``: the bootstrap's target SCN."""
    config = ConsumerConfig(relays=(relay_url,), partition="syn", bootstrap_servers=(boot_url,))
    runner = Bootstrapper(config, http, WindowQueue(1 << 16, 1 << 30), SchemaCache())

    async def run(start: int) -> int:
        progress = BootstrapProgress(
            since_scn=-1, start_scn=start, snapshot_position="0:7", server="http://a.gone:1"
        )
        held = PartitionCheckpoint(
            window_scn=start, prev_scn=start, mode=Mode.SNAPSHOT, bootstrap=progress
        )
        return await runner._run_once(boot_url, -1, held, True)

    return run


_LOG_FROM = 2000  # the log is pruned up to here
_CUTOFF_NS = 15_000  # deletes before SCN 1500 are old (events are stamped 10 x SCN ns)


def _churn() -> list[bytes]:
    """300 windows (SCN 100 + 10 i): key i inserted, key i - 5 deleted, and every
    seventh window key i - 20 inserted again (its tombstone becomes a row again)."""
    t1 = SID[min(SID)].name
    out = []
    for i in range(300):
        changes: list[tuple[str, Op, int, str | None]] = [(t1, Op.INSERT, i, f"v{i}")]
        if i >= 5:
            changes.append((t1, Op.DELETE, i - 5, None))
        if i >= 20 and i % 7 == 0:
            changes.append((t1, Op.INSERT, i - 20, f"again {i}"))
        out.append(window(100 + 10 * i, changes))
    return out


def _tombstones(s: Store) -> set[tuple[int, bytes, int]]:
    rows = s._all("SELECT source_id, key, scn FROM cb_snap WHERE part = 'p' AND deleted = 1")
    return {(int(a), bytes(b), int(c)) for a, b, c in rows}


def _live(s: Store) -> set[tuple[int, bytes, int, bytes]]:
    rows = s._all("SELECT source_id, key, scn, event FROM cb_snap WHERE part = 'p' AND deleted = 0")
    return {(int(a), bytes(b), int(c), bytes(d)) for a, b, c, d in rows}


def _purge_all(s: Store, cutoff_ns: int, limit: int) -> tuple[int, int]:
    """Purge steps until one says nothing more is to do; returns (purged, steps)."""
    purged = steps = 0
    while True:
        n, more = s.purge_tombstones("p", cutoff_ns, limit=limit)
        purged, steps = purged + n, steps + 1
        if not more:
            return purged, steps


@pytest.mark.parametrize("limit", [7, 10_000])
def test_old_tombstones_below_the_log_go_and_older_positions_are_refused(
    store: Store, limit: int
) -> None:
    wins = _churn()
    store.append("p", b"".join(wins), start_scn=0)
    store.apply("p")
    assert store.prune_log("p", _LOG_FROM) > 0
    before, live = _tombstones(store), _live(store)
    young = min(scn for _s, _k, scn in before if scn >= 1500)
    assert young < _LOG_FROM
    assert store.tomb_scn("p") == -1

    purged, steps = _purge_all(store, _CUTOFF_NS, limit)

    after = _tombstones(store)
    newest_gone = max(t[2] for t in before if t[2] < young)
    assert store.tomb_scn("p") == newest_gone
    assert after == {t for t in before if t[2] >= young}  # every one above it is kept
    assert purged == len(before - after) > 0
    assert _live(store) == live  # no live row touched
    assert steps >= (purged // limit if limit < 100 else 1)
    # positions: before the purged deletes refused; at it, or from nothing, served
    with pytest.raises(ScnNotFoundError, match="deletes this bootstrap server keeps"):
        check_position(store, "p", newest_gone - 1, seeding=False)
    check_position(store, "p", newest_gone, seeding=False)
    check_position(store, "p", -1, seeding=False)
    # a consumer at the horizon still ends with the source's rows
    truth: dict[tuple[str, int], str | None] = {}
    have: dict[tuple[str, int], str | None] = {}
    for i, w in enumerate(wins):
        replay(w, truth)
        if 100 + 10 * i <= newest_gone:
            replay(w, have)
    full_bootstrap(store, newest_gone, have)
    assert have == truth

    # every delete old: the purge stops at the log's start, never past it
    _purge_all(store, 10**18, limit)
    assert store.tomb_scn("p") == max(t[2] for t in before if t[2] <= _LOG_FROM)
    assert _tombstones(store) == {t for t in before if t[2] > _LOG_FROM}
    assert store.purge_tombstones("p", 10**18) == (0, False)


def test_a_purge_that_finds_no_tombstone_refuses_nobody(store: Store) -> None:
    """Only a purged delete makes older positions unservable: the purge reading rows
    without tombstones moves no horizon (it did at first: a data-loss test caught a
    410 for a position nothing was purged after)."""
    t1 = SID[min(SID)].name
    store.append(
        "p", b"".join(window(10 * i, [(t1, Op.INSERT, i, "x")]) for i in range(1, 30)), start_scn=0
    )
    store.apply("p")
    store.prune_log("p", 200)
    assert _purge_all(store, 10**18, 7)[0] == 0
    assert store.tomb_scn("p") == -1
    check_position(store, "p", 5, seeding=False)


def test_a_purge_step_finishes_a_big_transaction_and_moves_on(store: Store) -> None:
    """An SCN with more rows than a step's limit: the step reads it whole (it must end
    between two SCNs), so purging never stalls on it."""
    t1 = SID[min(SID)].name
    store.append(
        "p",
        window(10, [(t1, Op.INSERT, k, "x") for k in range(60)])
        + window(20, [(t1, Op.DELETE, k, None) for k in range(50)])
        + window(30, [(t1, Op.DELETE, k, None) for k in range(50, 55)])
        + window(40, [(t1, Op.INSERT, 99, "y")]),
        start_scn=0,
    )
    store.apply("p")
    store.prune_log("p", 40)
    n, more = store.purge_tombstones("p", 10**18, limit=10)
    assert (n, more) == (50, True) and store.tomb_scn("p") == 20
    n, more = store.purge_tombstones("p", 10**18, limit=10)
    assert n == 5 and store.tomb_scn("p") == 30
    assert _tombstones(store) == set()
    page = store.snapshot_page(
        "p", sorted(SID), since_scn=40, start_scn=40, position=(0, 0), max_bytes=1 << 20
    )
    assert page.complete and page.events == 0


async def test_a_running_server_purges_and_refuses_positions_before_it(tmp_path: Path) -> None:
    """The applier purges every ``purge_interval_s``; the status, the metrics and the
    plan say so. A consumer holding rows of another server's snapshot that started
    before the purged deletes is refused when it switches here (it could keep a row
    deleted meanwhile); one whose snapshot started at the reported base goes on."""
    relay_cfg = synthetic_relay(
        tmp_path / "relay", 400, keys=40, update_ratio=0.2, delete_ratio=0.4, start_scn=1000
    )
    async with Relay(relay_cfg) as relay:
        await wait_until(lambda: relay.hosts["syn"].buffer.meta.windows >= 400)
        last = relay.hosts["syn"].buffer.meta.last_scn
        cfg = BootstrapConfig(
            relays=(relay.url,),
            data_dir=tmp_path / "boot",
            store=StoreConfig(kind="sqlite", path=tmp_path / "boot" / "b.db"),
            http=HttpConfig(port=0),
            applier=ApplierConfig(
                log_keep_events=200, tombstone_keep_s=0.001, purge_interval_s=0.05
            ),
        )
        async with BootstrapServer(cfg) as boot, aiohttp.ClientSession() as http:
            w = boot.service.workers
            await wait_until(lambda: "syn" in w and w["syn"].applier_scn >= last, what="applier")
            done = boot.service.stores.read
            await wait_until(lambda: w["syn"].log_min_scn > 1000, what="log pruned")
            scanned = await done(lambda s: s._purge_state("syn")[1])
            for _ in range(200):  # (10 s)
                if scanned >= w["syn"].log_min_scn:
                    break
                await asyncio.sleep(0.05)
                scanned = await done(lambda s: s._purge_state("syn")[1])
            tomb = w["syn"].tomb_scn
            assert 1000 < tomb <= scanned == w["syn"].log_min_scn
            left = await boot.service.stores.read(
                lambda s: s._all(
                    "SELECT count(*), min(scn) FROM cb_snap WHERE part = 'syn' AND deleted = 1"
                )
            )
            base = f"{boot.url}/v1/bootstrap"
            async with http.get(f"{base}/status", params={"partition": "syn"}) as resp:
                status = await resp.json()
            async with http.get(
                f"{base}/start", params={"partition": "syn", "since": str(tomb - 1)}
            ) as resp:
                refused, why = resp.status, (await resp.json())["message"]
            async with http.get(
                f"{base}/start", params={"partition": "syn", "since": str(tomb)}
            ) as resp:
                served = resp.status
            async with http.get(f"{boot.url}/metrics") as resp:
                metrics = await resp.text()
            switch = _switch(relay.url, boot.url, http)
            with pytest.raises(BootstrapFailedError, match=f"starts at SCN {status['base_scn']}"):
                await switch(tomb - 1)
            target = await asyncio.wait_for(switch(status["base_scn"]), 30)
    assert target >= last
    assert w["syn"].tombstones_purged > 0
    count, oldest = left[0]
    assert count == 0 or int(oldest) > tomb
    assert status["tomb_scn"] == tomb and status["base_scn"] >= tomb
    assert refused == 410 and "purged" in why
    assert served == 200
    purged = [ln for ln in metrics.splitlines() if ln.startswith("changebus_bootstrap_tombstones")]
    assert any(json.loads(ln.rsplit(" ", 1)[1]) > 0 for ln in purged), purged


def test_the_purge_stops_at_what_is_applied(store: Store) -> None:
    """A gap's repair moves the log's start past windows the applier has yet to apply:
    the purge went up to the log's start, and the tombstones those windows brought
    later were never purged (found by review)."""
    wins = _churn()
    store.append("p", b"".join(wins), start_scn=0)
    st = store.apply("p", 400)  # part of the log only
    assert 0 <= st.applier_scn < 2000
    store.mark_gap("p", 3000)  # (the log's start moves to the gap's end)
    assert store.state("p").log_min_scn >= 3000 > store.state("p").applier_scn
    _purge_all(store, 10**18, 10_000)
    scanned = store._purge_state("p")[1]
    assert scanned <= st.applier_scn
    assert store.tomb_scn("p") <= st.applier_scn


def test_swept_tombstones_are_stamped_when_made(store: Store) -> None:
    """A sweep (a gap's re-seed, a re-snapshot) turns rows no longer in the source into
    tombstones. Stamped with the row's last write (here SCN x 10 ns after the epoch),
    the purge took them for old at once and refused consumers behind the log
    (found by review): they carry the time they were made."""
    t = SID[min(SID)]
    store.put_schemas("p", [(min(SID), t.version, t.name, json.dumps(t.to_json()))])
    store.append("p", window(100, [(t.name, Op.INSERT, 1, "a")]), start_scn=0)
    store.apply("p")
    rows = store._all("SELECT key, event FROM cb_snap WHERE part = 'p' AND deleted = 0")
    t0 = time.time_ns()
    tombs = store._tombstones("p", rows, 200)
    assert len(tombs) == 1
    assert decode_header(tombs[0][-1]).timestamp_ns >= t0


async def test_a_page_read_while_the_purge_deletes_its_tombstones_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The page's position was checked before its rows were read, and the purge (the
    writer's own statements) could delete the tombstones after ``since`` in between:
    the last page went out as whole without those deletes, and the catch-up after it
    never sends them (found by review). The position is checked again after the read."""
    relay_cfg = synthetic_relay(
        tmp_path / "relay", 400, keys=40, update_ratio=0.2, delete_ratio=0.4, start_scn=1000
    )
    async with Relay(relay_cfg) as relay:
        await wait_until(lambda: relay.hosts["syn"].buffer.meta.windows >= 400)
        last = relay.hosts["syn"].buffer.meta.last_scn
        path = tmp_path / "boot" / "b.db"
        cfg = BootstrapConfig(
            relays=(relay.url,),
            data_dir=tmp_path / "boot",
            store=StoreConfig(kind="sqlite", path=path),
            http=HttpConfig(port=0),
            applier=ApplierConfig(log_keep_events=200, tombstone_keep_s=0),  # (no purge)
        )
        async with BootstrapServer(cfg) as boot, aiohttp.ClientSession() as http:
            w = boot.service.workers
            await wait_until(lambda: "syn" in w and w["syn"].applier_scn >= last, what="applier")
            await wait_until(lambda: w["syn"].log_min_scn > 1000, what="log pruned")
            read_page = Store.snapshot_page

            def purged_meanwhile(self: Store, *args: Any, **kwargs: Any) -> Any:
                other = Store.sqlite(path)  # the writer's purge, committed during the read
                try:
                    other.purge_tombstones("syn", 10**19, limit=1_000_000)
                    assert other.tomb_scn("syn") > 1000
                finally:
                    other.close()
                return read_page(self, *args, **kwargs)

            monkeypatch.setattr(Store, "snapshot_page", purged_meanwhile)
            params = {
                "partition": "syn",
                "since": "1000",
                "start": str(w["syn"].applier_scn),
                "max_bytes": str(1 << 22),
            }
            async with http.get(f"{boot.url}/v1/bootstrap/snapshot", params=params) as resp:
                status, body = resp.status, await resp.text()
    assert status == 410, body
    assert "purged" in body


async def test_a_long_purge_lets_the_applier_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first purge of a big store takes thousands of steps: they all ran inside the
    applier's turn, which applied nothing for minutes (found by review). Now the
    applier takes its steps between the purge's."""
    steps = 0

    def endless(self: Store, part: str, older_than_ns: int, limit: int = 2_000) -> Any:
        nonlocal steps
        steps += 1
        return 0, True  # (always more to do)

    monkeypatch.setattr(Store, "purge_tombstones", endless)
    relay_cfg = synthetic_relay(tmp_path / "relay", 300, keys=40, start_scn=1000)
    async with Relay(relay_cfg) as relay:
        await wait_until(lambda: relay.hosts["syn"].buffer.meta.windows >= 300)
        last = relay.hosts["syn"].buffer.meta.last_scn
        cfg = BootstrapConfig(
            relays=(relay.url,),
            data_dir=tmp_path / "boot",
            store=StoreConfig(kind="sqlite", path=tmp_path / "boot" / "b.db"),
            http=HttpConfig(port=0),
            applier=ApplierConfig(tombstone_keep_s=0.001, purge_interval_s=0.05),
        )
        async with BootstrapServer(cfg) as boot:
            w = boot.service.workers
            await wait_until(lambda: "syn" in w and w["syn"].applier_scn >= last, what="applier")
    assert steps > 1
