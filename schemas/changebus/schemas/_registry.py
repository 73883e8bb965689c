"""The schema registry: every version of every table schema ever seen.

Versions of a table are numbered 1, 2, 3, ... in the order they were first
seen. Registering a schema whose fingerprint equals the table's *latest*
version returns that version; any other change -- including a return to an
older shape (a column added, then dropped again) -- gets a new version, so
versions always follow time and a reader can tell "newer" from "older".
Each table also gets a small stable ``source_id`` (1..65535) that events carry
in their header.

Persistence: with a ``path``, every new entry is appended to a JSON-lines
file (``{"crc": ..., "entry": {...}}`` per line, the CRC-32 over the entry's
compact JSON) and flushed with fsync before :meth:`register` returns. On
open, a torn or corrupt *last* line (a crash during the append) is dropped;
damage anywhere else raises :class:`SchemaError` rather than guessing.

Thread-safety: all methods take one internal lock; the registry may be shared
by the relay's writer thread and its HTTP handlers.
"""

from __future__ import annotations

import json
import os
import threading
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ._table import TableSchema
from .errors import SchemaError, UnknownSchemaError

__all__ = ["SchemaRegistry"]


class SchemaRegistry:
    """Table schemas by name and version, by fingerprint, and source ids."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._versions: dict[str, list[TableSchema]] = {}
        self._ids: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self._by_fp: dict[int, TableSchema] = {}
        if path is not None and path.exists():
            self._load(path)

    # ---- persistence --------------------------------------------------

    def _load(self, path: Path) -> None:
        lines = path.read_bytes().split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
        for i, line in enumerate(lines):
            try:
                record = json.loads(line)
                entry = record["entry"]
                text = json.dumps(entry, sort_keys=True, separators=(",", ":"))
                if zlib.crc32(text.encode()) != record["crc"]:
                    raise ValueError("checksum mismatch")
                table = TableSchema.from_json(entry["schema"])
                self._add(table, int(entry["source_id"]))
            except (ValueError, KeyError, TypeError, SchemaError) as exc:
                if i == len(lines) - 1:
                    # torn append: cut it off so the next append starts clean
                    good = b"".join(x + b"\n" for x in lines[:-1])
                    path.write_bytes(good)
                    return
                raise SchemaError(
                    f"schema registry {path} is damaged at line {i + 1}: {exc}"
                ) from None

    def _append(self, table: TableSchema, source_id: int) -> None:
        if self.path is None:
            return
        entry = {"source_id": source_id, "schema": table.to_json()}
        text = json.dumps(entry, sort_keys=True, separators=(",", ":"))
        line = json.dumps({"crc": zlib.crc32(text.encode()), "entry": entry}, separators=(",", ":"))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(line + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def _add(self, table: TableSchema, source_id: int) -> None:
        known = self._ids.get(table.name)
        if known is not None and known != source_id:
            raise SchemaError(
                f"table {table.name!r} already has source id {known}, not {source_id}"
            )
        other = self._names.get(source_id)
        if other is not None and other != table.name:
            raise SchemaError(f"source id {source_id} already names {other!r}, not {table.name!r}")
        versions = self._versions.setdefault(table.name, [])
        if table.version != len(versions) + 1:
            raise SchemaError(
                f"table {table.name!r}: expected version {len(versions) + 1}, got {table.version}"
            )
        versions.append(table)
        self._ids[table.name] = source_id
        self._names[source_id] = table.name
        self._by_fp.setdefault(table.fingerprint, table)

    # ---- registration -------------------------------------------------

    def register(self, table: TableSchema) -> TableSchema:
        """The registered version of ``table`` (a new version when it changed)."""
        with self._lock:
            versions = self._versions.get(table.name, [])
            if versions and versions[-1].fingerprint == table.fingerprint:
                return versions[-1]
            source_id = self._ids.get(table.name)
            if source_id is None:
                source_id = next(
                    (i for i in range(len(self._names) + 1, 65536) if i not in self._names), 0
                )
                if source_id == 0:
                    source_id = next((i for i in range(1, 65536) if i not in self._names), 0)
                if source_id == 0:
                    raise SchemaError("the registry is full (65535 sources)")
            registered = table.with_version(len(versions) + 1)
            self._add(registered, source_id)
            self._append(registered, source_id)
            return registered

    def register_as(self, table: TableSchema, source_id: int) -> TableSchema:
        """Record a schema with the version and source id another registry gave it.

        Used by the relay to mirror its fetcher's registry from SCHEMA_CHANGE
        events: a version already known with the same fingerprint is a no-op.
        """
        with self._lock:
            versions = self._versions.get(table.name, [])
            if 0 < table.version <= len(versions):
                have = versions[table.version - 1]
                if have.fingerprint != table.fingerprint:
                    raise SchemaError(
                        f"table {table.name!r} version {table.version} already exists with other columns"
                    )
                return have
            if table.version != len(versions) + 1:
                raise SchemaError(
                    f"table {table.name!r}: got version {table.version}, expected {len(versions) + 1}"
                )
            self._add(table, source_id)
            self._append(table, source_id)
            return table

    def import_entries(self, entries: Iterable[tuple[int, TableSchema]]) -> None:
        """Load ``(source_id, schema)`` pairs fetched from a server (in version order)."""
        for source_id, table in sorted(entries, key=lambda e: (e[1].name, e[1].version)):
            self.register_as(table, source_id)

    # ---- lookups ------------------------------------------------------

    def source_id(self, name: str) -> int:
        with self._lock:
            try:
                return self._ids[name]
            except KeyError:
                raise UnknownSchemaError(f"no source named {name!r}") from None

    def name_for_id(self, source_id: int) -> str:
        with self._lock:
            try:
                return self._names[source_id]
            except KeyError:
                raise UnknownSchemaError(f"no source with id {source_id}") from None

    def get(self, name: str, version: int) -> TableSchema:
        with self._lock:
            versions = self._versions.get(name, [])
            if not 1 <= version <= len(versions):
                raise UnknownSchemaError(f"no version {version} of source {name!r}")
            return versions[version - 1]

    def latest(self, name: str) -> TableSchema:
        with self._lock:
            versions = self._versions.get(name)
            if not versions:
                raise UnknownSchemaError(f"no source named {name!r}")
            return versions[-1]

    def versions(self, name: str) -> list[TableSchema]:
        with self._lock:
            versions = self._versions.get(name)
            if not versions:
                raise UnknownSchemaError(f"no source named {name!r}")
            return list(versions)

    def by_fingerprint(self, fingerprint: int) -> TableSchema:
        with self._lock:
            try:
                return self._by_fp[fingerprint]
            except KeyError:
                raise UnknownSchemaError(f"no schema with fingerprint {fingerprint:016x}") from None

    def sources(self) -> list[tuple[int, str]]:
        with self._lock:
            return sorted(self._names.items())

    def to_json(self) -> list[dict[str, Any]]:
        with self._lock:
            return [
                {"source_id": self._ids[name], "schema": t.to_json()}
                for name in sorted(self._versions)
                for t in self._versions[name]
            ]
