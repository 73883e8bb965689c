"""Schema evolution of a streaming query: find a table's new version, stop before it.

The Spark schema of a query is fixed when the query starts: the schema of
the newest entry of its schema log (``schemaTrackingLocation``, see
:mod:`._schemalog`), or without one the relays' newest versions then
(:func:`query_tables`). Rows of older versions are read into it by Avro
resolution. Rows of a *newer* version must not be: their new columns would
be lost, silently. So the driver checks each micro-batch it plans
(:meth:`SchemaGuard.check`, from ``latestOffset``):

1. One ``/v1/sources`` request: does a partition of the batch list a version
   of a read table newer than the query's (or, reading every table, a new
   table)? Usually not, and that is all.
2. If one does, and its columns differ from the query's (:func:`~._schemalog.diff_tables`;
   a version with the same column types and nullability is harmless), the
   batch's range is scanned from the event headers (no row decoding, like
   the read limits) for the first window holding a row of such a version.
3. A batch that would read rows before that window ends just before it
   (those rows are read with the query's schema); a batch that would start
   with it is not planned: the driver appends the new schema to the schema
   log and raises :class:`~changebus.schemas.SchemaChangedError` (retriable;
   a restart continues with the new schema) or, for a dropped or retyped
   column that ``allowSchemaChanges`` does not allow,
   :class:`~changebus.schemas.SchemaChangeRefusedError` (not retriable).
   The log remembers a refused change, so a restart without the option is
   refused again before it reads anything.

A range read through a bootstrap server cannot be cut: when a newer version
exists, such a batch is not planned and the query stops the same way.

Between ``load()`` and ``start()``. Spark asks the source for its schema when
the DataFrame is made (``schema()``) and hands it back when the query starts
(``streamReader(schema)``), which reads the tables again. A version with new
columns in between would be the guard's baseline while the query's columns
lack them: its rows would lose them, silently. So ``schema()`` marks its
first field with a digest of the columns it derived (:func:`mark_schema`),
and a reader whose marked schema's digest differs from the columns it
derives now stops with the retriable ``SchemaChangedError`` (load the
DataFrame again; :func:`check_marked_schema`). A schema the user gives
(``.schema(...)``, a subset on purpose) carries no mark and is not checked.
Everything here runs on the driver; the executors' copy of the guard is
never used.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, NoReturn

import pyarrow as pa
from pyspark.sql.types import StructField, StructType

from changebus.schemas import (
    FIRST_CONTROL_OP,
    ConfigError,
    Op,
    SchemaChangedError,
    SchemaChangeRefusedError,
    TableSchema,
    parse_stream,
)

from .._decode import same_columns
from .._errors import FellOffRelayError
from .._http import read_body, response_error
from .._info import PartitionSources, RelayInfo
from ._options import SourceOptions
from ._relay import _ask, _by_relays, _with_relays, planner_params, run_sync, table_schemas
from ._schemalog import SchemaLog, TableChange, diff_tables

__all__ = [
    "SchemaGuard",
    "check_marked_schema",
    "check_options",
    "mark_schema",
    "query_tables",
    "schema_change_of",
    "schema_log",
]

log = logging.getLogger(__name__)

#: (source id, schema version) of a data event in one partition
_Version = tuple[int, int]
_EOW = int(Op.END_OF_WINDOW)


def schema_log(opts: SourceOptions) -> SchemaLog | None:
    """The query's schema log (``schemaTrackingLocation``), None without the option."""
    if not opts.schema_tracking_location:
        return None
    return SchemaLog(opts.schema_tracking_location, opts.sources, opts.partitions)


def query_tables(opts: SourceOptions, partitions: list[str]) -> dict[str, TableSchema]:
    """The table schemas a query reads with: its schema log's newest entry, else the relays'.

    A query with a new (empty) log writes entry 0 with the relays' newest
    versions, when the relays know any table.
    """
    slog = schema_log(opts)
    entry = slog.latest() if slog is not None else None
    if entry is not None:
        return entry.tables
    tables = run_sync(table_schemas(opts, partitions))
    if slog is not None and tables:
        slog.append(tables)
    return tables


#: the field metadata key of :func:`mark_schema`
MARK: Final = "changebus.columns"


def _columns_digest(derived: pa.Schema) -> str:
    shape = [(f.name, str(f.type), f.nullable) for f in derived]
    return hashlib.sha256(json.dumps(shape).encode()).hexdigest()[:32]


