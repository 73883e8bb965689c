"""Where a consumer keeps its checkpoint between runs.

:class:`CheckpointPersister` is the protocol: ``load()`` returns the stored
checkpoint (None when there is none) and ``store()`` replaces it. The
consumer calls ``store`` after it has processed a window (at-least-once: a
crash between processing and ``store`` replays that window) and ``load``
once, on start.

* :class:`FileCheckpointPersister` -- a JSON file, replaced atomically:
  write ``<name>.tmp``, fsync it, ``os.replace`` over the file, fsync the
  directory. A reader sees the old or the new checkpoint, never a torn one.
  Both files are mode 0600 whatever the umask (a directory it creates 0700).
  File work runs in a worker thread (never on the event loop).
* :class:`MemoryCheckpointPersister` -- in memory (tests, throwaway readers).

To store the checkpoint in the application's own database transaction
(effectively-once processing), implement the protocol over that database, as
the replica helpers (:mod:`._apply`) do.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from pathlib import Path
from typing import Protocol, runtime_checkable

from changebus.schemas import Checkpoint, CheckpointError
from changebus.schemas.files import open_private, private_dir

__all__ = ["CheckpointPersister", "FileCheckpointPersister", "MemoryCheckpointPersister"]

log = logging.getLogger(__name__)


@runtime_checkable
class CheckpointPersister(Protocol):
    """Loads and stores a consumer's :class:`~changebus.schemas.Checkpoint`."""

    async def load(self) -> Checkpoint | None:
        """The stored checkpoint, or None when nothing was stored yet."""
        ...

    async def store(self, checkpoint: Checkpoint) -> None:
        """Durably replace the stored checkpoint; returns once it is safe."""
        ...


class MemoryCheckpointPersister:
    """Keeps the checkpoint in memory (lost with the process).

    ``stored`` counts calls to :meth:`store`. Used from one event loop.
    """

    def __init__(self, checkpoint: Checkpoint | None = None) -> None:
        self.checkpoint = checkpoint
        self.stored = 0

    async def load(self) -> Checkpoint | None:
        """The checkpoint held, if any."""
        return self.checkpoint

    async def store(self, checkpoint: Checkpoint) -> None:
        """Hold ``checkpoint``."""
        self.checkpoint = checkpoint
        self.stored += 1


class FileCheckpointPersister:
    """A checkpoint file (compact JSON) replaced atomically on every store.

    Thread-safety: the file is written by one consumer; :meth:`store` calls
    of one instance are serialised by a lock taken in the writing thread, so
    a write whose awaiting task was cancelled (it goes on in its thread)
    still finishes before the next one starts, and the newer checkpoint is
    the one that stays.
    A corrupt file raises :class:`~changebus.schemas.CheckpointError` on
    :meth:`load` rather than silently restarting from the beginning.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    async def load(self) -> Checkpoint | None:
        """Read and parse the file (None when it does not exist)."""
        return await asyncio.to_thread(self.load_sync)

    def load_sync(self) -> Checkpoint | None:
        """Blocking form of :meth:`load` (for threads and the command line)."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        try:
            return Checkpoint.parse(text)
        except CheckpointError as exc:
            raise CheckpointError(f"checkpoint file {self.path}: {exc.message}") from None

    async def store(self, checkpoint: Checkpoint) -> None:
        """Write the checkpoint atomically (temp file, fsync, rename, fsync dir)."""
        text = checkpoint.to_json() + "\n"
        await asyncio.to_thread(self._write, text)

    def _write(self, text: str) -> None:
        with self._lock:
            self._write_locked(text)

    def _write_locked(self, text: str) -> None:
        write_atomically(self.path, text)
        log.debug("checkpoint stored in %s", self.path)


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` by a file holding ``text``, atomically and durably (blocking).

    Writes ``<name>.tmp`` (mode 0600), fsyncs it, renames it over ``path`` and
    fsyncs the directory (created 0700 when missing; an existing one is left
    as it is). A reader sees the old or the new content, never a torn one.
    Callers serialise writes of one ``path`` (the temporary name is fixed).
    """
    directory = path.parent
    private_dir(directory, narrow=False)
    tmp = path.with_name(path.name + ".tmp")
    fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        data = text.encode()
        done = 0
        while done < len(data):
            done += os.write(fd, data[done:])
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
