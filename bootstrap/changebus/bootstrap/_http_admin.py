"""The bootstrap server's admin requests: ``POST /v1/seed`` and ``POST /v1/snapshot``.

Both need scope ``admin`` (with ``[security]`` principals; 403 otherwise,
before anything else is looked at) and a seed source (``seed.dsn``), and
start a seed run in the background (:meth:`~._seeding.Seeding.start_seed`):
the answer is 202 with its progress, which ``/v1/status`` shows under
``seed`` until it ends. ``seed.dsn`` is the source of ``seed.partition`` (or
of the only partition): a request for another partition is 400. At most one
seed runs per partition: a request while one runs is refused (503
``not_yet``, retriable: the same request succeeds once that run ended; the
running one goes on).

``POST /v1/seed?partition=P&tables=a,b`` re-seeds whole tables (none: every
table the partition knows).

``POST /v1/snapshot`` snapshots one table again while the system runs, all
of it or a part, in chunks (:mod:`._chunks`); its JSON body::

    {"partition": "P",              # optional when the server has one partition
     "table": "schema.table",
     "where": "region = 'eu'",      # optional: an SQL condition of the source
     "keys": [[1, "a"], [2, "b"]]}  # optional: key values (a scalar per row for one column)

``where`` and ``keys`` exclude each other. The body is at most
:data:`MAX_BODY` bytes (413 beyond) and names at most :data:`MAX_KEYS` keys;
it is parsed in a thread, not on the event loop. Malformed JSON, more keys, unknown or mistyped
fields, a ``where`` holding ``;``, keys that are not lists of JSON scalars
(or whose length is not the table's key length), tables the partition
lacks and a ``where`` / ``keys`` snapshot of a table whose whole-table
snapshot is stored in progress (it would replace that job) are 400 with a
message naming what is wrong. Consumers get the rows
as ordinary snapshot pages (they are newer rows of the snapshot store).

Event loop only (the store is read through its reader threads).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from aiohttp import web

from changebus.schemas import BadRequestError, ForbiddenError, TableSchema
from changebus.schemas.security import principal_of
from changebus.schemas.server import check_params, json_response

from ._chunks import SnapshotScope
from ._seed_mysql_values import KEY_TAGS
from ._service import BootstrapService

__all__ = ["MAX_BODY", "MAX_KEYS", "add_admin_routes", "parse_snapshot_body"]

#: the largest ``POST /v1/snapshot`` body accepted (bytes)
MAX_BODY = 1 << 20
#: the most keys one ``POST /v1/snapshot`` names
MAX_KEYS = 100_000

#: ``partition_of(request, name)``: the partition ``name`` names (None: the only one), checked
PartitionOf = Callable[[web.Request, str | None], str]

_SEED_PARAMS = frozenset({"partition", "tables"})
_BODY_FIELDS = frozenset({"partition", "table", "where", "keys"})
_SCALARS = (str, int, float, bool, type(None))


def add_admin_routes(
    app: web.Application, service: BootstrapService, partition_of: PartitionOf
) -> None:
    """Add ``POST /v1/seed`` and ``POST /v1/snapshot`` (module docstring) to ``app``."""

    async def seed(request: web.Request) -> web.Response:
        """``POST /v1/seed?partition=P&tables=a,b``: (re-)seed tables from the source (202)."""
        check_params(request.query, _SEED_PARAMS)
        principal = principal_of(request)
        principal.check_scope("admin")
        part = partition_of(request, request.query.get("partition"))
        tables = [t.strip() for t in request.query.get("tables", "").split(",") if t.strip()]
        if principal.sources is not None and not tables:
            raise ForbiddenError(
                f"principal {principal.name!r} is granted only some sources: name the tables "
                "to seed (tables=...)"
            )
        principal.restrict_sources(tables, ())  # (403 for a table not granted)
        progress = await service.seed_on_demand(part, tables)
        return json_response({"partition": part, "seed": progress.as_dict()}, status=202)

    async def snapshot(request: web.Request) -> web.Response:
        """``POST /v1/snapshot``: snapshot one table (or its ``where`` rows, or ``keys``) (202)."""
        check_params(request.query, ())
        principal = principal_of(request)
        principal.check_scope("admin")
        doc = await _json_body(request)
        part = partition_of(request, _optional_str(doc, "partition"))
        # (up to MAX_KEYS keys: a tenth of a second of Python, not on the event loop)
        scope = await asyncio.to_thread(parse_snapshot_body, doc)
        principal.restrict_sources((scope.table,), ())  # (403 for a table not granted)
        if scope.where and (principal.sources is not None or principal.partitions is not None):
            # a condition is SQL run with the seed's credentials: a subquery in it reads
            # any table they may read, not only the ones this principal was granted
            raise ForbiddenError(
                f"principal {principal.name!r} is granted some sources or partitions only: it "
                "may snapshot "
                "a table whole or by keys, not by a where condition"
            )
        service.check_seeds(part)
        await service.check_seed_tables(part, [scope.table])
        if scope.keys:
            await _check_key_length(service, part, scope)
        if not scope.whole:
            await _check_no_whole_job(service, part, scope.table)
        progress = service.start_seed(part, [scope.table], again=True, scope=scope)
        return json_response(
            {
                "partition": part,
                "table": scope.table,
                "scope": scope.kind,
                "seed": progress.as_dict(),
            },
            status=202,
        )

    app.router.add_post("/v1/seed", seed)
    app.router.add_post("/v1/snapshot", snapshot)


async def _json_body(request: web.Request) -> dict[str, Any]:
    """The request's JSON object, read up to :data:`MAX_BODY` bytes (413 beyond, 400 not JSON)."""
    size = request.content_length
    if size is not None and size > MAX_BODY:
        raise _too_large(size)
    data = bytearray()
    while True:
        piece = await request.content.read(64 << 10)
        if not piece:
            break
        data += piece
        if len(data) > MAX_BODY:
            raise _too_large(len(data))
    try:
        doc = await asyncio.to_thread(json.loads, bytes(data))  # (up to MAX_BODY bytes)
    except RecursionError:  # (nested deeper than the interpreter's stack: a 500 before)
        raise BadRequestError("the body is not a JSON document (nested too deeply)") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError alike
        why = (
            f" ({exc.msg} at character {exc.pos})" if isinstance(exc, json.JSONDecodeError) else ""
        )
        raise BadRequestError(f"the body is not a JSON document{why}") from None
    if not isinstance(doc, dict):
        raise BadRequestError('the body must be a JSON object: {"table": "schema.table", ...}')
    return doc


