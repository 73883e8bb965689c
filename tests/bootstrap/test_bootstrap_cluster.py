"""A bootstrap server in a relay cluster (real ZooKeeper, Postgres, relays).

Configured with only ``[cluster]`` (no relay list), the server finds the relays in
the routing table, registers itself (kind ``bootstrap``, its URL, its partitions
with the applier / producer SCNs), shows up in ``changebus cluster status``, and
moves to another relay when the table changes. A consumer configured with ZooKeeper
and no bootstrap servers finds it there and bootstraps from it.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from boot_e2e import (
    TINY,
    WatchedReplica,
    bootstrap_caught_up,
    create_tables,
    replica_rows,
    replicate_until,
    source_rows,
    sync_marker,
    workload,
)

from changebus.bootstrap import BootstrapConfig, BootstrapServer, HttpConfig, StoreConfig
from changebus.client import ConsumerConfig
from changebus.cluster import ClusterConfig
from changebus.relay import (
    FetcherConfig,
    HttpConfig as RelayHttp,
    PartitionConfig,
    Relay,
    RelayConfig,
)
from changebus.schemas import ConfigError
from changebus.schemas.config import load_config
from waiting import wait_until

pytestmark = [pytest.mark.pg, pytest.mark.zk, pytest.mark.usefixtures("no_blocking")]

ROOT = Path(__file__).resolve().parents[2]
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(
        str(ROOT / d)
        for d in ("schemas", "cluster", "fetchers", "relay", "bootstrap", "client", "discovery")
    ),
}


def cluster(zk: str, name: str, member: str) -> ClusterConfig:
    return ClusterConfig(zookeeper=zk, name=name, member_id=member, session_timeout_s=2.0)


def clustered_relay(tmp: Path, dsn: str, zk: str, name: str, member: str) -> RelayConfig:
    source = FetcherConfig("postgres", {"dsn": dsn, "status_interval_s": 0.2})
    return RelayConfig(
        data_dir=tmp / member,
        http=RelayHttp(port=0),
        partitions=(PartitionConfig("pg", 1, capacity_bytes=TINY, fetcher=source),),
        flush_interval_s=0,
        cluster=cluster(zk, name, member),
    )


def cluster_status(zk: str, name: str) -> dict[str, Any]:
    out = subprocess.run(
        [
            *(sys.executable, "-m", "changebus.schemas", "cluster", "status"),
            *("--zookeeper", zk, "--cluster", name, "--json"),
        ],
        env=ENV,
        capture_output=True,
        check=True,
        timeout=60,
    )
    status: dict[str, Any] = json.loads(out.stdout)
    return status


async def test_bootstrap_server_registers_and_finds_relays_in_the_table(
    tmp_path: Path, pg_dsn: str, zk_hosts: str, zk_cluster: str
) -> None:
    create_tables(pg_dsn)
    r1 = clustered_relay(tmp_path, pg_dsn, zk_hosts, zk_cluster, "r1")
    async with Relay(r1) as relay:
        host = relay.hosts["pg"]
        await wait_until(
            lambda: host.role == "leader" and host.state == "streaming", 30, "a leader"
        )
        bcfg = BootstrapConfig(
            data_dir=tmp_path / "boot",
            store=StoreConfig(kind="sqlite", path=tmp_path / "boot" / "b.db"),
            http=HttpConfig(port=0),
            cluster=cluster(zk_hosts, zk_cluster, "boot1"),
        )
        async with BootstrapServer(bcfg) as boot:
            assert list(boot.service.workers) == ["pg"]  # asked the table's relay
            await asyncio.to_thread(workload, pg_dsn, 1, 1500)
            marker = sync_marker(pg_dsn)
            await bootstrap_caught_up(boot, marker)
            assert host.status()["prev_scn"] > boot.service.workers["pg"].base_scn  # evicted

            def registered() -> bool:
                status = cluster_status(zk_hosts, zk_cluster)
                members = {m["member_id"]: m for m in status["members"]}
                b = members.get("boot1")
                return bool(
                    b
                    and b["kind"] == "bootstrap"
                    and b["url"] == boot.url
                    and b["partitions"]["pg"]["max_scn"] >= marker
                    and b["partitions"]["pg"]["min_scn"] >= marker
                    and members["r1"]["kind"] == "relay"
                )

            await wait_until(registered, 30, "the bootstrap server in cluster status")

            # a consumer with ZooKeeper and no bootstrap servers: the table names this one
            db = tmp_path / "replica.db"
            replica = WatchedReplica(db)
            cfg = ConsumerConfig(
                zookeeper=zk_hosts,
                cluster=zk_cluster,
                partition="pg",
                wait_s=0.5,
                backoff_initial_s=0.05,
                backoff_max_s=0.5,
            )
            try:
                await replicate_until(replica, cfg, marker)
            finally:
                await replica.close()
            assert replica.phases[0] == "snapshot"
            assert replica_rows(db) == source_rows(pg_dsn)
            assert boot.service.workers["pg"].state == "streaming"
        # the server's node goes with it
        status = cluster_status(zk_hosts, zk_cluster)
        assert [m["member_id"] for m in status["members"]] == ["r1"]


def test_cluster_table_in_the_bootstrap_config(tmp_path: Path) -> None:
    cfg = tmp_path / "bootstrap.toml"
    cfg.write_text('[cluster]\nzookeeper = "127.0.0.1:2181"\nname = "prod"\nmember_id = "b1"\n')
    config = load_config(BootstrapConfig, cfg, env={})
    assert config.cluster == ClusterConfig("127.0.0.1:2181", "prod", "b1")
    assert config.relays == ()
    cfg.write_text('[cluster]\nzookeeper = "127.0.0.1:2181"\nname = "prod"\n')
    with pytest.raises(ConfigError, match="member_id"):
        load_config(BootstrapConfig, cfg, env={})
    cfg.write_text("")
    with pytest.raises(ConfigError, match="relays"):
        load_config(BootstrapConfig, cfg, env={})


async def test_bootstrap_producer_follows_the_routing_table(
    tmp_path: Path, pg_dsn: str, zk_hosts: str, zk_cluster: str
) -> None:
    """The producer starts with r1 alone in the table; r2 joins, r1 leaves: the producer
    moves to r2, which it only knows from the table's change."""
    create_tables(pg_dsn)
    r1 = Relay(clustered_relay(tmp_path, pg_dsn, zk_hosts, zk_cluster, "r1"))
    await r1.start()
    bcfg = BootstrapConfig(
        data_dir=tmp_path / "boot",
        store=StoreConfig(kind="sqlite", path=tmp_path / "boot" / "b.db"),
        http=HttpConfig(port=0),
        partitions=("pg",),
        cluster=cluster(zk_hosts, zk_cluster, "boot1"),
    )
    try:
        await wait_until(lambda: r1.hosts["pg"].role == "leader", 30, "r1 leading")
        async with BootstrapServer(bcfg) as boot:
            await asyncio.to_thread(workload, pg_dsn, 1, 200)
            await bootstrap_caught_up(boot, sync_marker(pg_dsn))
            assert boot.service.member is not None
            assert boot.service.member.relays("pg") == (r1.url,)
            r2cfg = clustered_relay(tmp_path, pg_dsn, zk_hosts, zk_cluster, "r2")
            async with Relay(r2cfg) as r2:
                h2 = r2.hosts["pg"]
                await wait_until(
                    lambda: h2.role == "follower" and h2.state == "streaming", 30, "r2 following"
                )
                await r1.stop()  # leaves the cluster: r2 leads
                await wait_until(
                    lambda: h2.role == "leader" and h2.state == "streaming", 30, "r2 leading"
                )
                await asyncio.to_thread(workload, pg_dsn, 2, 200)
                marker = sync_marker(pg_dsn)
                await bootstrap_caught_up(boot, marker)
                assert boot.service.workers["pg"].state == "streaming"
    finally:
        await r1.stop()
