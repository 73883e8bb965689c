"""The seeding interface: one seeder per source kind (``seed.kind``).

A :class:`Seeder` copies tables of the source at one consistent snapshot
into the snapshot store and returns the snapshot's SCN: every window with a
larger SCN is after the snapshot, every other one is in it. The Postgres
seeder (:func:`._seed.seed_postgres`: an exported snapshot of a temporary
replication slot) and the MySQL/MariaDB one (:func:`._seed_mysql.seed_mysql`:
``START TRANSACTION WITH CONSISTENT SNAPSHOT`` and its binlog position) share
it; the service picks one with :func:`seeder_for`. Seeders are blocking and
run in a worker thread; they write through the callback they are given.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from changebus.schemas import ConfigError, TableSchema

from ._seed import SeedProgress, seed_postgres
from ._seed_mysql import seed_mysql

__all__ = ["Seeder", "seeder_for"]


class Seeder(Protocol):
    """Copies ``tables`` (``schema.table``) not in ``done``; returns the snapshot's SCN.

    ``schemas`` mirrors the relay's registry (source id, schema), so events
    get the relay's ids and versions; ``write(table, events, scn)`` merges one
    chunk of INSERT events, or records ``table`` as seeded when ``events`` is
    empty (the seed resumes per table). ``relay_fetcher`` is the relay's
    fetcher status of the partition (a seeder may need its position scheme).
    """

    def __call__(
        self,
        dsn: str,
        partition_id: int,
        schemas: Sequence[tuple[int, TableSchema]],
        tables: Sequence[str],
        done: set[str],
        write: Callable[[str, list[bytes], int], None],
        progress: SeedProgress,
        *,
        chunk_rows: int = ...,
        stop: threading.Event | None = ...,
        relay_fetcher: Mapping[str, Any] | None = ...,
    ) -> int: ...


def seeder_for(kind: str) -> Seeder:
    """The seeder of a source kind: ``postgres`` or ``mysql``."""
    if kind == "postgres":
        return seed_postgres
    if kind == "mysql":
        return seed_mysql
    raise ConfigError(f"seed.kind must be postgres or mysql, not {kind!r}")
