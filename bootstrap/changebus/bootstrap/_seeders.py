"""The seeding interface: one seeder per source kind (``seed.kind``).

A :class:`Seeder` copies tables of the source into the snapshot store in
short chunks while writers go on (:mod:`._chunks`: keyset chunks, each in
its own short source transaction and merged at a *tag*, an SCN every change
at or before which the chunk saw) and returns the newest tag. The Postgres
seeder (:func:`._seed.seed_postgres`: a read-only low watermark validated
by each chunk's snapshot) and the MySQL/MariaDB one
(:func:`._seed_mysql.seed_mysql`: each chunk's ``START TRANSACTION WITH
CONSISTENT SNAPSHOT`` and its binlog position) share it; the service picks
one with :func:`seeder_for`. Seeders are blocking and run in a worker
thread; they hand chunks to the sink (or the callback) they are given.
"""

from __future__ import annotations

import threading
from typing import Protocol

from changebus.schemas import ConfigError

from ._chunks import SnapshotSink
from ._seed import seed_postgres
from ._seed_mysql import seed_mysql
from ._seedtypes import SeedProgress, SeedRequest, SeedWriter

__all__ = ["Seeder", "seeder_for"]


class Seeder(Protocol):
    """Copies ``request.tables`` not in ``request.done`` in chunks; returns the newest chunk tag.

    ``write(table, events, scn)`` merges one chunk of INSERT events at its
    tag, or records ``table`` as seeded when ``events`` is empty; ``sink`` (when
    given, instead of ``write``) takes chunks with their resume state
    (:class:`~._chunks.SnapshotSink`: the bootstrap service's store, so a
    table resumes after its last stored chunk); ``progress`` is updated as
    the copy goes (``state`` ends as ``copied``); a set ``stop`` ends the
    run between chunks with a retriable error. Blocking: called in a
    worker thread.
    """

    def __call__(
        self,
        request: SeedRequest,
        write: SeedWriter,
        progress: SeedProgress,
        *,
        stop: threading.Event | None = ...,
        sink: SnapshotSink | None = ...,
    ) -> int: ...


def seeder_for(kind: str) -> Seeder:
    """The seeder of a source kind: ``postgres`` or ``mysql``."""
    if kind == "postgres":
        return seed_postgres
    if kind == "mysql":
        return seed_mysql
    raise ConfigError(f"seed.kind must be postgres or mysql, not {kind!r}")
