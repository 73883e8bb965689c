"""A throwaway standalone ZooKeeper for the tests (pytest plugin).

``zk_server`` (session scope) runs :class:`ZkServer` (``bench/_zk.py``, shared
with the benchmarks): Debian's ZooKeeper 3.8 on 127.0.0.1, a free port,
``tickTime=500`` (sessions of 1 to 10 s), its data directory in a temporary
directory; it is stopped by its pid. :meth:`ZkServer.restart` (and
:meth:`ZkServer.stop` / :meth:`ZkServer.start`) keep the port and the data
directory, for ZooKeeper-restart tests.

``zk_cluster`` gives each test a unique cluster name, so tests sharing the
server never see each other's znodes (everything lives under
``/changebus/<name>/``); ``zk_hosts`` is the connect string.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from _zk import JAR as JAR, ZkServer as ZkServer


@pytest.fixture(scope="session")
def zk_server() -> Iterator[ZkServer]:
    if not JAR.exists():
        pytest.skip(
            f"ZooKeeper is not installed ({JAR}; run make test or apt-get install zookeeper)"
        )
    base = Path(tempfile.mkdtemp(prefix="changebus-zk-"))
    server = ZkServer(base)
    server.start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def zk_hosts(zk_server: ZkServer) -> str:
    """The connect string of the session's ZooKeeper (started again if a test stopped it)."""
    if zk_server.proc is None:
        zk_server.start()
    return zk_server.hosts


@pytest.fixture
def zk_cluster(zk_hosts: str) -> str:
    """A cluster name no other test uses (its znodes live under /changebus/<name>/)."""
    return f"t{uuid.uuid4().hex[:12]}"
