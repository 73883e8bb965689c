"""Relay clusters on MariaDB: one binlog reader at a time, each member with its own server id."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from relay_cluster import (
    Cluster,
    RelayProc,
    all_hold,
    binlog_dumps,
    binlog_scn,
    free_port,
    identical,
    my_rows,
    new_leader,
    same_content,
    settled,
    start,
    stop_all,
    stream_bytes,
    write_config,
)

from changebus.fetchers.mysql import EmbeddedMariaDB
from fix_pg import wait_until

pytestmark = pytest.mark.zk


@pytest.mark.mysql
async def test_mariadb_one_binlog_reader_unique_server_ids(
    tmp_path: Path, mysql_server: EmbeddedMariaDB, mysql_db: str, zk_hosts: str, zk_cluster: str
) -> None:
    my_rows_table = mysql_server.connect(mysql_db)
    try:
        with my_rows_table.cursor() as cur:
            cur.execute("CREATE TABLE t (id int PRIMARY KEY, v int NOT NULL)")
    finally:
        my_rows_table.close()
    source = (
        'kind = "mysql"\n'
        f'options = {{ host = "127.0.0.1", port = {mysql_server.port}, user = "root", '
        f'databases = ["{mysql_db}"] }}\n'
    )
    relays = [RelayProc(f"m{i}", free_port(), tmp_path / f"m{i}") for i in range(3)]
    for r in relays:
        write_config(r, source, zk_hosts, zk_cluster)
        start(r)
    c = Cluster(relays, "", "")
    try:
        leader = await settled(c)
        epoch = c.epoch(leader)
        await asyncio.to_thread(my_rows, mysql_server, mysql_db, 0, 100)
        await wait_until(lambda: binlog_dumps(mysql_server) >= 1, 10, "a binlog reader")
        await asyncio.sleep(0.5)
        assert binlog_dumps(mysql_server) == 1
        st = leader.status()
        assert st is not None
        first_id = st["fetcher"]["server_id"]
        assert leader.proc is not None
        leader.proc.kill()
        leader.proc.wait(10)
        new = await new_leader(c, epoch)
        await asyncio.to_thread(my_rows, mysql_server, mysql_db, 100, 100)
        # a new leader shows its fetcher once it has made one (just after the election: not yet)
        await wait_until(lambda: "fetcher" in (new.status() or {}), 15, "the new leader's fetcher")
        st = new.status()
        assert st is not None
        assert st["fetcher"]["server_id"] != first_id
        survivors = [r for r in relays if r is not leader]
        end = await asyncio.to_thread(binlog_scn, mysql_server)
        await all_hold(survivors, end)
        assert same_content(survivors) >= 100
        identical(survivors)
        _body, scns = stream_bytes(new, -1)
        assert scns == sorted(set(scns))
        await wait_until(lambda: binlog_dumps(mysql_server) == 1, 10, "one binlog reader")
    finally:
        stop_all(relays)
