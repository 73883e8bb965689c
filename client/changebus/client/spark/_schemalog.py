"""Schema changes of a streaming query: what changed, and the query's schema log.

:func:`diff_tables` compares the version of a table a query reads with a
newer one and says what changed, in Spark's terms (the Arrow types of
:func:`~._arrow.table_fields`): columns added, dropped, retyped, and types
widened (``int`` to ``bigint``, ``float`` to ``double``: Avro promotions
that every older value fits). Added columns and widened types are
*additive*: rows of the old version read into the new schema lose nothing
(the new columns are null). A dropped or retyped column is not: the query
reads it only when ``allowSchemaChanges`` names the kind (``drop``,
``retype``).

:class:`SchemaLog` is the query's schema tracking location
(``schemaTrackingLocation``, Delta Lake's option of the same name): a
directory of numbered JSON entries ``00000000.json``, ``00000001.json``, ...,
each the complete set of table schemas the query reads from some position
on. Entry 0 is written when the query is first defined (the relays' newest
versions then); the driver appends an entry when it finds a newer version
in the next batch's range, then stops the query. The Spark schema of a
(re)started query is that of the newest entry, so a restart continues with
the new columns. An entry holds:

* ``tables`` -- ``{name: TableSchema JSON}`` (the Avro reader schemas);
* ``at`` -- the offsets ``{partition: scn}`` where the change was found (the
  start of the first batch that reads the new version; ``{}`` for entry 0);
* ``changes`` -- what changed per table, and ``needs``: the kinds
  (``drop``, ``retype``) a query must allow to read past ``at``;
* ``sources`` / ``partitions`` -- the query's options, checked when the log
  is opened (a log belongs to one query).

Entries are written to a temporary file, fsync'ed and renamed, so a crash
never leaves a torn entry. The directory must be on a local or mounted file
system of the driver (like the Spark checkpoint it belongs in); one query
writes a log. Nothing here imports pyspark.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from changebus.schemas import ConfigError, SchemaError, TableSchema

from ._arrow import table_fields

__all__ = ["SchemaEntry", "SchemaLog", "TableChange", "diff_tables"]

log = logging.getLogger(__name__)

_WIDENINGS = {(pa.int32(), pa.int64()), (pa.float32(), pa.float64())}
_FORMAT = 1


@dataclass(frozen=True, slots=True)
class TableChange:
    """How one table's columns differ between two versions (module docstring).

    ``retyped`` and ``widened`` hold ``(column, old type, new type)`` with
    Spark's type names.
    """

    table: str
    old_version: int
    new_version: int
    added: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()
    retyped: tuple[tuple[str, str, str], ...] = ()
    widened: tuple[tuple[str, str, str], ...] = ()

    @property
    def empty(self) -> bool:
        """True when the two versions give the same Spark columns (nothing to do)."""
        return not (self.added or self.dropped or self.retyped or self.widened)

    @property
    def needs(self) -> frozenset[str]:
        """The ``allowSchemaChanges`` kinds this change needs (empty: additive)."""
        return frozenset(
            kind for kind, cols in (("drop", self.dropped), ("retype", self.retyped)) if cols
        )

    def describe(self) -> str:
        """``public.t v1 -> v2: added [c], dropped [d], retyped [e int -> string]``."""
        parts = []
        if self.added:
            parts.append(f"added {list(self.added)}")
        if self.dropped:
            parts.append(f"dropped {list(self.dropped)}")
        for what, cols in (("retyped", self.retyped), ("widened", self.widened)):
            if cols:
                parts.append(f"{what} [" + ", ".join(f"{c} {a} -> {b}" for c, a, b in cols) + "]")
        return f"{self.table} v{self.old_version} -> v{self.new_version}: " + (
            ", ".join(parts) or "the same Spark columns (nullability or Avro types changed)"
        )

    def to_json(self) -> dict[str, Any]:
        """JSON form (log entries, error details)."""
        return {
            "table": self.table,
            "old_version": self.old_version,
            "new_version": self.new_version,
            "added": list(self.added),
            "dropped": list(self.dropped),
            "retyped": [list(r) for r in self.retyped],
            "widened": [list(r) for r in self.widened],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TableChange:
        """The inverse of :meth:`to_json`."""
        return cls(
            table=str(data["table"]),
            old_version=int(data["old_version"]),
            new_version=int(data["new_version"]),
            added=tuple(str(c) for c in data.get("added", ())),
            dropped=tuple(str(c) for c in data.get("dropped", ())),
            retyped=tuple((str(a), str(b), str(c)) for a, b, c in data.get("retyped", ())),
            widened=tuple((str(a), str(b), str(c)) for a, b, c in data.get("widened", ())),
        )


def _type_name(t: pa.DataType) -> str:
    from pyspark.sql.pandas.types import from_arrow_type

    try:
        return str(from_arrow_type(t, prefer_timestamp_ntz=True).simpleString())
    except Exception:  # noqa: BLE001 - a name for a message only
        return str(t)


def diff_tables(old: TableSchema, new: TableSchema) -> TableChange:
    """What reading ``new`` rows into ``old``'s columns would change (module docstring)."""
    before = {f.name: f.type for f in table_fields(old)}
    after = {f.name: f.type for f in table_fields(new)}
    retyped: list[tuple[str, str, str]] = []
    widened: list[tuple[str, str, str]] = []
    for name, t in after.items():
        was = before.get(name)
        if was is None or was == t:
            continue
        entry = (name, _type_name(was), _type_name(t))
        (widened if (was, t) in _WIDENINGS else retyped).append(entry)
    return TableChange(
        table=new.name,
        old_version=old.version,
        new_version=new.version,
        added=tuple(n for n in after if n not in before),
        dropped=tuple(n for n in before if n not in after),
        retyped=tuple(retyped),
        widened=tuple(widened),
    )