def mark_schema(struct: StructType, derived: pa.Schema) -> StructType:
    """``struct`` (the Spark form of ``derived``) with the digest of ``derived``'s
    columns in its first field's metadata (module docstring, "Between load() and
    start()")."""
    if not struct.fields:
        return struct
    first, *rest = struct.fields
    meta = {**(first.metadata or {}), MARK: _columns_digest(derived)}
    return StructType([StructField(first.name, first.dataType, first.nullable, meta), *rest])


def check_marked_schema(given: StructType, derived: pa.Schema | None) -> None:
    """Raise :class:`SchemaChangedError` when ``given`` is a schema :func:`mark_schema`
    marked from other columns than ``derived`` (what the reader reads now)."""
    mark = (given.fields[0].metadata or {}).get(MARK) if given.fields else None
    if mark is None or derived is None or mark == _columns_digest(derived):
        return
    raise SchemaChangedError(
        "the source's tables changed between the DataFrame's load() and the query's start"
        " (their columns differ from the DataFrame's): load the DataFrame again, or keep the"
        " query's schema in a log (option schemaTrackingLocation)",
        columns=[f.name for f in derived],
    )


@dataclass(frozen=True, slots=True)
class _Hit:
    """The first window of a partition's range that holds rows of a newer version."""

    partition: str
    before: int  # the last window SCN before it (the range's start when it is the first)
    scn: int
    versions: frozenset[_Version]