def _too_large(size: int) -> web.HTTPRequestEntityTooLarge:
    return web.HTTPRequestEntityTooLarge(
        MAX_BODY,
        size,
        reason=f"the body is larger than {MAX_BODY} bytes (give fewer keys; a where condition "
        "selects many rows in a few bytes)",
    )


def _optional_str(doc: dict[str, Any], name: str) -> str | None:
    value = doc.get(name)
    if value is not None and not isinstance(value, str):
        raise BadRequestError(f"{name} must be a string")
    return value


def parse_snapshot_body(doc: dict[str, Any]) -> SnapshotScope:
    """The :class:`SnapshotScope` of a ``POST /v1/snapshot`` body (400 naming what is wrong)."""
    unknown = sorted(set(doc) - _BODY_FIELDS)
    if unknown:
        shown = ", ".join(repr(u[:40]) for u in unknown[:5])
        raise BadRequestError(
            f"unknown field(s) {shown}; a snapshot takes {', '.join(sorted(_BODY_FIELDS))}"
        )
    table = _optional_str(doc, "table")
    if not table:
        raise BadRequestError('name the table to snapshot: {"table": "schema.table"}')
    where = _optional_str(doc, "where")
    if where is not None and not where.strip():
        raise BadRequestError("where is empty: give an SQL condition, or leave where out")
    where = (where or "").strip()
    raw_keys = doc.get("keys")
    if where and raw_keys is not None:
        raise BadRequestError("give either where or keys, not both")
    if ";" in where or "\x00" in where:
        raise BadRequestError("where must be one SQL condition (no ';', no NUL characters)")
    _one_condition(where)
    keys = () if raw_keys is None else _parse_keys(raw_keys)
    return SnapshotScope(table, where, keys)


