"""The fetcher interface: what the relay needs from a change source.

A fetcher turns a source's change log into **windows**: one per source
transaction, in commit order, each already encoded as back-to-back events
closed by an END_OF_WINDOW event (see docs/protocol.md). The relay drives it:

1. ``await fetcher.start(resume)`` -- connect and position the source after
   ``resume.scn`` (the newest window the relay already holds; ``-1`` = none),
   using ``resume.source_position`` when the SCN alone is not enough
   (a MySQL GTID). Returns the SCN from which the buffer is complete: a
   consumer at that SCN or later has missed nothing.
2. ``async for window in fetcher.windows()`` -- windows with strictly
   increasing SCNs, none at or below ``resume.scn``.
3. ``await fetcher.acknowledge(scn)`` -- everything up to ``scn`` is durable
   in the relay; the source may release it (Postgres flush LSN).
4. ``await fetcher.close()``.

Fetchers that use blocking libraries run them in threads or processes and
hand windows to the event loop through bounded queues, so back-pressure
reaches the source. Implementations register a factory under a ``kind``
name with :func:`register_fetcher`; the relay config names the kind and
passes the options table to the factory.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from changebus.schemas import ConfigError

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


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """Where the relay's buffer ends: the fetcher continues after it.

    ``schemas`` is the relay's schema registry (the JSON entries of
    :meth:`~changebus.schemas.SchemaRegistry.to_json`): a fetcher that
    numbers schema versions and source ids seeds its own registry with it, so
    that after a restart a table keeps its source id and an unchanged table
    its version, and a changed one gets the next version.
    """

    scn: int = -1
    source_position: str = ""
    schemas: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True, slots=True)
class Window:
    """One source transaction, encoded.

    ``data`` holds the events back to back, ending with END_OF_WINDOW; every
    event carries ``scn``. ``events`` counts them (END_OF_WINDOW included).

    ``event_sizes`` (the byte size of each event, in order) may be given only
    by a fetcher whose events were framed in this process by changebus's own
    encoders (:class:`~changebus.schemas.RowEncoder`,
    :func:`~changebus.schemas.encode_control`), which compute every CRC: the
    relay then appends the window without scanning it or computing its CRCs
    again (structure, SCNs and order are still checked). Empty: the relay
    verifies every event, CRCs included (any other producer).
    """

    scn: int
    timestamp_ns: int
    data: bytes
    events: int
    source_position: str = ""
    event_sizes: tuple[int, ...] = ()


def window_bytes(window: Window) -> int:
    """The size of a window's data: the weight that bounds queues of windows."""
    return len(window.data)


@runtime_checkable
class Fetcher(Protocol):
    """A source of windows (see the module docstring for the protocol)."""

    name: str

    async def start(self, resume: ResumePoint) -> int: ...

    def windows(self) -> AsyncIterator[Window]: ...

    async def acknowledge(self, scn: int) -> None: ...

    async def close(self) -> None: ...

    def status(self) -> dict[str, Any]:
        """Fetcher-specific figures for /v1/status (lag, retained WAL, ...)."""
        ...


#: builds a fetcher from (partition name, partition id, options table)
FetcherFactory = Callable[[str, int, Mapping[str, Any]], Fetcher]

_KINDS: dict[str, FetcherFactory] = {}


def register_fetcher(kind: str, factory: FetcherFactory) -> None:
    """Make ``kind`` available to relay configurations."""
    _KINDS[kind] = factory


def fetcher_kinds() -> list[str]:
    """The registered fetcher kinds."""
    _load_builtin()
    return sorted(_KINDS)


def create_fetcher(kind: str, name: str, partition_id: int, options: Mapping[str, Any]) -> Fetcher:
    """Build a fetcher of a registered kind; unknown kinds are a ConfigError."""
    _load_builtin()
    try:
        factory = _KINDS[kind]
    except KeyError:
        raise ConfigError(
            f"unknown fetcher kind {kind!r}; available: {', '.join(sorted(_KINDS))}"
        ) from None
    return factory(name, partition_id, options)


def _load_builtin() -> None:
    # imported lazily: a fetcher's heavy dependencies load only when used
    from . import _synthetic  # noqa: F401
    from .postgres import _fetcher  # noqa: F401

    try:  # the [mysql] extra (mysql-replication, PyMySQL) may be missing
        import pymysql  # noqa: F401
        import pymysqlreplication  # noqa: F401
    except ImportError:
        return
    from .mysql import _fetcher as _mysql_fetcher  # noqa: F401
