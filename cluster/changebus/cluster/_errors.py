"""The cluster slice's errors (in the one tree rooted at ``ChangebusError``)."""

from __future__ import annotations

from typing import ClassVar

from changebus.schemas.errors import ChangebusError

__all__ = ["CoordinationError"]


class CoordinationError(ChangebusError):
    """ZooKeeper cannot be reached, or answered in a way that forbids going on.

    Retriable by default (ZooKeeper coming back fixes it); an instance made
    with ``retriable=False`` means the cluster's data in ZooKeeper is not what
    changebus wrote (e.g. an epoch node that holds no epoch).
    """

    retriable: ClassVar[bool] = True
    http_status: ClassVar[int] = 503
    code: ClassVar[str] = "coordination"