class SchemaGuard:
    """Stops a query at a table's newer schema version (module docstring).

    ``tables`` are the query's table schemas (:func:`query_tables`). Holds
    plain data only (it is pickled with the reader); the driver's copy
    remembers which newer versions proved harmless.
    """

    def __init__(self, opts: SourceOptions, tables: Mapping[str, TableSchema]) -> None:
        self.opts = opts
        self.tables = dict(tables)
        self._harmless: set[tuple[str, str, int]] = set()  # (partition, table, version)
        self._pending_checked = False

    async def check(
        self,
        start: Mapping[str, Any],
        end: dict[str, int],
        boot: set[str],
        *,
        logged: bool = False,
    ) -> dict[str, int]:
        """``end``, cut before the first window of a newer version; raises at such a window.

        ``start`` / ``end`` are the batch's offsets, ``boot`` the partitions
        whose range goes through a bootstrap server (never cut). ``logged``:
        the batch's end is logged already (a replay), so it cannot be cut: a
        newer version anywhere in it stops the query.
        """
        self._check_pending(start)
        reading = [p for p, e in end.items() if p in start and int(e) > int(start[p])]
        if not reading:
            return end
        newer = await self._newer_versions(reading)
        if not newer:
            return end
        hits: list[_Hit] = []
        for part, candidates in newer.items():
            since = int(start[part])
            if part in boot:
                hits.append(_Hit(part, since, since, frozenset(candidates)))
                continue
            hit = await self._scan(part, since, int(end[part]), set(candidates))
            if hit is not None:
                hits.append(hit)
        first = [h for h in hits if logged or h.before <= int(start[h.partition])]
        if first:
            self._stop(start, first, newer)
        for h in hits:
            log.info(
                "changebus partition %s: the batch ends at SCN %d, before the first rows of a"
                " newer table schema (window %d)",
                h.partition,
                h.before,
                h.scn,
            )
            end[h.partition] = h.before
        return end

    # ---- what the relays hold --------------------------------------------

    async def _newer_versions(
        self, partitions: list[str]
    ) -> dict[str, dict[_Version, TableSchema]]:
        """Per partition, the newer versions of read tables whose columns differ."""
        found: dict[str, PartitionSources] = {}
        # each partition from the relays serving it (a cluster's may differ), one listing
        # per set of relays: a listing per partition, each naming every partition's
        # sources, made a trigger cost what the partitions are many, squared
        for urls, parts in await _by_relays(self.opts, partitions):
            listed = await _ask(self.opts, urls, RelayInfo.sources)
            found.update((part, listed[part]) for part in parts if part in listed)
        wanted: dict[str, list[tuple[int, str, int]]] = {}
        for part in partitions:
            ps = found.get(part)
            if ps is None:
                continue
            for s in ps.sources:
                if self.opts.sources and s.name not in self.opts.sources:
                    continue
                have = self.tables.get(s.name)
                if have is None and (self.opts.sources or not self.tables):
                    # a table the query has no schema of (started with .schema(...) before
                    # the relay knew it): read as written, filled in by column name
                    continue
                base = have.version if have is not None else 0
                for v in s.versions:
                    if v > base and (part, s.name, v) not in self._harmless:
                        wanted.setdefault(part, []).append((s.id, s.name, v))
        out: dict[str, dict[_Version, TableSchema]] = {}
        for part, items in wanted.items():
            names = sorted({name for _, name, _ in items})
            schemas = await _with_relays(
                self.opts, functools.partial(_versions, names=names, partition=part), partition=part
            )
            for sid, name, v in items:
                new = schemas.get((name, v))
                old = self.tables.get(name)
                if new is None:
                    continue
                if old is not None and same_columns(old, new):
                    self._harmless.add((part, name, v))
                    continue
                out.setdefault(part, {})[(sid, v)] = new
        return out

    async def _scan(
        self, partition: str, since: int, until: int, candidates: set[_Version]
    ) -> _Hit | None:
        """The first window in ``(since, until]`` holding a data event of ``candidates``."""
        try:
            return await _first_window(self.opts, partition, since, until, candidates)
        except FellOffRelayError as exc:
            if self.opts.bootstrap:
                # evicted meanwhile: the batch reads the range through a bootstrap server,
                # which cannot be cut (module docstring), newer rows and all
                return _Hit(partition, since, since, frozenset(candidates))
            if self.opts.fail_on_data_loss or exc.prev_scn <= since:
                return None  # reading the batch fails (or skips) the same range
            return await _first_window(self.opts, partition, exc.prev_scn, until, candidates)

    # ---- stopping ----------------------------------------------------------

    def _check_pending(self, start: Mapping[str, Any]) -> None:
        """Refuse again a logged change the options still do not allow (restart without them).

        Once per reader: the reader's first batch starts where the last run stopped.
        """
        if self._pending_checked:
            return
        self._pending_checked = True
        slog = schema_log(self.opts)
        entry = slog.latest() if slog is not None else None
        if entry is None or not entry.pending(start):
            return
        missing = entry.needs - self.opts.allow_schema_changes
        if missing:
            raise _refusal(self.opts, entry.changes, missing, logged=True)
        if entry.needs:
            log.warning(
                "changebus: reading past a schema change that allowSchemaChanges=%s allows: %s",
                ",".join(sorted(self.opts.allow_schema_changes)),
                "; ".join(c.describe() for c in entry.changes),
            )

    def _stop(
        self,
        start: Mapping[str, Any],
        hits: list[_Hit],
        newer: Mapping[str, Mapping[_Version, TableSchema]],
    ) -> NoReturn:
        """Log the new schema (with a log) and raise the change's error."""
        versions: dict[str, TableSchema] = {}
        for h in hits:
            for sv in h.versions:
                new = newer[h.partition][sv]
                if new.name not in versions or versions[new.name].version < new.version:
                    versions[new.name] = new
        changes = tuple(
            _change(self.tables.get(name), new) for name, new in sorted(versions.items())
        )
        needs: frozenset[str] = frozenset()
        for c in changes:
            needs |= c.needs
        slog = schema_log(self.opts)
        if slog is not None:
            tables = {**self.tables, **versions}
            at = {h.partition: int(start[h.partition]) for h in hits}
            slog.append(tables, at, changes)
        missing = needs - self.opts.allow_schema_changes
        if missing:
            raise _refusal(self.opts, changes, missing, logged=slog is not None)
        what = "; ".join(c.describe() for c in changes)
        where = ", ".join(f"{h.partition} after SCN {h.before}" for h in hits)
        if slog is not None:
            how = (
                f"start the query again: it continues with the new schema, kept in"
                f" schemaTrackingLocation {slog.path}"
            )
        else:
            how = (
                "start the query again: it continues with the relays' newest schema (set the"
                " option schemaTrackingLocation to keep the query's schema in its checkpoint)"
            )
        raise SchemaChangedError(
            f"changebus: the schema of a table read by this query changed ({what}); the query"
            f" stopped before the first row of the new version ({where}). This is retriable:"
            f" {how}",
            changes=[c.to_json() for c in changes],
            at={h.partition: h.before for h in hits},
        )


def _change(old: TableSchema | None, new: TableSchema) -> TableChange:
    if old is None:  # a table that appeared while the query reads every table
        return TableChange(new.name, 0, new.version, added=tuple(c.name for c in new.columns))
    return diff_tables(old, new)


