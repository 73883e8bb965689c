"""The relay's and bootstrap server's metrics against running servers (docs/metrics.md).

* docs/metrics.md names exactly the families a relay and a bootstrap server
  following it export (both ways).
* A synthetic source fills a small buffer (windows are evicted) and another
  partition whose windows are over its size limit (they become data-loss
  windows); consumers pull at different checkpoints: readiness, fetcher
  state, source lag, consumer lag (the most lagging only, the rest folded
  into ``_other``), data loss by cause and the pulls answered 410.
* A Postgres source: retained WAL, source lag, a lost slot counted as
  ``slot_lost``. A MariaDB source: the binlog distance.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import aiohttp
import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from changebus.bootstrap import (
    BootstrapConfig,
    BootstrapServer,
    HttpConfig as BootstrapHttp,
    StoreConfig,
)
from changebus.fetchers.mysql import EmbeddedMariaDB
from changebus.fetchers.mysql._config import MySQLConfig
from changebus.fetchers.mysql._distance import binlog_distance, read_distance
from changebus.relay import (
    FetcherConfig,
    HttpConfig,
    MetricsConfig,
    PartitionConfig,
    Relay,
    RelayConfig,
)
from changebus.relay._host import PartitionHost
from changebus.schemas import ConfigError, lsn_to_scn, parse_stream
from waiting import wait_until

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
NAME = re.compile(r"`(changebus_(?:relay|bootstrap)_[a-z_]+)")

Labels = tuple[tuple[str, str], ...]


async def scrape(url: str) -> str:
    """The ``/metrics`` text of the server at ``url``."""
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
        assert resp.status == 200
        return await resp.text()


def families(text: str) -> set[str]:
    """The family names of a ``/metrics`` text as its ``# TYPE`` lines name them."""
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


