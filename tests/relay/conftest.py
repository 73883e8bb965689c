"""Fixtures of the relay tests: ``cluster`` (three clustered relays on one Postgres slot)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from relay_cluster import (
    Cluster,
    RelayProc,
    free_port,
    pg_source,
    start,
    stop_all,
    walsenders,
    write_config,
)


@pytest.fixture
def cluster(tmp_path: Path, pg_dsn: str, zk_hosts: str, zk_cluster: str) -> Iterator[Cluster]:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v int NOT NULL)")
    slot = f"cb_{uuid.uuid4().hex[:10]}"
    relays = [RelayProc(f"r{i}", free_port(), tmp_path / f"r{i}") for i in range(3)]
    for r in relays:
        write_config(r, pg_source(pg_dsn, slot), zk_hosts, zk_cluster)
    for r in relays:
        start(r)
    c = Cluster(relays, pg_dsn, slot, zk_hosts, zk_cluster)
    try:
        yield c
    finally:
        stop_all(relays)
        # the walsenders of killed relays must be gone before the database is dropped
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and walsenders(pg_dsn):
            time.sleep(0.1)
