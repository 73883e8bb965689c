"""The fetcher interface: what the relay needs from a change source.

A fetcher turns a source's change log into **windows**: one per source
transaction, in commit order, each already encoded as back-to-back events
closed by an END_OF_WINDOW event (see docs/protocol.md). The relay drives it:

1. ``await fetcher.start(resume)`` -- connect and position the source after
   ``resume.scn`` (the newest window the relay already holds; ``-1`` = none),
   using ``resume.source_position`` when the SCN alone is not enough
   (a MySQL GTID). Returns the SCN from which the buffer is complete: a
   consumer at that SCN or later has missed nothing. An optional attribute
   ``start_evicted`` (true) says that changes before that SCN existed in
   changebus and are gone (a follower relay starting where its upstream
   evicted windows), not merely that capture began there.
2. ``async for window in fetcher.windows()`` -- windows with strictly
   increasing SCNs, none at or below ``resume.scn``.
   Optionally, ``fetcher.window_feed()`` instead: the same windows as a
   :class:`WindowFeed` queue, which the relay's ingest then reads directly
   (no task copying them from the iterator into a queue of its own: one
   task switch and one hand-over less per window). A run calls one of the
   two, once.
3. ``await fetcher.acknowledge(scn)`` -- everything up to ``scn`` is durable
   in the relay; the source may release it (Postgres flush LSN).
4. ``await fetcher.close()``.

Fetchers that use blocking libraries run them in threads or processes and
hand windows to the event loop through bounded queues, so back-pressure
reaches the source.

Kinds. The relay config names a fetcher ``kind`` and passes its options
table to that kind's :data:`FetcherFactory`. Kinds are plugins: a
distribution declares ``kind = "module:factory"`` in the entry-point group
``changebus.fetchers`` (changebus declares ``synthetic``, ``postgres`` and
``mysql`` in its pyproject.toml; a third-party fetcher installs the same
way), found by :func:`changebus.schemas.plugins.declared_plugins` without
importing anything. A kind's module is imported the first time a config
names it, so this module imports none of the fetchers (no import cycle) and
a relay loads only the fetcher it runs. :func:`register_fetcher` adds a
kind in-process (tests, embedding applications); it wins over a declared
kind of the same name.

Thread-safety: the registry is two dicts; registering, loading and looking
up are single dict operations (a race loads a module twice at worst, and
imports are serialised by the interpreter).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from changebus.schemas import ConfigError
from changebus.schemas.plugins import Plugin, declared_plugins

__all__ = [
    "Fetcher",
    "FetcherFactory",
    "ResumePoint",
    "Window",
    "WindowFeed",
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

    ``schemas`` (usually empty) are schema registry entries in the JSON form
    of :meth:`~changebus.schemas.SchemaRegistry.to_json` that the relay
    registers, with their source ids and versions, before it publishes this
    window: a fetcher mirroring another registry (a relay following a relay,
    whose upstream may no longer hold the SCHEMA_CHANGE events of its older
    tables) hands it over this way, in order with the windows.
    """

    scn: int
    timestamp_ns: int
    data: bytes
    events: int
    source_position: str = ""
    event_sizes: tuple[int, ...] = ()
    schemas: tuple[Mapping[str, Any], ...] = ()


def window_bytes(window: Window) -> int:
    """The size of a window's data: the weight that bounds queues of windows."""
    return len(window.data)


class WindowFeed(Protocol):
    """A fetcher's windows as a queue (``window_feed()``; see the module docstring).

    Items in order: windows, then ``None`` at the end of the stream or the
    fetcher's error (returned, not raised, so a consumer batching what is
    queued keeps the windows that came before it). Used from the event loop
    only. :class:`~changebus.fetchers._threadfeed.ThreadFeed` is one.
    """

    async def get(self) -> Window | BaseException | None:
        """The next item, waiting for one."""
        ...

    def get_nowait(self) -> Window | BaseException | None:
        """The next item; ``IndexError`` when none is queued."""
        ...

    def empty(self) -> bool:
        """Nothing queued now."""
        ...

    def inject(self, error: BaseException) -> None:
        """Deliver ``error`` after the items queued now (the consumer's own stop reason)."""
        ...


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

#: the entry-point group fetcher kinds are declared in
GROUP = "changebus.fetchers"

# kinds registered in process (register_fetcher), and declared kinds once loaded
_REGISTERED: dict[str, FetcherFactory] = {}
_LOADED: dict[str, FetcherFactory] = {}


def register_fetcher(kind: str, factory: FetcherFactory) -> None:
    """Make ``kind`` available to relay configurations of this process.

    Installed fetchers need not call this: they declare their kind in the
    ``changebus.fetchers`` entry-point group. A kind registered here wins
    over a declared kind of the same name.
    """
    _REGISTERED[kind] = factory


def fetcher_kinds() -> list[str]:
    """The available fetcher kinds: declared ones and those registered in process.

    Nothing is imported: a declared kind whose module cannot load (a missing
    extra) is listed, and :func:`create_fetcher` explains why it fails.
    """
    return sorted({*_REGISTERED, *(p.name for p in declared_plugins(GROUP))})


def create_fetcher(kind: str, name: str, partition_id: int, options: Mapping[str, Any]) -> Fetcher:
    """Build a fetcher of ``kind`` for partition ``name``/``partition_id`` from its options.

    An unknown kind, or a declared one whose module fails to import (a
    missing extra) or does not provide a factory, is a :class:`ConfigError`
    naming the kind and the installed kinds.

    Blocking the first time a kind is named (the entry points are read and
    the kind's module imported: file I/O): from a coroutine, call it in a
    worker thread.
    """
    return _factory(kind)(name, partition_id, options)


def _factory(kind: str) -> FetcherFactory:
    factory = _REGISTERED.get(kind) or _LOADED.get(kind)
    if factory is not None:
        return factory
    plugin = next((p for p in declared_plugins(GROUP) if p.name == kind), None)
    if plugin is None:
        raise ConfigError(f"unknown fetcher kind {kind!r}; {_available()}")
    factory = _load(plugin)
    _LOADED[kind] = factory
    return factory


def _load(plugin: Plugin) -> FetcherFactory:
    where = f"fetcher kind {plugin.name!r} ({plugin.target}, declared by {plugin.origin})"
    try:
        factory = plugin.load()
    except ModuleNotFoundError as exc:
        missing = f"module {exc.name!r} is missing" if exc.name else str(exc)
        raise ConfigError(f"{where} cannot be loaded: {missing}; {_available()}") from exc
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{where} cannot be loaded: {exc}; {_available()}") from exc
    if not callable(factory):
        raise ConfigError(f"{where} is not a fetcher factory; {_available()}")
    checked: FetcherFactory = factory
    return checked


def _available() -> str:
    return f"installed kinds: {', '.join(fetcher_kinds()) or '(none)'}"
