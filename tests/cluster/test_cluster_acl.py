"""ZooKeeper digest credentials: members own their cluster's tree, the world may only read."""

from __future__ import annotations

import asyncio
import logging
from binascii import hexlify
from pathlib import Path
from typing import Any

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError, NoNodeError
from kazoo.security import make_digest_acl_credential

from changebus.cluster import (
    ClusterConfig,
    CoordinationError,
    PartitionElection,
    PartitionState,
    Registry,
    RoutingTable,
    ZkSession,
    member_path,
)
from changebus.schemas import ConfigError
from changebus.schemas.config import redacted

pytestmark = pytest.mark.zk

PASSWORD = "s3cret-zk-Pa55"


def _config(hosts: str, cluster: str, member: str = "", **kw: object) -> ClusterConfig:
    return ClusterConfig(
        zookeeper=hosts,
        name=cluster,
        member_id=member,
        advertised_url=f"http://{member}.test:1" if member else "",
        session_timeout_s=2.0,
        connect_timeout_s=10.0,
        **kw,  # type: ignore[arg-type]
    )


def _plain(hosts: str) -> KazooClient:
    zk = KazooClient(hosts=hosts, timeout=5.0)
    zk.start(10)
    return zk


async def test_members_with_credentials_lock_out_writers_without(
    zk_hosts: str, zk_cluster: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    secret_file = tmp_path / "zk-password"
    secret_file.write_text(PASSWORD + "\n")
    member = ZkSession(
        _config(zk_hosts, zk_cluster, "r1", zk_user="relay", zk_password_file=str(secret_file))
    )
    await member.start()
    session_passwd = bytes(member.client._session_passwd)
    try:
        registry = Registry(member, "relay", min_interval_s=0.05)
        await registry.start()
        election = PartitionElection(member, "p0")
        await election.start()
        async with asyncio.timeout(10):
            leadership = await election.wait_elected()
        assert leadership.valid()

        # a reader without credentials still finds the relays (world-readable)
        reader = ZkSession(_config(zk_hosts, zk_cluster))
        await reader.start()
        try:
            table = RoutingTable(reader)
            await table.start()
            assert "r1" in table.snapshot().members
            await table.stop()
        finally:
            await reader.stop()

        # ... but cannot register a member, nor change anything of the cluster
        zk = _plain(zk_hosts)
        try:
            with pytest.raises(NoAuthError):
                zk.create(member_path(zk_cluster, "intruder"), b"{}", ephemeral=True)
            with pytest.raises(NoAuthError):
                zk.create(f"/changebus/{zk_cluster}/partitions/p9", b"")
            with pytest.raises(NoAuthError):
                zk.delete(f"/changebus/{zk_cluster}/members")
            with pytest.raises(NoAuthError):
                zk.set(f"/changebus/{zk_cluster}/partitions/p0/epoch", b'{"epoch": 99}')
            data, _ = zk.get(member_path(zk_cluster, "r1"))
            assert b'"relay"' in data
        finally:
            zk.stop()
            zk.close()
        await election.stop()
        await registry.stop()
    finally:
        await member.stop()
    assert PASSWORD not in caplog.text
    # kazoo's debug lines printed the session's password (its Connect request) and the
    # digest ACLs' password hash (Create): the first lets anyone take the session over
    assert "Sending request" in caplog.text  # (kazoo's debug lines were there)
    assert repr(session_passwd) not in caplog.text
    assert hexlify(session_passwd).decode() not in caplog.text
    digest = make_digest_acl_credential("relay", PASSWORD).split(":", 1)[1]
    assert digest not in caplog.text


async def test_a_start_whose_acl_walk_fails_leaves_no_session(
    zk_hosts: str, zk_cluster: str
) -> None:
    """A node the member may not read or re-ACL (another user's) fails the start's ACL
    walk; the session stayed connected, and each join retry left one more live session
    with its threads and a connection of the server's per-host limit (review)."""
    from kazoo.security import make_digest_acl

    zk = _plain(zk_hosts)
    try:
        zk.ensure_path(f"/changebus/{zk_cluster}/partitions")
        zk.create(
            f"/changebus/{zk_cluster}/partitions/p0",
            b"",
            acl=[make_digest_acl("someone", "else", all=True)],
        )
        member = ZkSession(
            _config(zk_hosts, zk_cluster, "r1", zk_user="relay", zk_password=PASSWORD)
        )
        with pytest.raises(Exception) as info:
            await member.start()
        assert PASSWORD not in str(info.value)
        assert member._zk is None and not member.connected
        assert member.state == "closed"
    finally:
        zk.stop()
        zk.close()


async def test_a_tree_created_open_is_taken_back(zk_hosts: str, zk_cluster: str) -> None:
    zk = _plain(zk_hosts)
    try:
        zk.ensure_path(f"/changebus/{zk_cluster}/partitions/p0")  # open ACL, e.g. an intruder
        member = ZkSession(
            _config(zk_hosts, zk_cluster, "r1", zk_user="relay", zk_password=PASSWORD)
        )
        await member.start()
        try:
            with pytest.raises(NoAuthError):
                zk.create(f"/changebus/{zk_cluster}/partitions/p0/x", b"")
            with pytest.raises(NoAuthError):
                zk.create(f"/changebus/{zk_cluster}/members", b"")
        finally:
            await member.stop()
        # another cluster with other credentials can still live beside it
        other = ZkSession(
            _config(zk_hosts, zk_cluster + "b", "r2", zk_user="other", zk_password="pw-2")
        )
        await other.start()
        try:
            await other.ensure_path(f"/changebus/{zk_cluster}b/members")
        finally:
            await other.stop()
    finally:
        zk.stop()
        zk.close()


def test_a_cluster_may_not_be_named_like_the_consumer_groups_tree() -> None:
    with pytest.raises(ConfigError, match="'groups' is taken"):
        ClusterConfig(zookeeper="127.0.0.1:1", name="groups", zk_user="u", zk_password="p")
    ClusterConfig(zookeeper="127.0.0.1:1", name="groups2", zk_user="u", zk_password="p")
    ClusterConfig(zookeeper="127.0.0.1:1", name="groups")  # (a consumer group's session)


def test_credential_settings_are_checked_and_never_shown() -> None:
    with pytest.raises(ConfigError, match="go together"):
        ClusterConfig(zookeeper="127.0.0.1:1", name="c", zk_user="relay")
    with pytest.raises(ConfigError, match="go together"):
        ClusterConfig(zookeeper="127.0.0.1:1", name="c", zk_password=PASSWORD)
    with pytest.raises(ConfigError, match="':'"):
        ClusterConfig(zookeeper="127.0.0.1:1", name="c", zk_user="a:b", zk_password="x")
    config = ClusterConfig(zookeeper="127.0.0.1:1", name="c", zk_user="relay", zk_password=PASSWORD)
    assert PASSWORD not in repr(config)
    assert PASSWORD not in str(redacted(config))
    missing = ClusterConfig(
        zookeeper="127.0.0.1:1", name="c", zk_user="relay", zk_password_file="/nonexistent/pw"
    )
    with pytest.raises(ConfigError, match="/nonexistent/pw"):
        missing.zk_credentials()


async def test_a_member_writes_again_after_zookeeper_restarts(
    zk_server: Any, zk_hosts: str, zk_cluster: str
) -> None:
    """kazoo authenticates every new connection: after a restart the member still owns its tree."""
    member = ZkSession(_config(zk_hosts, zk_cluster, "r1", zk_user="relay", zk_password=PASSWORD))
    await member.start()
    try:
        registry = Registry(member, "relay", min_interval_s=0.05)
        await registry.start()
        path = member_path(zk_cluster, "r1")
        try:
            await asyncio.to_thread(zk_server.restart)
        finally:
            if zk_server.proc is None:
                await asyncio.to_thread(zk_server.start)
        async with asyncio.timeout(20):
            await member.wait_connected()
        registry.update({"p0": PartitionState("leader", 1, 1, 42)})

        async def published() -> bool:
            try:
                data, _ = await member.op("get", path)
            except (CoordinationError, NoNodeError):
                return False
            return b'"max_scn":42' in data

        for _ in range(150):
            if await published():
                break
            await asyncio.sleep(0.1)
        assert await published()  # written through the ACL: the new connection is authenticated
        zk = _plain(zk_hosts)
        try:
            with pytest.raises(NoAuthError):
                zk.create(member_path(zk_cluster, "intruder"), b"{}", ephemeral=True)
        finally:
            zk.stop()
            zk.close()
        await registry.stop()
    finally:
        await member.stop()


async def test_securing_the_tree_pipelines_each_level() -> None:
    """A session with credentials sets the cluster's ACL on its persistent nodes at start.
    One request waited for at a time made that 10 s at 1,024 partitions (9,227 round
    trips of 1 ms); a level of the tree is asked at once now. A scripted client counts
    the requests in flight when each answer is waited for."""
    from types import SimpleNamespace

    from changebus.cluster import ClusterConfig
    from changebus.cluster._session import ZkSession
    from changebus.cluster._session_acl import secure_tree

    parts = [f"p{i}" for i in range(50)]
    kids = {"/changebus/c1": ["members", "partitions"], "/changebus/c1/partitions": parts}
    flight = {"now": 0, "most": 0}

    class Pending:
        def __init__(self, value: Any) -> None:
            self.value = value
            flight["now"] += 1

        def get(self, timeout: float | None = None) -> Any:
            flight["most"] = max(flight["most"], flight["now"])
            flight["now"] -= 1
            return self.value

    class Client:
        def exists_async(self, path: str) -> Pending:
            return Pending(SimpleNamespace(ephemeralOwner=0))

        def ensure_path_async(self, path: str) -> Pending:
            return Pending(None)

        def get_acls_async(self, path: str) -> Pending:
            return Pending((["old"], None))

        def set_acls_async(self, path: str, acl: Any) -> Pending:
            return Pending(None)

        def get_children_async(self, path: str) -> Pending:
            return Pending(kids.get(path, []))

    session = ZkSession(ClusterConfig(name="c1", zookeeper="127.0.0.1:1", member_id="r1"))

    async def call(fn: Any) -> Any:
        return fn(Client())

    session.call = call  # type: ignore[method-assign,assignment]
    await secure_tree(session, ["acl"])
    assert flight["most"] >= len(parts)  # (a level's requests in flight together)


def test_cluster_status_with_bad_arguments_is_one_line() -> None:
    """``--cluster a/b`` or ``--timeout 0`` printed a ConfigError traceback (review)."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            str(root / s)
            for s in ("schemas", "cluster", "fetchers", "relay", "bootstrap", "client")
        ),
    }
    for extra in (("--cluster", "a/b"), ("--cluster", "c", "--timeout", "0")):
        result = subprocess.run(
            [
                *(sys.executable, "-m", "changebus.schemas", "cluster", "status"),
                *("--zookeeper", "127.0.0.1:1", *extra),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 2, result
        assert "Traceback" not in result.stderr and "cluster" in result.stderr