def _refusal(
    opts: SourceOptions, changes: tuple[TableChange, ...], missing: frozenset[str], *, logged: bool
) -> SchemaChangeRefusedError:
    allow = ",".join(sorted(missing | opts.allow_schema_changes))
    what = "; ".join(c.describe() for c in changes)
    kinds = " and ".join(
        {"drop": "dropped columns", "retype": "retyped columns"}[k] for k in sorted(missing)
    )
    msg = (
        f"changebus: the schema of a table read by this query changed ({what}); {kinds} are"
        " refused (rows read into the old schema would lose them, into the new one change"
        " the meaning of what the sink holds). Not retriable as it is: to read on, start the"
        f" query again with the option allowSchemaChanges={allow}"
    )
    if not logged:
        msg += (
            " (without schemaTrackingLocation a restart takes the relays' newest schema as it"
            " is: set that option too to keep the query's schema in its checkpoint)"
        )
    else:
        msg += ", or start a new query with a new checkpoint and schemaTrackingLocation"
    return SchemaChangeRefusedError(
        msg, changes=[c.to_json() for c in changes], needs=sorted(missing)
    )


async def _versions(
    info: RelayInfo, *, names: list[str], partition: str
) -> dict[tuple[str, int], TableSchema]:
    out: dict[tuple[str, int], TableSchema] = {}
    for name in names:
        for found in (await info.schemas(name, partition)).values():
            for t in found.schemas:
                out[(name, t.version)] = t
    return out


async def _first_window(
    opts: SourceOptions, partition: str, since: int, until: int, candidates: set[_Version]
) -> _Hit | None:
    """Scan ``(since, until]``'s event headers for the first window with rows of ``candidates``."""

    async def call(info: RelayInfo) -> _Hit | None:
        scn, offset = since, -1
        before = since
        hit_scn = -1
        seen: set[_Version] = set()
        while True:
            params = planner_params(opts, partition, scn, offset)
            async with info.session.get(f"{info.url}/v1/stream", params=params) as resp:
                if resp.status == 204:
                    break
                if resp.status != 200:
                    raise await response_error(
                        resp, info.where, kind="stream", partition=partition, requested_scn=scn
                    )
                body = await read_body(resp, opts.max_window_bytes, info.where)
                next_scn = int(resp.headers["X-Changebus-Next-Scn"])
                next_offset = int(resp.headers["X-Changebus-Next-Offset"])
            if not body:
                break
            _, headers = parse_stream(body, verify_payload=False)
            for op, wscn, sid, ver in zip(
                headers["op"].tolist(),
                headers["scn"].tolist(),
                headers["source_id"].tolist(),
                headers["schema_version"].tolist(),
                strict=True,
            ):
                if hit_scn >= 0 and wscn != hit_scn:
                    return _Hit(partition, before, hit_scn, frozenset(seen))
                if wscn > until:
                    return None
                if op < FIRST_CONTROL_OP and (sid, ver) in candidates:
                    hit_scn = wscn
                    seen.add((sid, ver))
                elif hit_scn < 0 and op == _EOW:
                    before = wscn
            scn, offset = next_scn, next_offset
        if hit_scn >= 0:
            return _Hit(partition, before, hit_scn, frozenset(seen))
        return None

    return await _with_relays(opts, call, partition=partition)


def schema_change_of(error: BaseException) -> str | None:
    """The code of the schema change that stopped a query, from the error Spark raised.

    Spark hands the driver's Python exceptions back wrapped (a
    ``StreamingQueryException`` holding the Python traceback as text):
    ``"schema_changed"`` (:class:`~changebus.schemas.SchemaChangedError`,
    retriable: start the query again), ``"schema_change_refused"``
    (:class:`~changebus.schemas.SchemaChangeRefusedError`), else None.
    """
    if isinstance(error, SchemaChangedError):
        return error.code
    text = str(error)
    if "SchemaChangeRefusedError" in text:
        return SchemaChangeRefusedError.code
    if "SchemaChangedError" in text:
        return SchemaChangedError.code
    return None


def check_options(opts: SourceOptions) -> None:
    """Refuse schema tracking for batch reads (there is no stream to stop)."""
    if opts.schema_tracking_location:
        raise ConfigError(
            "option schemaTrackingLocation is for streaming queries (spark.readStream)"
        )