@dataclass(frozen=True)
class SchemaEntry:
    """One entry of a :class:`SchemaLog` (module docstring)."""

    seq: int
    tables: dict[str, TableSchema]
    at: dict[str, int] = field(default_factory=dict)
    changes: tuple[TableChange, ...] = ()

    @property
    def needs(self) -> frozenset[str]:
        """The ``allowSchemaChanges`` kinds needed to read past :attr:`at`."""
        out: frozenset[str] = frozenset()
        for c in self.changes:
            out |= c.needs
        return out

    def pending(self, start: Mapping[str, Any]) -> bool:
        """Whether a batch from ``start`` reads this entry's change first (not passed yet).

        ``at`` names the partitions where the change was found; a batch that
        reads a change takes its whole window, so once a batch from ``at``
        is committed the start is past it.
        """
        return any(int(start.get(p, scn)) <= scn for p, scn in self.at.items())


class SchemaLog:
    """The schema tracking location of one query (module docstring).

    ``sources`` and ``partitions`` are the query's options (empty: all); an
    existing log written for other ones is refused.
    """

    def __init__(
        self, path: str | os.PathLike[str], sources: tuple[str, ...], partitions: tuple[str, ...]
    ) -> None:
        self.path = Path(path)
        self.sources = sources
        self.partitions = partitions

    def _file(self, seq: int) -> Path:
        return self.path / f"{seq:08d}.json"

    def _seqs(self) -> list[int]:
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return []
        return sorted(int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit())

    def latest(self) -> SchemaEntry | None:
        """The newest entry, None for an empty (or missing) log."""
        seqs = self._seqs()
        if not seqs:
            return None
        f = self._file(seqs[-1])
        try:
            data = json.loads(f.read_text())
            if data.get("format") != _FORMAT:
                raise ValueError(f"format {data.get('format')!r}, expected {_FORMAT}")
            sources, partitions = tuple(data["sources"]), tuple(data["partitions"])
            entry = SchemaEntry(
                seq=int(data["seq"]),
                tables={str(n): TableSchema.from_json(t) for n, t in data["tables"].items()},
                at={str(p): int(s) for p, s in data.get("at", {}).items()},
                changes=tuple(TableChange.from_json(c) for c in data.get("changes", ())),
            )
        except (OSError, ValueError, KeyError, TypeError, SchemaError) as exc:
            raise ConfigError(
                f"schemaTrackingLocation {self.path}: entry {f.name} cannot be read ({exc})"
            ) from None
        if (sources, partitions) != (self.sources, self.partitions):
            raise ConfigError(
                f"schemaTrackingLocation {self.path} belongs to a query of sources"
                f" {list(sources) or 'all'} and partitions {list(partitions) or 'all'}, not"
                f" {list(self.sources) or 'all'} / {list(self.partitions) or 'all'}: give each"
                " query its own location (inside its checkpoint location)"
            )
        return entry

    def append(
        self,
        tables: Mapping[str, TableSchema],
        at: Mapping[str, int] | None = None,
        changes: tuple[TableChange, ...] = (),
    ) -> SchemaEntry:
        """Write the next entry (atomically) and return it."""
        seqs = self._seqs()
        seq = seqs[-1] + 1 if seqs else 0
        entry = SchemaEntry(seq, dict(tables), dict(at or {}), changes)
        doc = {
            "format": _FORMAT,
            "seq": seq,
            "written_ms": int(time.time() * 1000),
            "sources": list(self.sources),
            "partitions": list(self.partitions),
            "at": entry.at,
            "needs": sorted(entry.needs),
            "changes": [c.to_json() for c in changes],
            "tables": {n: t.to_json() for n, t in tables.items()},
        }
        self.path.mkdir(parents=True, exist_ok=True)
        tmp = self.path / f".{seq:08d}.json.tmp"
        with open(tmp, "w") as out:
            out.write(json.dumps(doc, indent=1))
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self._file(seq))
        dirfd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(dirfd)
        finally:
            os.close(dirfd)
        log.info(
            "changebus schema log %s: entry %d%s",
            self.path,
            seq,
            "".join(f"; {c.describe()}" for c in changes),
        )
        return entry
