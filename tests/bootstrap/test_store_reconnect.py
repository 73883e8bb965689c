"""The Postgres store's connections cut (a store server restarted, a failover,
an idle-connection killer): the bootstrap server reconnects and goes on.

Each store thread kept its connection for ever; once the server closed it,
every write failed, the log writer and the applier tasks died with the first
error, and the server went on answering from a snapshot that no longer moved.
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import psycopg
from synthetic_boot import synthetic_relay

from changebus.bootstrap import BootstrapConfig, BootstrapServer, HttpConfig, StoreConfig
from changebus.relay import Relay
from waiting import wait_until


def _cut(dsn: str) -> int:
    """Terminate every other connection to the store's database; how many."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchall()
    return len(rows)


async def test_store_connections_cut_the_server_reconnects(tmp_path: Path, pg_dsn: str) -> None:
    relay_cfg = synthetic_relay(tmp_path / "relay", 400, capacity_bytes=4 << 20, windows_per_s=100)
    async with Relay(relay_cfg) as relay:
        host = relay.hosts["syn"]
        cfg = BootstrapConfig(
            relays=(relay.url,),
            data_dir=tmp_path / "boot",
            store=StoreConfig(kind="postgres", dsn=pg_dsn),
            http=HttpConfig(port=0),
        )
        async with BootstrapServer(cfg) as boot, aiohttp.ClientSession() as http:
            w = boot.service.workers
            await wait_until(lambda: "syn" in w and w["syn"].applier_scn > 0, what="first apply")
            url = f"{boot.url}/v1/bootstrap/snapshot"
            start = str(w["syn"].applier_scn)
            params = {"partition": "syn", "since": "-1", "start": start}
            async with http.get(url, params=params) as resp:
                assert resp.status == 200
            cut = _cut(pg_dsn)
            assert cut >= 2  # the writer's and a reader's connection at least
            # windows still coming: the producer and the applier write on
            await wait_until(lambda: host.buffer.meta.windows >= 400, what="relay done")
            last = host.buffer.meta.last_scn
            await wait_until(lambda: w["syn"].applier_scn >= last, what="applier after the cut")
            assert w["syn"].producer_scn == last
            # the readers reconnect too (the first read after a cut may fail, retriable)
            statuses = []
            for _ in range(3):
                async with http.get(url, params=params) as resp:
                    statuses.append(resp.status)
            assert statuses[-1] == 200
            assert all(s in (200, 503) for s in statuses), statuses
