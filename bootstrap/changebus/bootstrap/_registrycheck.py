"""A relay's schema registry held against the log's before its windows are stored.

The log store keeps the relay's raw windows, whose events name their table
by ``(source_id, schema_version)``, and the schemas of those pairs
(``cb_schema``). The pairs are a relay registry's own: two relays reading
one source each on their own (a bootstrap server configured with both, for
failover) may give a table another id, or a version number another schema.
Windows of such a relay, stored beside the first relay's, would be decoded
with the wrong schema or fold one table's rows under two ids.

:func:`registry_conflicts` says how a relay's registry disagrees with the
stored one: one name under two ids, one id naming two tables, or one
``(source_id, version)`` with two fingerprints. The producer asks before it
stores the first window of a relay (at start and on every switch) and the
log writer whenever it copies schemas; a conflict is a
:class:`~changebus.schemas.SchemaError`: the relay's windows are not stored,
the partition's state is ``error`` and the producer tries again (another
relay, or this one once it agrees) every ``producer.fell_off_retry_s``.

Pure functions; no I/O except :func:`relay_registry`.
"""

from __future__ import annotations

import json

import aiohttp

from changebus.client import RelaySchemas
from changebus.schemas import TableSchema

__all__ = ["Entry", "describe", "registry_conflicts", "relay_registry"]

#: (source_id, version, table name, schema JSON): a ``cb_schema`` row
Entry = tuple[int, int, str, str]

#: conflicts named in one error message (the rest are counted)
_SHOWN = 5


async def relay_registry(
    session: aiohttp.ClientSession, url: str, partition: str, per_request: aiohttp.ClientTimeout
) -> list[Entry]:
    """Every schema version of every source of ``partition`` on the relay at ``url``."""
    source = RelaySchemas(session, url, partition, per_request)
    names = await source.source_names()
    entries: list[Entry] = []
    for name in sorted(set(names.values())):
        for sid, schema in await source.source_schemas(name):
            entries.append((sid, schema.version, schema.name, json.dumps(schema.to_json())))
    return entries


def registry_conflicts(stored: list[Entry], relay: list[Entry]) -> list[str]:
    """How ``relay`` disagrees with ``stored`` (empty: its windows may be stored).

    Only what both know is compared: a table or version the store has not
    seen yet is new, not a conflict.
    """
    ids = {name: sid for sid, _v, name, _j in stored}
    names = {sid: name for sid, _v, name, _j in stored}
    prints = {(sid, v): _fingerprint(j) for sid, v, _n, j in stored}
    found: list[str] = []
    seen: set[tuple[str, int]] = set()
    for sid, version, name, text in relay:
        if (name, sid) not in seen:
            seen.add((name, sid))
            if ids.get(name, sid) != sid:
                found.append(f"table {name!r} is source id {sid} there, {ids[name]} in the log")
            elif names.get(sid, name) != name:
                found.append(f"source id {sid} is table {name!r} there, {names[sid]!r} in the log")
        stored_print = prints.get((sid, version))
        if stored_print is not None and stored_print != _fingerprint(text):
            found.append(f"table {name!r} version {version} is another schema there")
    return found


def describe(conflicts: list[str]) -> str:
    """The first few conflicts, for an error message."""
    shown = "; ".join(conflicts[:_SHOWN])
    more = len(conflicts) - _SHOWN
    return shown + (f" (and {more} more)" if more > 0 else "")


def _fingerprint(text: str) -> int:
    return TableSchema.from_json(json.loads(text)).fingerprint