def samples(text: str, name: str) -> dict[Labels, float]:
    """The samples named ``name`` (counters: with ``_total``), keyed by sorted labels."""
    out: dict[Labels, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def value(text: str, name: str, **labels: str) -> float | None:
    """One sample's value (None: no such sample)."""
    return samples(text, name).get(tuple(sorted(labels.items())))


def relay_config(tmp: Path, *partitions: PartitionConfig, cap: int = 50) -> RelayConfig:
    return RelayConfig(
        data_dir=tmp / "relay",
        http=HttpConfig(port=0),
        partitions=partitions,
        flush_interval_s=0,
        metrics=MetricsConfig(max_consumer_series=cap),
    )


# ---- docs/metrics.md -------------------------------------------------------------


def documented() -> tuple[set[str], set[str]]:
    """(every metric named on the page, the names with a table row of their own)."""
    text = DOC.read_text()
    rows = set(re.findall(r"^\| `(changebus_[a-z_]+)` \|", text, re.MULTILINE))
    return set(NAME.findall(text)), rows


@pytest.mark.usefixtures("no_blocking")
async def test_docs_name_every_exported_family_and_nothing_else(tmp_path: Path) -> None:
    source = {"windows_per_s": 500, "max_windows": 50}
    syn = PartitionConfig(
        "syn", 1, capacity_bytes=1 << 20, fetcher=FetcherConfig("synthetic", source)
    )
    async with Relay(relay_config(tmp_path, syn)) as relay:
        boot_cfg = BootstrapConfig(
            relays=(relay.url,),
            partitions=("syn",),
            data_dir=tmp_path / "boot",
            store=StoreConfig(kind="sqlite", path=tmp_path / "boot" / "b.db"),
            http=BootstrapHttp(port=0),
        )
        async with BootstrapServer(boot_cfg) as boot:
            await wait_until(lambda: boot.service.ready, what="the bootstrap server streams")
            relay_text = await scrape(relay.url)
            boot_text = await scrape(boot.url)
    exported = families(relay_text) | families(boot_text)
    named, rows = documented()
    assert named - exported == set(), "docs/metrics.md names metrics that are not exported"
    assert exported - rows == set(), "exported families without a row in docs/metrics.md"
    # the names the dashboard and the alert rules are built on
    for name in (
        "changebus_relay_ready",
        "changebus_relay_fetcher_state",
        "changebus_relay_source_lag_seconds",
        "changebus_relay_source_idle_seconds",
        "changebus_relay_source_retained_wal_bytes",
        "changebus_relay_source_binlog_distance_bytes",
        "changebus_relay_consumer_lag_scn",
        "changebus_relay_consumer_lag_seconds",
        "changebus_relay_data_loss_events_total",
        "changebus_relay_consumers_fell_off_total",
        "changebus_bootstrap_ready",
        "changebus_bootstrap_data_loss_events_total",
    ):
        assert name in exported and name in rows, name
    assert value(relay_text, "changebus_relay_ready") == 1
    assert value(boot_text, "changebus_bootstrap_ready") == 1
    assert (
        value(
            boot_text,
            "changebus_bootstrap_data_loss_events_total",
            partition="syn",
            cause="relay_data_loss",
        )
        == 0
    )


# ---- a synthetic source: consumers, data loss, 410 ---------------------------------

#: 200 windows of ~1.2 KB at 400 windows/s: 0.5 s of source time, more than 64 KiB
SMALL = {"windows_per_s": 400, "max_windows": 200, "events_per_window": 4, "row_bytes": 200}
#: upserts of 3 KB rows into a partition that stores windows of at most 1 KiB
BIG = {
    "windows_per_s": 0,
    "max_windows": 12,
    "events_per_window": 1,
    "row_bytes": 3000,
    "keys": 5,
    "delete_ratio": 0.5,
}


async def pull(url: str, scn: int, client: str) -> int:
    query = f"partition=syn&scn={scn}&client={client}&max_bytes=64"
    async with aiohttp.ClientSession() as http, http.get(f"{url}/v1/stream?{query}") as r:
        await r.read()
        return r.status


def first_ts(host: PartitionHost, scn: int) -> int:
    """The source time of the first window after ``scn`` (read as a consumer would)."""
    selection = host.buffer.select(scn, -1, 1 << 20)
    assert selection is not None
    data = b"".join(bytes(v) for v in selection.views)
    assert host.buffer.release(selection)
    _, headers = parse_stream(data)
    return int(headers["timestamp_ns"][0])


def by_consumer(text: str, name: str) -> dict[str, float]:
    return {
        dict(k)["consumer"]: v for k, v in samples(text, name).items() if ("partition", "syn") in k
    }


@pytest.mark.usefixtures("no_blocking")
async def test_relay_operator_metrics(tmp_path: Path) -> None:
    cfg = relay_config(
        tmp_path,
        PartitionConfig(
            "syn", 1, capacity_bytes=64 << 10, fetcher=FetcherConfig("synthetic", SMALL)
        ),
        PartitionConfig(
            "big",
            2,
            capacity_bytes=64 << 10,
            max_window_bytes=1024,
            fetcher=FetcherConfig("synthetic", BIG),
        ),
        cap=3,
    )
    async with Relay(cfg) as relay:
        syn, big = relay.hosts["syn"], relay.hosts["big"]
        await wait_until(lambda: syn.state == "finished" and big.state == "finished")
        m = syn.buffer.meta
        assert m.prev_scn > 1000  # windows were evicted
        text = await scrape(relay.url)
        assert value(text, "changebus_relay_ready") == 1.0
        states = samples(text, "changebus_relay_fetcher_state")
        assert value(text, "changebus_relay_fetcher_state", partition="syn", state="finished") == 1
        assert sum(v for k, v in states.items() if ("partition", "syn") in k) == 1.0
        assert len(states) == 2 * 7  # every state of both partitions
        lag = value(text, "changebus_relay_source_lag_seconds", partition="syn")
        assert lag is not None and 0 <= lag < 5
        idle = value(text, "changebus_relay_source_idle_seconds", partition="syn")
        assert idle is not None and idle >= 0
        # neither a Postgres nor a MySQL source: no such figures, the families are there
        assert "# TYPE changebus_relay_source_retained_wal_bytes gauge" in text
        assert not samples(text, "changebus_relay_source_retained_wal_bytes")
        assert not samples(text, "changebus_relay_source_binlog_distance_bytes")

        # data loss by cause: every window over the limit, nothing else
        lost = big.stats["windows_data_loss"]
        assert lost > 0
        assert samples(text, "changebus_relay_data_loss_events_total") == {
            (("cause", "window_too_large"), ("partition", "big")): lost
        }

        # consumers: a (oldest kept), b (middle), d (just after b), c (caught up)
        mid = (m.min_scn + m.last_scn) // 2
        for scn, client in ((m.min_scn, "a"), (mid, "b"), (mid + 1, "d"), (m.last_scn, "c")):
            assert await pull(relay.url, scn, client) in (200, 204)
        text = await scrape(relay.url)
        lag_scn = by_consumer(text, "changebus_relay_consumer_lag_scn")
        lag_s = by_consumer(text, "changebus_relay_consumer_lag_seconds")
        # at most 3 consumer series: the most lagging, then _other (c: caught up)
        assert lag_scn == {
            "a": m.last_scn - m.min_scn,
            "b": m.last_scn - mid,
            "d": m.last_scn - mid - 1,
            "_other": 0,
        }
        assert lag_s["_other"] == 0
        # a lags by the source time between the newest window and the first it lacks
        assert lag_s["a"] > lag_s["b"] >= lag_s["d"] > 0
        assert lag_s["a"] == pytest.approx((m.last_ts - first_ts(syn, m.min_scn)) / 1e9)

        # a consumer without a client id: one "_unnamed" series, never its address
        assert await pull(relay.url, m.min_scn, "") in (200, 204)
        text = await scrape(relay.url)
        lag_scn = by_consumer(text, "changebus_relay_consumer_lag_scn")
        assert "127.0.0.1" not in text
        assert lag_scn == {
            "a": m.last_scn - m.min_scn,
            "_unnamed": m.last_scn - m.min_scn,
            "b": m.last_scn - mid,
            "_other": m.last_scn - mid - 1,
        }

        # a checkpoint older than the buffer keeps: 410, counted
        assert value(text, "changebus_relay_consumers_fell_off_total", partition="syn") == 0
        assert await pull(relay.url, m.prev_scn - 1, "late") == 410
        text = await scrape(relay.url)
        assert value(text, "changebus_relay_consumers_fell_off_total", partition="syn") == 1
        assert value(text, "changebus_relay_consumers_fell_off_total", partition="big") == 0

        # the status table remembers as many consumers as may be connected at once;
        # beyond, the least recently seen go, counted
        assert syn.max_consumers == max(1000, cfg.http.max_connections)
        assert value(text, "changebus_relay_consumers_forgotten_total", partition="syn") == 0
        syn.max_consumers = len(syn.consumers) + 1
        for client in ("e", "f", "g"):
            assert await pull(relay.url, m.last_scn, client) in (200, 204)
        text = await scrape(relay.url)
        assert value(text, "changebus_relay_consumers_forgotten_total", partition="syn") == 2
        assert {"e", "f", "g"} <= set(syn.consumers) and "a" not in syn.consumers


def test_max_consumer_series_is_bounded() -> None:
    with pytest.raises(ConfigError, match="max_consumer_series"):
        MetricsConfig(max_consumer_series=0)


# ---- Postgres: retained WAL, source lag, a lost slot ---------------------------------


@pytest.mark.pg
async def test_postgres_source_metrics(tmp_path: Path, pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE acct (id int8 PRIMARY KEY, bal int8)")
    options = {"dsn": pg_dsn, "slot_stats_interval_s": 0.1, "heartbeat_interval_s": 0.2}
    cfg = relay_config(
        tmp_path, PartitionConfig("pg", 1, fetcher=FetcherConfig("postgres", options))
    )

    def write(first: int) -> int:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            for i in range(first, first + 5):
                conn.execute("INSERT INTO acct VALUES (%s, %s)", (i, i))
            row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        assert row is not None
        return lsn_to_scn(row[0])

    async with Relay(cfg) as relay:
        host = relay.hosts["pg"]
        await wait_until(lambda: host.state == "streaming")
        target = await asyncio.to_thread(write, 0)
        await wait_until(lambda: host.buffer.meta.last_scn >= target)
        await wait_until(lambda: host.status()["fetcher"].get("retained_wal_bytes", -1) >= 0)
        text = await scrape(relay.url)
        wal = value(text, "changebus_relay_source_retained_wal_bytes", partition="pg")
        assert wal is not None and wal >= 0
        lag = value(text, "changebus_relay_source_lag_seconds", partition="pg")
        assert lag is not None and 0 <= lag < 10
        assert value(text, "changebus_relay_fetcher_state", partition="pg", state="streaming") == 1
        assert not samples(text, "changebus_relay_data_loss_events_total")
    # the slot goes while the relay is down: a DATA_LOSS window, counted as slot_lost
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_drop_replication_slot('changebus')")
    await asyncio.to_thread(write, 100)
    async with Relay(cfg) as relay:
        host = relay.hosts["pg"]
        target = await asyncio.to_thread(write, 200)
        await wait_until(lambda: host.buffer.meta.last_scn >= target)
        text = await scrape(relay.url)
        assert samples(text, "changebus_relay_data_loss_events_total") == {
            (("cause", "slot_lost"), ("partition", "pg")): 1
        }


# ---- MariaDB: binlog distance -----------------------------------------------------


def master_status(server: EmbeddedMariaDB) -> tuple[str, int]:
    conn = server.connect()
    try:
        with conn.cursor() as cur:
            cur.execute("SHOW MASTER STATUS")
            row = cur.fetchone()
    finally:
        conn.close()
    return str(row[0]), int(row[1])


def test_binlog_distance_counts_across_files() -> None:
    logs = [("bin.000007", 500), ("bin.000008", 300), ("bin.000010", 200)]
    assert binlog_distance(logs, "bin.000008", 100) == 200 + 200
    assert binlog_distance(logs, "bin.000010", 200) == 0
    assert binlog_distance(logs, "bin.000006", 4) == -1  # purged
    assert binlog_distance(logs, "", 0) == -1  # nothing read yet


@pytest.mark.mysql
async def test_mysql_binlog_distance(
    tmp_path: Path, mysql_server: EmbeddedMariaDB, mysql_db: str
) -> None:
    server = mysql_server
    conn = server.connect(mysql_db)
    try:
        with conn.cursor() as cur:
            cur.execute("CREATE TABLE acct (id BIGINT PRIMARY KEY, bal BIGINT)")
    finally:
        conn.close()
    # measured against the server's own positions: the bytes one transaction wrote
    file, pos = await asyncio.to_thread(master_status, server)
    conn = server.connect(mysql_db)
    try:
        with conn.cursor() as cur:
            cur.execute("INSERT INTO acct VALUES (1, 1)")
        conn.commit()
    finally:
        conn.close()
    file2, pos2 = await asyncio.to_thread(master_status, server)
    config = MySQLConfig(host="127.0.0.1", port=server.port, user="root")
    if file2 == file:
        assert await asyncio.to_thread(read_distance, config, file, pos) == pos2 - pos
    # through a relay: the figure is read and, caught up, reaches 0
    options = server.options(databases=[mysql_db], binlog_stats_interval_s=0.1)
    cfg = relay_config(tmp_path, PartitionConfig("my", 1, fetcher=FetcherConfig("mysql", options)))
    async with Relay(cfg) as relay:
        host = relay.hosts["my"]
        await wait_until(lambda: host.state == "streaming")

        def distance() -> object:
            return host.status()["fetcher"].get("binlog_distance_bytes")

        await wait_until(lambda: distance() == 0, what="the relay's binlog distance reaches 0")
        text = await scrape(relay.url)
        assert value(text, "changebus_relay_source_binlog_distance_bytes", partition="my") == 0
        assert value(text, "changebus_relay_fetcher_state", partition="my", state="streaming") == 1
