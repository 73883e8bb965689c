"""``changebus relay|bootstrap --config FILE --check``: validate a daemon's config offline.

:func:`check_daemon_config` runs the checks a start would run before it
touches the network or the data, on a config already built by
:func:`~.config.load_config` (which checked keys, types and each section's
own rules): the listen address is allowed for the security settings
(:func:`~._security_config.check_bind`), the server's TLS certificate, key
and client CA load, the ``[upstream]`` TLS files and token file and the
``[cluster]`` password file are readable, ``data_dir`` is not a file, and then the daemon's own offline
checks (the relay builds each partition's fetcher from its options without
starting it). Any problem is a :class:`~.errors.ConfigError`.

:func:`config_summary` is what ``--check`` prints after ``config OK``: the
effective config, one ``key = value`` line per leaf, secrets masked
(:func:`~.config.redacted`). Stateless; blocking file reads (this runs in
the command, before any event loop).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ._client_auth import ClientAuth
from ._security_config import SecurityConfig, check_bind
from ._tls_server import server_ssl_context
from .config import redacted
from .errors import ConfigError

__all__ = ["check_daemon_config", "config_summary"]


def check_daemon_config(config: Any, extra: Callable[[Any], None] | None = None) -> None:
    """Raise :class:`ConfigError` for the first problem a start of ``config`` would meet offline."""
    security = getattr(config, "security", None)
    http = getattr(config, "http", None)
    if isinstance(security, SecurityConfig):
        if http is not None:
            check_bind(http.host, security)
        if security.tls is not None:
            server_ssl_context(security.tls)
    upstream = getattr(config, "upstream", None)
    if isinstance(upstream, ClientAuth):
        try:
            upstream.load()
        except ConfigError as exc:
            raise ConfigError(f"upstream: {exc.message}") from None
    cluster = getattr(config, "cluster", None)
    credentials = getattr(cluster, "zk_credentials", None)
    if callable(credentials):  # (reads cluster.zk_password_file: a start's first step)
        credentials()
    data_dir = getattr(config, "data_dir", None)
    if isinstance(data_dir, Path) and data_dir.exists() and not data_dir.is_dir():
        raise ConfigError(f"data_dir {data_dir} exists and is not a directory")
    if extra is not None:
        extra(config)


def _leaves(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict) and value:
        for key, item in value.items():
            yield from _leaves(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list) and value and any(isinstance(v, dict) for v in value):
        for i, item in enumerate(value):
            yield from _leaves(item, f"{path}[{i}]")
    else:
        yield path, value


def config_summary(config: Any) -> list[str]:
    """The effective ``config``, secrets masked: ``key = value`` lines (values as JSON)."""
    return [
        f"{key} = {json.dumps(value, default=str)}" for key, value in _leaves(redacted(config), "")
    ]
