"""Finding plugins: named providers declared in entry-point groups.

changebus has two extension points, each an entry-point group whose entries
name a callable by ``module:attribute``:

* ``changebus.fetchers``: fetcher kinds (name = the kind a relay config
  names; value = a :data:`~changebus.fetchers.FetcherFactory`);
* ``changebus.commands``: providers of ``changebus`` subcommands (value = a
  ``register(subparsers)`` function).

A third-party distribution declares entries in the same groups in its own
``pyproject.toml`` (``[project.entry-points."changebus.fetchers"]``) and is
found once installed; nothing is imported to *find* a plugin, only to *load*
one (:meth:`Plugin.load`), so a relay imports the one fetcher its config names.

Where changebus's own entries come from. An installed changebus (wheel or
editable install) declares them in its distribution metadata. A source
checkout run without installing anything (plain ``pytest`` from the
repository root, ``python -m changebus.schemas`` with ``PYTHONPATH`` on the
source roots) has no metadata, or metadata of some other copy; so when this
module sits in a source checkout -- a ``pyproject.toml`` of the project named
``changebus`` at the root of the source tree -- changebus's own entries are
read from that file, and any installed ``changebus`` distribution's entries
are ignored: the declarations always describe the code actually imported.
Entries of every other distribution come from their metadata. Either way
the table of entries is data, never an import, so finding plugins cannot
form an import cycle.

Order and duplicates: changebus's own entries come first, sorted by name
(as installed metadata lists them, so both sources give the same order),
then other distributions' entries sorted by distribution and name. A name
declared twice keeps its first declaration (a plugin cannot replace a
built-in entry). :func:`declared_plugins` reads the metadata once per group
and process and caches the answer (thread-safe: a race computes the same
table twice).
"""

from __future__ import annotations

import functools
import importlib.metadata
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

__all__ = ["PROJECT", "Plugin", "declared_plugins", "source_tree_pyproject"]

#: the distribution whose own entries a source checkout's pyproject.toml replaces
PROJECT: Final = "changebus"


@dataclass(frozen=True, slots=True)
class Plugin:
    """One declared entry: ``name`` in ``group`` is provided by ``target``.

    ``target`` is ``module`` or ``module:attribute`` (entry-point syntax);
    ``origin`` tells who declared it: a distribution's name, or the path of
    the source checkout's ``pyproject.toml`` (for error messages).
    """

    group: str
    name: str
    target: str
    origin: str

    @property
    def module(self) -> str:
        """The module :meth:`load` imports."""
        return self._entry().module

    def load(self) -> Any:
        """Import the module and return the named attribute.

        Raises what the import raises (``ModuleNotFoundError`` when the
        module, or a library it needs, is missing) or ``AttributeError``.
        """
        return self._entry().load()

    def _entry(self) -> importlib.metadata.EntryPoint:
        return importlib.metadata.EntryPoint(name=self.name, value=self.target, group=self.group)


def source_tree_pyproject() -> Path | None:
    """The source checkout's ``pyproject.toml`` when this code runs from one, else None.

    This module is ``<root>/schemas/changebus/schemas/plugins.py`` in a
    checkout; an installed copy sits in ``site-packages``, where no
    ``pyproject.toml`` of the project named ``changebus`` is found.
    """
    candidate = Path(__file__).resolve().parents[3] / "pyproject.toml"
    table = _read_pyproject(candidate)
    if table is None or table.get("project", {}).get("name") != PROJECT:
        return None
    return candidate


@functools.cache
def declared_plugins(group: str) -> tuple[Plugin, ...]:
    """Every entry of ``group``, changebus's own first (see the module docstring)."""
    own: list[Plugin] = []
    others: list[Plugin] = []
    pyproject = source_tree_pyproject()
    if pyproject is not None:
        table = _read_pyproject(pyproject) or {}
        entries = table.get("project", {}).get("entry-points", {}).get(group, {})
        own.extend(
            Plugin(group, name, str(target), str(pyproject)) for name, target in entries.items()
        )
    for entry in importlib.metadata.entry_points(group=group):
        dist = entry.dist.name if entry.dist is not None else ""
        if _normalise(dist) != PROJECT:
            others.append(Plugin(group, entry.name, entry.value, dist))
        elif pyproject is None:
            own.append(Plugin(group, entry.name, entry.value, dist))
    own.sort(key=lambda p: p.name)
    others.sort(key=lambda p: (_normalise(p.origin), p.name))
    found: dict[str, Plugin] = {}
    for plugin in (*own, *others):
        found.setdefault(plugin.name, plugin)
    return tuple(found.values())


@functools.cache
def _read_pyproject(path: Path) -> dict[str, Any] | None:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError):
        return None


def _normalise(dist: str) -> str:
    return dist.lower().replace("_", "-").replace(".", "-")
