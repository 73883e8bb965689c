"""The schema registry: every version of every table schema ever seen.

Versions. A table's versions are numbered 1, 2, 3, ... in the order they
were first seen. Registering a schema whose fingerprint equals the table's
*latest* version returns that version. Any other change gets a new version
-- including a return to an older shape (a column added, then dropped
again): versions always follow time, so a reader can tell "newer" from
"older" by comparing numbers, at the price of two versions with equal
content. :meth:`SchemaRegistry.by_fingerprint` returns the earliest of them.

Source ids. Each table also gets a small stable ``source_id`` (1..65535,
the next free one above the highest in use) at its first registration; events
carry it in their header. It never changes once persisted.

Persistence. With a ``path``, each new version is one line of a JSON-lines
file, ``{"crc": <CRC-32>, "entry": {"source_id": ..., "schema": {...}}}``, the
CRC over the entry's compact sorted-key JSON. :meth:`register` returns only
after the line is written and fsync'ed (and, for a new file, its directory).
An entry counts once its terminating newline is on disk. On open, a torn or
corrupt *last* line (a crash during an append) is ignored, and the next
append overwrites it; damage anywhere else raises :class:`SchemaError` rather
than guessing. Opening never modifies the file, so other processes may read
a file while one process (the only writer) appends to it.

Thread-safety. Two locks. ``_write_lock`` serialises the registrations
(checks, the file append, the fsync); ``_lock`` guards the in-memory maps,
which only a registration holding both changes, after its line is on disk.
Lookups take ``_lock`` only, so the relay's HTTP handlers never wait for a
fetcher's or the writer's fsync (they waited on the event loop, every
partition with them, whenever a DDL came while a request read a schema:
found by review). The registry may be shared by a fetcher thread, the
relay's writer and its HTTP handlers.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ._crc import crc32
from ._table import TableSchema
from .errors import SchemaError, UnknownSchemaError
from .files import open_private, private_dir

__all__ = ["SchemaRegistry"]

log = logging.getLogger("changebus.schemas")

_MAX_SOURCE_ID = 65535


def _entry_text(entry: Mapping[str, Any]) -> bytes:
    return json.dumps(entry, sort_keys=True, separators=(",", ":")).encode()


class SchemaRegistry:
    """Table schemas by name and version, by fingerprint, and source ids."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._lock = threading.Lock()  # the maps (module docstring)
        self._write_lock = threading.Lock()  # registrations, file I/O included
        self._versions: dict[str, list[TableSchema]] = {}
        self._ids: dict[str, int] = {}
        self._names: dict[int, str] = {}
        #: the highest source id in ``_names`` (ids are never removed): a new table's id
        #: without a scan of them all (which made a first start with 10k tables quadratic)
        self._top = 0
        self._by_fp: dict[int, TableSchema] = {}
        self._end = 0  # file offset just past the last good entry
        if path is not None and path.exists():
            self._load(path)

    # ---- persistence --------------------------------------------------

    def _load(self, path: Path) -> None:
        data = path.read_bytes()
        pos, lineno = 0, 0
        while pos < len(data):
            lineno += 1
            nl = data.find(b"\n", pos)
            if nl < 0:
                log.warning("schema registry %s: ignoring an unterminated last line", path)
                return
            try:
                record = json.loads(data[pos:nl])
                entry = record["entry"]
                if crc32(_entry_text(entry)) != record["crc"]:
                    raise ValueError("checksum mismatch")
                table = TableSchema.from_json(entry["schema"])
                source_id = entry["source_id"]
                if not isinstance(source_id, int):
                    raise TypeError(f"bad source id {source_id!r}")
                self._check(table, source_id)
            except (ValueError, KeyError, TypeError, SchemaError) as exc:
                if nl == len(data) - 1:
                    log.warning("schema registry %s: ignoring a torn last line: %s", path, exc)
                    return
                raise SchemaError(
                    f"schema registry {path} is damaged at line {lineno}: {exc}"
                ) from None
            self._add(table, source_id)
            pos = self._end = nl + 1

    def _append(self, table: TableSchema, source_id: int) -> None:
        if self.path is None:
            return
        entry = {"source_id": source_id, "schema": table.to_json()}
        line = json.dumps(
            {"crc": crc32(_entry_text(entry)), "entry": entry}, separators=(",", ":")
        ).encode()
        line += b"\n"
        private_dir(self.path.parent, narrow=False)
        created = not self.path.exists()
        fd = open_private(self.path, os.O_RDWR | os.O_CREAT)
        try:
            if os.fstat(fd).st_size != self._end:
                os.ftruncate(fd, self._end)  # drop a torn tail left by a crash
            done = 0
            while done < len(line):
                done += os.pwrite(fd, line[done:], self._end + done)
            os.fsync(fd)
        finally:
            os.close(fd)
        if created:
            dfd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        self._end += len(line)

    def _check(self, table: TableSchema, source_id: int) -> None:
        """Raise unless ``table`` can be the next version under ``source_id``."""
        if not 1 <= source_id <= _MAX_SOURCE_ID:
            raise SchemaError(f"source id {source_id} is not in 1..{_MAX_SOURCE_ID}")
        known = self._ids.get(table.name)
        if known is not None and known != source_id:
            raise SchemaError(
                f"table {table.name!r} already has source id {known}, not {source_id}"
            )
        other = self._names.get(source_id)
        if other is not None and other != table.name:
            raise SchemaError(f"source id {source_id} already names {other!r}, not {table.name!r}")
        expected = len(self._versions.get(table.name, ())) + 1
        if table.version != expected:
            raise SchemaError(
                f"table {table.name!r}: got version {table.version}, expected {expected}"
            )

    def _add(self, table: TableSchema, source_id: int) -> None:
        self._versions.setdefault(table.name, []).append(table)
        self._ids[table.name] = source_id
        self._names[source_id] = table.name
        self._top = max(self._top, source_id)
        self._by_fp.setdefault(table.fingerprint, table)

    def _commit(self, table: TableSchema, source_id: int) -> None:
        # (the caller holds _write_lock: nothing else changes the maps meanwhile)
        self._check(table, source_id)
        self._append(table, source_id)  # disk first: memory never runs ahead of it
        with self._lock:
            self._add(table, source_id)

    def _next_source_id(self) -> int:
        if self._top < _MAX_SOURCE_ID:
            return self._top + 1
        free = next((i for i in range(1, _MAX_SOURCE_ID + 1) if i not in self._names), None)
        if free is None:
            raise SchemaError(f"the registry is full ({_MAX_SOURCE_ID} sources)")
        return free

    # ---- registration -------------------------------------------------

    def register(self, table: TableSchema) -> TableSchema:
        """The registered version of ``table``: the latest if unchanged, else a new one.

        ``table.version`` is ignored. A new table also gets its source id.
        """
        fingerprint = table.fingerprint  # computed outside the lock
        with self._write_lock:
            versions = self._versions.get(table.name, [])
            if versions and versions[-1].fingerprint == fingerprint:
                return versions[-1]
            source_id = self._ids.get(table.name) or self._next_source_id()
            registered = table.with_version(len(versions) + 1)
            self._commit(registered, source_id)
            return registered

    def find(self, table: TableSchema) -> TableSchema | None:
        """The newest registered version with ``table``'s content (None: none has it).

        For a fetcher reading again changes the relay already holds (a restart
        that rewinds): the layout it meets there is one of the versions the
        relay knows, perhaps an older one, which :meth:`register` would make a
        new version (it compares with the latest only).
        """
        fingerprint = table.fingerprint
        with self._lock:
            for version in reversed(self._versions.get(table.name, [])):
                if version.fingerprint == fingerprint:
                    return version
        return None

    def register_as(self, table: TableSchema, source_id: int) -> TableSchema:
        """Record a schema with the version and source id another registry gave it.

        Used to mirror a registry (the relay from SCHEMA_CHANGE events, a
        client from ``/v1/schemas``): a version already known with the same
        content and source id is a no-op; a known version with other content,
        a gap in the versions or another source id raise :class:`SchemaError`.
        """
        fingerprint = table.fingerprint
        with self._write_lock:
            versions = self._versions.get(table.name, [])
            if 0 < table.version <= len(versions):
                have = versions[table.version - 1]
                if have.fingerprint != fingerprint:
                    raise SchemaError(
                        f"table {table.name!r} version {table.version} already exists"
                        " with other columns"
                    )
                if self._ids[table.name] != source_id:
                    raise SchemaError(
                        f"table {table.name!r} has source id {self._ids[table.name]},"
                        f" not {source_id}"
                    )
                return have
            self._commit(table, source_id)
            return table

    def import_entries(
        self, entries: Iterable[tuple[int, TableSchema] | Mapping[str, Any]]
    ) -> list[TableSchema]:
        """Load schemas fetched from a server; returns them as registered.

        Each entry is ``(source_id, schema)`` or the JSON form
        ``{"source_id": ..., "schema": {...}}`` of :meth:`to_json`. Entries may
        come in any order; per table they must form a gap-free run of versions
        following the ones already known (see :meth:`register_as`).
        """
        pairs: list[tuple[int, TableSchema]] = []
        for e in entries:
            if isinstance(e, Mapping):
                sid = e.get("source_id")
                # (int() took true as 1, 3.9 as 3 and "7" as 7: a table filed under
                # another source id; 1e400 raised OverflowError; review)
                if type(sid) is not int or not 1 <= sid <= _MAX_SOURCE_ID:
                    raise SchemaError(
                        f"bad schema entry: source_id {str(sid)[:32]!r} is not an int of"
                        f" 1 to {_MAX_SOURCE_ID}"
                    )
                try:
                    pairs.append((sid, TableSchema.from_json(e["schema"])))
                except (KeyError, TypeError, ValueError, AttributeError) as exc:
                    raise SchemaError(f"bad schema entry: {exc!r}"[:300]) from None
            elif _is_pair(e):
                pairs.append((e[0], e[1]))
            else:
                raise SchemaError(
                    f"bad schema entry: a {type(e).__name__}, not an object with source_id"
                    " and schema"
                )
        pairs.sort(key=lambda p: (p[1].name, p[1].version))
        return [self.register_as(table, source_id) for source_id, table in pairs]

    # ---- lookups ------------------------------------------------------

    def source_id(self, name: str) -> int:
        """The source id of table ``name``."""
        with self._lock:
            try:
                return self._ids[name]
            except KeyError:
                raise UnknownSchemaError(f"no source named {name!r}") from None

    def name_for_id(self, source_id: int) -> str:
        """The table name that ``source_id`` stands for."""
        with self._lock:
            try:
                return self._names[source_id]
            except KeyError:
                raise UnknownSchemaError(f"no source with id {source_id}") from None

    def get(self, name: str, version: int) -> TableSchema:
        """Version ``version`` (1-based) of table ``name``."""
        with self._lock:
            versions = self._versions.get(name, [])
            if not 1 <= version <= len(versions):
                raise UnknownSchemaError(f"no version {version} of source {name!r}")
            return versions[version - 1]

    def latest(self, name: str) -> TableSchema:
        """The newest version of table ``name``."""
        with self._lock:
            versions = self._versions.get(name)
            if not versions:
                raise UnknownSchemaError(f"no source named {name!r}")
            return versions[-1]

    def versions(self, name: str) -> list[TableSchema]:
        """Every version of table ``name``, oldest first."""
        with self._lock:
            versions = self._versions.get(name)
            if not versions:
                raise UnknownSchemaError(f"no source named {name!r}")
            return list(versions)

    def by_fingerprint(self, fingerprint: int) -> TableSchema:
        """The earliest version (of any table) with this fingerprint."""
        with self._lock:
            try:
                return self._by_fp[fingerprint]
            except KeyError:
                raise UnknownSchemaError(f"no schema with fingerprint {fingerprint:016x}") from None

    def has(self, name: str) -> bool:
        """Whether a table named ``name`` is registered."""
        with self._lock:
            return name in self._ids

    def sources(self) -> list[tuple[int, str]]:
        """``(source_id, name)`` of every table, by source id."""
        with self._lock:
            return sorted(self._names.items())

    def to_json(self) -> list[dict[str, Any]]:
        """Every version as ``{"source_id", "schema"}``, by name then version."""
        with self._lock:
            return [
                {"source_id": self._ids[name], "schema": t.to_json()}
                for name in sorted(self._versions)
                for t in self._versions[name]
            ]


def _is_pair(item: object) -> bool:
    """``item`` is a ``(source_id, TableSchema)`` tuple (from JSON it never is)."""
    return isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], TableSchema)
