"""Fixtures of the cluster tests: ZkSessions on the test's own cluster name."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from changebus.cluster import ClusterConfig, ZkSession

SessionFactory = Callable[..., Awaitable[ZkSession]]


@pytest.fixture
async def zk_session(zk_hosts: str, zk_cluster: str) -> AsyncIterator[SessionFactory]:
    """``await zk_session(member_id, session_timeout_s=1.5)``: a started session, stopped at the end."""
    made: list[ZkSession] = []

    async def make(member_id: str = "", session_timeout_s: float = 1.5, **kw: object) -> ZkSession:
        config = ClusterConfig(
            zookeeper=zk_hosts,
            name=zk_cluster,
            member_id=member_id,
            advertised_url=f"http://{member_id or 'x'}.test:1" if member_id else "",
            session_timeout_s=session_timeout_s,
            connect_timeout_s=10.0,
            **kw,  # type: ignore[arg-type]
        )
        session = ZkSession(config)
        await session.start()
        made.append(session)
        return session

    yield make
    for session in made:
        await session.stop()
