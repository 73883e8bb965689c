"""Fixtures of the cluster tests: ZkSessions on the test's own cluster name, and group
members (with a :class:`~group_members.Follower`) in a group of the test's own."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import pytest
from group_members import TIMEOUT_S, Follower, MemberFactory

from changebus.cluster import ClusterConfig, CoordinationError, GroupMember, ZkSession

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


@pytest.fixture
def group() -> str:
    return f"g{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def make_member(zk_session, group: str) -> AsyncIterator[MemberFactory]:
    made: list[tuple[GroupMember, Follower]] = []

    async def make(
        name: str,
        partitions: Sequence[str] = ("orders", "users"),
        buckets: int = 6,
        *,
        session: ZkSession | None = None,
        follow: bool = True,
    ) -> tuple[GroupMember, Follower]:
        if session is None:
            session = await zk_session(name, session_timeout_s=TIMEOUT_S)
        member = GroupMember(session, group, partitions, buckets, name=name)
        follower = Follower(member)
        if not follow:
            member._target_cbs.remove(follower._retarget)
        await member.start()
        made.append((member, follower))
        return member, follower

    yield make
    for member, follower in made:
        await follower.close()
        with contextlib.suppress(CoordinationError):
            await member.stop()
