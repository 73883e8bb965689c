"""Opening a buffer's files: whether what is on disk may be recovered, or the buffer starts empty.

One job: find the last published state of a buffer directory
(:class:`~._meta.MetaFile`) and decide, before anything is mapped with
truncation, whether the files on disk are this buffer's:

* no files yet (a new partition), or a ``meta.dat`` of zeros only (a start
  that failed before it published its first state, such as a full disk at
  reserving the ring): the buffer starts empty, quietly;
* ``meta.dat`` present but with no intact slot, or ``ring.dat`` not of the
  published capacity: the files are damaged beyond what recovery repairs. The
  buffer starts empty (its ring, event table and index are reset) and says so
  in an error, with what consumers see: those behind the relay's restart point
  are sent to the bootstrap server once the fetcher declares where it starts;
* the published sizes (``capacity_bytes``, ``event_slots``, the SCN index's
  entries from ``block_bytes``) differ from the configuration: a changed size
  or a typo. Starting empty would throw away every buffered window at once,
  with no way back, so the start is refused (:class:`ConfigError` naming the
  old and new sizes) unless resizing was asked for (``resize``: the relay's
  ``--resize-buffers``): then the old files are moved, never deleted, into a
  ``resized-<UTC time>`` subdirectory of the buffer's, and the buffer starts
  empty (docs/operations.md). ``meta.dat`` moves last: a resize interrupted
  half way leaves the old state next to what is left of the old files, and a
  subdirectory without it; the next start is refused unless it is a resize
  again, which finishes the move into that subdirectory (a new buffer was
  created over the old files, which ``meta.dat`` had left first: review).
  Those subdirectories are never removed by the relay: a full disk at start
  names them (:func:`with_resized_hint`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

from changebus.schemas.errors import ConfigError
from changebus.schemas.files import narrow_files, private_dir, private_file

from ._meta import BufferMeta, MetaFile

__all__ = ["FILES", "open_meta", "with_resized_hint"]

log = logging.getLogger("changebus.relay.buffer")

#: the buffer's files, created mode 0600 before they are mapped (a side file added
#: later must be created through :func:`changebus.schemas.files.private_file` too)
FILES = ("meta.dat", "ring.dat", "events.dat", "index.dat")
#: what a resize moves aside: the files above and the synced watermark; meta.dat last
#: (a directory without it is a move that did not finish)
_MOVED = ("ring.dat", "events.dat", "index.dat", "synced.dat", "meta.dat")


def open_meta(
    directory: Path,
    sizes: tuple[int, int, int],
    name: str,
    *,
    resize: bool = False,
) -> tuple[MetaFile, BufferMeta | None]:
    """The buffer's meta file, and its last published state when the files are to be
    recovered (None: the buffer starts empty, its files are created anew).

    ``sizes``: ``(capacity, event slots, index slots)`` of the configuration.
    Raises :class:`ConfigError` when the files hold a buffer of other sizes and
    ``resize`` is not set (module docstring).
    """
    private_dir(directory)  # row data: the owner's only (0700 / 0600)
    meta_path = directory / "meta.dat"
    unfinished = _unfinished(directory)
    if unfinished is not None:
        if not resize:
            raise ConfigError(
                f"buffer {name!r} ({directory}): a start with --resize-buffers was"
                f" interrupted while it moved the old files to {unfinished}; start with"
                " --resize-buffers again to finish it (the buffer starts empty), or move"
                f" the files in {unfinished} back and delete it to keep the old buffer"
            )
        _move_aside(directory, unfinished)
        log.warning(
            "buffer %s: finished an interrupted resize: starting empty; the old files are"
            " in %s (delete it when no longer needed)",
            name,
            unfinished,
        )
        for file in FILES:
            private_file(directory / file)
        return MetaFile(meta_path), None
    # (zeros only: created by a start that failed before it published a state)
    had = meta_path.exists() and bool(meta_path.read_bytes().strip(b"\0"))
    for file in FILES:
        private_file(directory / file)
    narrow_files(directory)  # the registry and any side file, also from older versions
    metafile = MetaFile(meta_path)
    previous = None if metafile.created else metafile.load()
    if previous is None:
        if had:
            log.error(
                "buffer %s: %s holds no intact state (damaged): starting empty, its ring,"
                " event table and index are reset and the windows they held are not served;"
                " consumers behind the source position the fetcher starts from are sent to"
                " the bootstrap server",
                name,
                meta_path,
            )
        return metafile, None
    old = (previous.capacity, previous.event_slots, previous.index_slots)
    if old != sizes:
        if not resize:
            metafile.close()
            raise ConfigError(
                f"buffer {name!r} ({directory}): its files hold a buffer of"
                f" capacity_bytes={old[0]}, event_slots={old[1]} ({old[2]} SCN index"
                f" entries), the configuration says capacity_bytes={sizes[0]},"
                f" event_slots={sizes[1]} ({sizes[2]} SCN index entries, from block_bytes):"
                " a buffer of other sizes starts empty. Restore the old sizes to keep its"
                " windows, or start once with --resize-buffers (resize_buffers = true) to"
                " start it empty: the old files are moved to a resized-<time> subdirectory"
                " (docs/operations.md)"
            )
        metafile.close()
        aside = _move_aside(directory)
        log.warning(
            "buffer %s: resized from capacity_bytes=%d, event_slots=%d to capacity_bytes=%d,"
            " event_slots=%d: starting empty; the old files are in %s (delete it when no"
            " longer needed)",
            name,
            old[0],
            old[1],
            sizes[0],
            sizes[1],
            aside,
        )
        for file in FILES:
            private_file(directory / file)
        return MetaFile(meta_path), None
    ring = directory / "ring.dat"
    if ring.stat().st_size != previous.capacity:
        log.error(
            "buffer %s: %s has %d bytes, not the %d its state names (damaged or replaced):"
            " starting empty, its event table and index are reset too",
            name,
            ring,
            ring.stat().st_size,
            previous.capacity,
        )
        return metafile, None
    return metafile, previous


def _move_aside(directory: Path, aside: Path | None = None) -> Path:
    """Move the buffer's files into a new ``resized-<UTC time>`` subdirectory (or into
    ``aside``, a move that did not finish: only the names not there yet); its path."""
    if aside is None:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        aside = directory / f"resized-{stamp}"
        n = 1
        while aside.exists():
            n += 1
            aside = directory / f"resized-{stamp}-{n}"
        private_dir(aside)
    for file in _MOVED:
        if file == "meta.dat":
            _fsync_dir(directory)  # the other renames are durable first
        if (directory / file).exists() and not (aside / file).exists():
            os.rename(directory / file, aside / file)
    _fsync_dir(directory)  # the renames are durable before new files take the names
    return aside


def _unfinished(directory: Path) -> Path | None:
    """A ``resized-*`` subdirectory holding some of the moved files but no ``meta.dat``."""
    for aside in sorted(directory.glob("resized-*"), reverse=True):
        moved = [f for f in _MOVED if (aside / f).exists()]
        if moved and "meta.dat" not in moved:
            return aside
    return None


def _fsync_dir(directory: Path) -> None:
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


@contextlib.contextmanager
def with_resized_hint(directory: Path) -> Iterator[None]:
    """Re-raise a full disk (``ENOSPC``) in the block, when ``directory`` has ``resized-*``
    subdirectories, as an :class:`OSError` that names them too."""
    try:
        yield
    except OSError as exc:
        aside = sorted(str(p) for p in directory.glob("resized-*") if p.is_dir())
        if exc.errno != errno.ENOSPC or not aside:
            raise
        raise OSError(
            errno.ENOSPC,
            f"{exc.strerror}; old buffer files moved aside by --resize-buffers take disk"
            f" space in {', '.join(aside)} (delete them when no longer needed)",
            exc.filename,
        ) from exc
