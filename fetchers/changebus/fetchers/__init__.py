"""changebus.fetchers: change sources that feed the relay.

The :class:`Fetcher` protocol, the :class:`Window` and :class:`ResumePoint`
values it exchanges with the relay, and a registry of fetcher kinds
(``synthetic`` built in; ``postgres`` and ``mysql`` as they land).
"""

from ._base import (
    Fetcher as Fetcher,
    FetcherFactory as FetcherFactory,
    ResumePoint as ResumePoint,
    Window as Window,
    create_fetcher as create_fetcher,
    fetcher_kinds as fetcher_kinds,
    register_fetcher as register_fetcher,
    window_bytes as window_bytes,
)

__all__ = [
    "Fetcher",
    "FetcherFactory",
    "ResumePoint",
    "Window",
    "create_fetcher",
    "fetcher_kinds",
    "register_fetcher",
    "window_bytes",
]
