"""Fenced unit checkpoints of consumer groups in files (one host).

Layout: ``<directory>/<group>/<unit>.json`` per unit, each a JSON object
``{"checkpoint": <PartitionCheckpoint dict or null>, "owner": "...",
"generation": g, "updated_ns": t}`` (the same record as ZooKeeper's
``checkpoints/<unit>`` znode). Files are mode 0600, directories made here
0700, every write an atomic replace with fsync
(:func:`~._persist.write_atomically`, as the file checkpoint persister).

Fencing: the token is the generation. Every claim and commit reads, compares
and writes under an exclusive ``fcntl.flock`` on ``<directory>/<group>/.lock``,
so claims and commits of all processes (and threads) of the host on one
group are serialised: two claimers never get the same generation and a
commit with an older token writes nothing. The record also keeps the
highest claim fence (``"fence"``, absent in files of older versions: -1); a
claim with a lower one is refused. Reads take no lock (a reader sees
the old or the new file). The directory must be on a local file system
(flock over NFS is not to be trusted).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from changebus.schemas import (
    CheckpointError,
    CommitResult,
    ConfigError,
    StoredUnit,
    Unit,
    UnitClaim,
    UnitCommit,
    check_group_name,
)
from changebus.schemas.files import open_private, private_dir

from ._persist import write_atomically
from ._unitsql import claim_fenced, parse_checkpoint

__all__ = ["FileUnitStore"]

log = logging.getLogger(__name__)

_SUFFIX = ".json"


class FileUnitStore:
    """A :class:`~changebus.schemas.UnitStore` in a directory (module docstring).

    Thread-safety: any number of instances, threads and processes of one host
    may share the directory; every file operation runs in a worker thread.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)

    def __repr__(self) -> str:
        return f"FileUnitStore({str(self.directory)!r})"

    # ---- UnitStore -----------------------------------------------------------

    async def claim(self, group: str, unit: Unit, owner: str, fence: int = -1) -> UnitClaim:
        """Raise the unit's generation under the group lock; the new generation is the token."""
        return await asyncio.to_thread(self._claim, check_group_name(group), unit, owner, fence)

    async def commit(self, group: str, commits: Sequence[UnitCommit]) -> CommitResult:
        """Write each checkpoint whose token is the stored generation (under the group lock)."""
        if not commits:
            return CommitResult()
        return await asyncio.to_thread(self._commit, check_group_name(group), list(commits))

    async def read(self, group: str) -> dict[Unit, StoredUnit]:
        """Every stored unit of ``group`` (no lock: files are replaced atomically)."""
        return await asyncio.to_thread(self._read, check_group_name(group))

    async def close(self) -> None:
        """Nothing to release (no file stays open between calls)."""
        return None

    # ---- worker threads -------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self, group: str) -> Iterator[Path]:
        folder = self.directory / group
        private_dir(folder)
        fd = open_private(folder / ".lock", os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released by closing the descriptor
            yield folder
        finally:
            os.close(fd)

    def _claim(self, group: str, unit: Unit, owner: str, fence: int = -1) -> UnitClaim:
        with self._locked(group) as folder:
            path = folder / f"{unit}{_SUFFIX}"
            record = _load(path, unit)
            if record is not None and fence < record.fence:
                raise claim_fenced(group, unit, owner, fence, record.fence)
            generation = (record.generation if record is not None else 0) + 1
            checkpoint = record.checkpoint if record is not None else None
            fence = max(fence, record.fence if record is not None else -1)
            _write(path, StoredUnit(unit, checkpoint, owner, generation, time.time_ns(), fence))
        log.debug("group %s: unit %s claimed by %s (generation %d)", group, unit, owner, generation)
        return UnitClaim(unit, checkpoint, token=generation, generation=generation)

    def _commit(self, group: str, commits: list[UnitCommit]) -> CommitResult:
        tokens: dict[Unit, int] = {}
        fenced: set[Unit] = set()
        with self._locked(group) as folder:
            now = time.time_ns()
            for c in commits:
                path = folder / f"{c.unit}{_SUFFIX}"
                record = _load(path, c.unit)
                if record is None or record.generation != c.token:
                    fenced.add(c.unit)
                    tokens.pop(c.unit, None)
                    continue
                _write(
                    path,
                    StoredUnit(c.unit, c.checkpoint, record.owner, c.token, now, record.fence),
                )
                tokens[c.unit] = c.token
        if fenced:
            log.info("group %s: commits of %d unit(s) fenced", group, len(fenced))
        return CommitResult(tokens=tokens, fenced=frozenset(fenced))

    def _read(self, group: str) -> dict[Unit, StoredUnit]:
        folder = self.directory / group
        out: dict[Unit, StoredUnit] = {}
        try:
            names = sorted(os.listdir(folder))
        except FileNotFoundError:
            return out
        for name in names:
            if not name.endswith(_SUFFIX) or name.startswith("."):
                continue
            try:
                unit = Unit.parse(name[: -len(_SUFFIX)])
            except ConfigError:
                continue  # a stray file that names no unit
            record = _load(folder / name, unit)
            if record is not None:
                out[unit] = record
        return out


def _load(path: Path, unit: Unit) -> StoredUnit | None:
    """The record of a unit file (None when missing); CheckpointError when it is corrupt."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    where = f"unit checkpoint file {path}"
    try:
        data: Any = json.loads(text)
        if not isinstance(data, dict):
            raise TypeError("not an object")
        generation = data["generation"]
        updated_ns = data.get("updated_ns", 0)
        owner = data.get("owner", "")
        fence = data.get("fence", -1)
        if not (
            isinstance(generation, int)
            and isinstance(updated_ns, int)
            and isinstance(owner, str)
            and isinstance(fence, int)
            and generation >= 0
        ):
            raise TypeError("bad field types")
    except (ValueError, TypeError, KeyError):
        raise CheckpointError(f"{where} is corrupt") from None
    checkpoint = parse_checkpoint(data.get("checkpoint"), where)
    return StoredUnit(unit, checkpoint, owner, generation, updated_ns, fence)


def _write(path: Path, record: StoredUnit) -> None:
    data = {
        "checkpoint": record.checkpoint.to_dict() if record.checkpoint is not None else None,
        "owner": record.owner,
        "generation": record.generation,
        "updated_ns": record.updated_ns,
        "fence": record.fence,
    }
    write_atomically(path, json.dumps(data, separators=(",", ":"), sort_keys=True) + "\n")
