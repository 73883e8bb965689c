"""``ClusterConfig``: the ``[cluster]`` table of a relay's or bootstrap server's config."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from changebus.schemas.config import load_config_dict, read_secret_file, read_toml, secret
from changebus.schemas.errors import ConfigError

log = logging.getLogger("changebus.cluster")

__all__ = ["ClusterConfig", "warn_loopback_advertised"]


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """Where the cluster's ZooKeeper is and who this member is.

    * ``zookeeper``: the connect string, ``host:port[,host:port...]`` with an
      optional ``/chroot``. It holds no secret (the ZooKeeper credentials, when
      used, are ``zk_user`` / ``zk_password`` below, never part of it), so it
      may be logged.
    * ``name``: the cluster; every znode lives under ``/changebus/<name>/``.
    * ``session_timeout_s``: the ZooKeeper session timeout asked for (the
      server clamps it to 2..20 ticks). A crashed leader is replaced after
      about this long; a leader's lease (:class:`~changebus.cluster.Leadership`)
      lasts ``lease_fraction`` of it after each confirmed round trip.
    * ``member_id``: unique in the cluster (the relay's or server's name);
      ``advertised_url``: the URL other members and clients use to reach it.
    * ``connect_timeout_s``: how long :meth:`ZkSession.start` waits for the
      first connection before failing (retriable).
    * ``zk_user`` / ``zk_password`` (or ``zk_password_file``): ZooKeeper
      *digest* credentials. With them, the session authenticates and every
      znode it creates under ``/changebus/<name>/`` gets the ACL "this user
      may do everything" plus, when ``zk_world_readable`` (the default),
      "anyone may read" -- so consumers find relays without credentials but
      nobody without them can register a member, stand for election or move
      an epoch. The password is a secret: not in the repr, never logged.
    * ``source_give_up_s``: a relay leading a partition whose source it has not
      been able to read for this long (a member's wrong DSN or password, no
      route to the database) gives its term up and queues again behind the
      other members, so that one of them can try (0: never).
    """

    zookeeper: str
    name: str
    member_id: str = ""
    advertised_url: str = ""
    session_timeout_s: float = 4.0
    connect_timeout_s: float = 15.0
    lease_fraction: float = 0.5
    zk_user: str = ""
    zk_password: str = secret("")
    zk_password_file: str = ""
    zk_world_readable: bool = True
    source_give_up_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.zookeeper.strip():
            raise ConfigError("cluster.zookeeper: a connect string host:port[,host:port] is needed")
        if not self.name or "/" in self.name or self.name in (".", ".."):
            raise ConfigError(f"cluster.name: {self.name!r} is not a znode name")
        if self.name == "groups" and self.zk_user:
            # (/changebus/groups is the consumer groups' tree: a cluster there with
            # credentials put its digest ACLs on the groups' nodes and locked their
            # consumers out; review. Sessions of consumer groups alone use the name)
            raise ConfigError(
                "cluster.name: 'groups' is taken (/changebus/groups holds the consumer groups)"
            )
        if "/" in self.member_id or self.member_id in (".", ".."):
            raise ConfigError(f"cluster.member_id: {self.member_id!r} is not a znode name")
        if not 0.2 <= self.session_timeout_s <= 600:
            raise ConfigError(
                f"cluster.session_timeout_s: {self.session_timeout_s} is out of 0.2..600 s"
            )
        if self.connect_timeout_s <= 0:
            raise ConfigError("cluster.connect_timeout_s must be positive")
        if not 0.05 <= self.lease_fraction <= 0.9:
            raise ConfigError(f"cluster.lease_fraction: {self.lease_fraction} is out of 0.05..0.9")
        if self.source_give_up_s < 0:
            raise ConfigError("cluster.source_give_up_s must not be negative (0: never)")
        if ":" in self.zk_user:
            raise ConfigError("cluster.zk_user must not contain ':'")
        has_password = bool(self.zk_password) or bool(self.zk_password_file)
        if bool(self.zk_user) != has_password:
            raise ConfigError(
                "cluster.zk_user and cluster.zk_password (or zk_password_file) go together"
            )
        if self.zk_password and self.zk_password_file:
            raise ConfigError("give cluster.zk_password or cluster.zk_password_file, not both")

    def check_listen_host(self, host: str) -> None:
        """Refuse a wildcard ``host`` (the daemon's ``http.host``) without an
        ``advertised_url``: the default URL (``http://<host>:<port>``) would tell
        the other machines to connect to ``0.0.0.0``, themselves (found by review).
        A loopback host is allowed (a cluster on one machine); the daemon warns."""
        if not self.advertised_url and host.strip("[]") in ("0.0.0.0", "::", ""):
            raise ConfigError(
                f"cluster.advertised_url: set it (http.host is {host!r}, a wildcard: the other"
                " members and the clients would be told to connect to it, which is"
                " themselves)"
            )

    def zk_credentials(self) -> tuple[str, str] | None:
        """``(user, password)`` for ZooKeeper digest authentication, or None.

        Reads ``zk_password_file`` (blocking: call it off the event loop); an
        unreadable or empty file is a :class:`ConfigError` naming the file.
        """
        if not self.zk_user:
            return None
        if self.zk_password:
            return self.zk_user, self.zk_password
        password = read_secret_file(self.zk_password_file, "cluster.zk_password_file")
        return self.zk_user, password

    @classmethod
    def from_table(cls, table: Mapping[str, Any], where: str = "cluster") -> ClusterConfig:
        """Build from an already parsed ``[cluster]`` table."""
        return load_config_dict(cls, table, where)

    @classmethod
    def from_toml(cls, path: Path | str) -> ClusterConfig | None:
        """The ``[cluster]`` table of a TOML file, or None when it has none."""
        tree = read_toml(path)
        table = tree.get("cluster")
        if table is None:
            return None
        if not isinstance(table, Mapping):
            raise ConfigError(f"{path}: [cluster] must be a table")
        return cls.from_table(table)


def warn_loopback_advertised(url: str) -> None:
    """Log a warning when a member advertises a loopback URL by default (only processes on
    its own machine can reach it: right for a cluster on one machine, wrong on several)."""
    host = (urlsplit(url).hostname or "").lower()
    if host == "localhost" or host.startswith("127.") or host == "::1":
        log.warning(
            "advertising %s to the cluster (the default, from http.host): only this machine"
            " can reach it; set cluster.advertised_url when members or clients run elsewhere",
            url,
        )
