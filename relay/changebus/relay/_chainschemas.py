"""What a following relay knows of its upstream's schema registry (:mod:`._chain`).

:class:`KnownSchemas` holds the local registry's entries by ``(table, version)``
with their ``(source id, fingerprint)``, and the ``(source id, version)`` pairs
whose rows this relay may append. :meth:`KnownSchemas.learn` takes an upstream
registry's entries: the ones the local registry lacks are returned (to be
handed over with the next window), and one that gives a known table and
version another source id or other columns is refused: the upstream keeps
another registry (rebuilt, or another relay's), its source ids name other
tables here, and its rows, appended as they come, would be decoded as the
wrong table (review). Each known entry is parsed once (a registry is
append-only). Event loop only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from changebus.schemas import SourceConfigError, TableSchema

__all__ = ["Entry", "KnownSchemas"]

#: one ``{"source_id", "schema"}`` entry of a registry (its JSON form)
Entry = Mapping[str, Any]


def _key(entry: Entry) -> tuple[str, int]:
    """``(table, schema version)`` of an entry."""
    return str(entry["schema"]["name"]), int(entry["schema"]["version"])


def _identity(entry: Entry) -> tuple[int, int]:
    """``(source id, schema fingerprint)``: what two registries holding an entry's table
    and version must agree on."""
    return int(entry["source_id"]), TableSchema.from_json(entry["schema"]).fingerprint


def entry_id(entry: Entry) -> tuple[int, int]:
    """``(source id, schema version)`` of an entry: what its rows' headers carry."""
    return int(entry["source_id"]), int(entry["schema"]["version"])


class KnownSchemas:
    """The local registry's entries, and the ids whose rows may be appended (module
    docstring)."""

    def __init__(self, entries: Iterable[Entry] = ()) -> None:
        entries = tuple(entries)
        self._known = {_key(e): _identity(e) for e in entries}
        #: keys an upstream's registry was found to agree on (each parsed once)
        self._checked: set[tuple[str, int]] = set()
        #: ``(source id, version)`` pairs whose rows may be appended
        self.ids = {entry_id(e) for e in entries}

    def learn(self, entries: Iterable[Entry], partition: str) -> tuple[Entry, ...]:
        """The entries the local registry lacks (now known); raises
        :class:`SourceConfigError` for one the local registry holds otherwise."""
        entries = tuple(entries)
        new = tuple(e for e in entries if _key(e) not in self._known)
        for e in entries:
            key = _key(e)
            known = self._known.get(key)
            if known is None or key in self._checked:
                continue
            if known != _identity(e):
                name, version = key
                raise SourceConfigError(
                    f"partition {partition}: the upstream's schema registry is not this "
                    f"relay's: {name} v{version} is source id {e['source_id']} there, "
                    f"{known[0]} here (or its columns differ). Follow relays that share "
                    "one registry (a cluster), or rebuild this relay's buffer (data_dir) "
                    "from the upstream"
                )
            self._checked.add(key)
        for e in new:
            self._known[_key(e)] = _identity(e)
            self._checked.add(_key(e))
            self.ids.add(entry_id(e))
        return new