def _one_condition(where: str) -> None:
    """Refuse a ``where`` that is not one parenthesised condition.

    The condition is put inside ``AND (...)`` of each chunk's query: one that
    closes that parenthesis (``true) OR (true``) would make every chunk read
    the whole table again. So parentheses outside quotes must balance and
    never close more than they opened; comments (which could hide the rest of
    the query), backslashes (an escape in MariaDB's strings, a plain
    character in Postgres', so the two would read the quotes differently)
    and ``$`` outside quotes (Postgres' dollar quoting) are refused.
    """
    depth, quote, i = 0, "", 0
    while i < len(where):
        c = where[i]
        if quote:
            if c == quote:
                quote = ""
        elif c in "'\"`":
            quote = c
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth < 0:
                break
        elif where.startswith(("--", "/*", "#"), i):
            raise BadRequestError("where may not hold SQL comments")
        elif c == "$":  # Postgres' $$...$$ quoting would hide parentheses from this count
            raise BadRequestError("where may not hold '$' outside quotes (dollar quoting)")
        if c == "\\":
            raise BadRequestError("where may not hold backslashes")
        i += 1
    if depth or quote:
        raise BadRequestError(
            "where must be one SQL condition: its parentheses and quotes must pair up"
        )


def _parse_keys(raw: Any) -> tuple[tuple[Any, ...], ...]:
    """``[[v1, v2], ...]`` (a scalar per row for a one-column key) as tuples of JSON scalars."""
    if not isinstance(raw, list) or not raw:
        raise BadRequestError(
            "keys must be a non-empty JSON list of keys: [[v1, v2], ...] (one value per key "
            "column), or [v, ...] for a one-column key"
        )
    if len(raw) > MAX_KEYS:
        raise BadRequestError(
            f"{len(raw)} keys: at most {MAX_KEYS} a request (send several, or a where condition)"
        )
    keys: list[tuple[Any, ...]] = []
    for i, item in enumerate(raw):
        key = tuple(item) if isinstance(item, list) else (item,)
        if not key or not all(isinstance(v, _SCALARS) or _tagged(v) for v in key):
            raise BadRequestError(
                f"keys[{i}] must be a JSON scalar or a non-empty list of scalars "
                f'(numbers, strings, null, or a tagged value such as {{"b64": "..."}}: '
                f"{', '.join(sorted(KEY_TAGS))})"
            )
        if len(key) != len(keys[0] if keys else key):
            raise BadRequestError(f"keys[{i}] has {len(key)} values, keys[0] {len(keys[0])}")
        keys.append(key)
    return tuple(keys)


def _tagged(value: Any) -> bool:
    """A tagged key value: ``{"b64": "..."}`` and the like (a MariaDB binary, decimal,
    date or time key column, as the seed's cursors write them)."""
    return (
        isinstance(value, dict)
        and len(value) == 1
        and next(iter(value)) in KEY_TAGS
        and isinstance(next(iter(value.values())), str | int)
    )


async def _check_no_whole_job(service: BootstrapService, part: str, table: str) -> None:
    """400 when a whole-table snapshot of ``table`` is stored in progress.

    A table has one stored job (``cb_snapjob``): a ``where`` / ``keys``
    snapshot would replace it, and the table's seed would then start again
    from nothing instead of resuming.
    """
    jobs = await service.stores.read(lambda s: s.snapshot_jobs(part))
    for job in jobs:
        if job.table == table and SnapshotScope.kind_of_json(job.scope) == "table":
            raise BadRequestError(
                f"a snapshot of the whole table {table} is stored in progress ({job.chunks} "
                f"chunks); finish it first: POST /v1/seed?partition={part}&tables={table} "
                "resumes it"
            )


async def _check_key_length(service: BootstrapService, part: str, scope: SnapshotScope) -> None:
    """400 when the keys' length is not the table's key length (the relay's newest schema)."""
    rows = await service.stores.read(lambda s: s.schemas(part))
    versions = [(v, j) for _s, v, n, j in rows if n == scope.table]
    if not versions:
        return  # known to the relay only: the reader checks the keys
    schema = TableSchema.from_json(json.loads(max(versions)[1]))
    if not schema.key:
        raise BadRequestError(
            f"table {scope.table} has no key in the relay's schema: keys cannot name its rows"
        )
    if len(scope.keys[0]) != len(schema.key):
        raise BadRequestError(
            f"table {scope.table}'s key is ({', '.join(schema.key)}): each key needs "
            f"{len(schema.key)} value(s), got {len(scope.keys[0])}"
        )
