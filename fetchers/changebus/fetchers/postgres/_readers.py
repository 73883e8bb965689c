"""The two readers of the replication stream, behind one small protocol.

The stream loop (:func:`._stream.stream`) asks a :class:`CopyDataReader`
for the CopyData messages that are complete now: one call per *read* of a
batch of messages, never one per message. Each message comes as
``(buffer, start, end)``: its payload is ``buffer[start:end]`` (``end`` < 0:
to the end of ``buffer``), so neither reader copies a message to hand it on.
With none complete, the loop does its idle work and waits
(:meth:`~CopyDataReader.wait`); standby status updates go back through
:meth:`~CopyDataReader.send_copy_data`.

* :class:`LibpqReader` (``stream_reader = "libpq"``): libpq's
  ``PQgetCopyData``, one message (one buffer) per call; works on every
  connection, TLS and GSS included.
* :class:`~._wire.CopyBothSocket` (``"socket"``): the connection's socket
  itself, ~1 MiB per read, messages as spans of the chunk; only on a
  connection without TLS or GSS encryption.

``"auto"`` takes the socket when it can. :func:`start_reader` sends
``START_REPLICATION`` and returns the reader. The end of the stream is a
:class:`SourceError` (libpq) or a :class:`~._wire.ServerError` (socket),
which the stream loop words the same way; a lost connection a
``psycopg.OperationalError`` (libpq) or an ``OSError`` (socket), both
"lost the Postgres connection" in the end.

Thread-safety: none; a reader belongs to the fetcher's stream thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from changebus.schemas import SourceConfigError, SourceError

from ._config import PostgresConfig
from ._setup import reason
from ._wire import CopyBothSocket, ServerError, wait_fd

__all__ = ["Batch", "CopyDataReader", "LibpqReader", "reader_kind", "start_reader"]

#: CopyData payloads complete now: ``(buffer, start, end)`` each (``end`` < 0: to the end)
Batch = Sequence[tuple[bytes | memoryview, int, int]]

#: message bytes the libpq reader hands on per batch at most (the socket reader's
#: default read size: the loop's per-batch duties run about as often with either)
_LIBPQ_BATCH_BYTES = 1 << 20


class CopyDataReader(Protocol):
    """How the stream loop reads the replication stream and answers it."""

    def read(self) -> Batch:
        """The messages complete now, without waiting (empty: none; then :meth:`wait`)."""
        ...

    def wait(self, timeout_s: float) -> bool:
        """Wait until the server sent more; False after ``timeout_s``."""
        ...

    def send_copy_data(self, payload: bytes) -> None:
        """Send one CopyData message to the server (a standby status update)."""
        ...


class LibpqReader:
    """The stream through libpq's ``PQgetCopyData`` (see the module docstring).

    A batch is what libpq holds already, without a wait (up to
    ``_LIBPQ_BATCH_BYTES``): when its buffer is empty, one
    ``PQconsumeInput`` takes what the socket holds (a wait would let go of
    the GIL, and winning it back from busy relay threads takes long). The
    messages before the end of the stream are handed on first; the next
    :meth:`read` raises.
    """

    def __init__(self, pgconn: Any) -> None:
        self._pgconn = pgconn
        self._sock = pgconn.socket
        self._ended: str | None = None

    def read(self) -> Batch:
        if self._ended is not None:
            raise SourceError(f"replication stream ended: {self._ended}")
        pgconn = self._pgconn
        get = pgconn.get_copy_data
        nbytes, data = get(1)
        if nbytes == 0:
            # what the socket holds already, without a wait (see the class docstring)
            pgconn.consume_input()
            nbytes, data = get(1)
        batch: list[tuple[bytes | memoryview, int, int]] = []
        append = batch.append
        size = 0
        while nbytes > 0:
            append((data, 0, -1))
            size += nbytes
            if size >= _LIBPQ_BATCH_BYTES:
                return batch
            nbytes, data = get(1)
        if nbytes < 0:
            self._ended = pgconn.get_error_message().decode(errors="replace").strip()
            if not batch:
                raise SourceError(f"replication stream ended: {self._ended}")
        return batch

    def wait(self, timeout_s: float) -> bool:
        ready = wait_fd(self._sock, timeout_s)
        if ready:
            self._pgconn.consume_input()
        return ready

    def send_copy_data(self, payload: bytes) -> None:
        self._pgconn.put_copy_data(payload)
        self._pgconn.flush()


def reader_kind(cfg: PostgresConfig, pgconn: Any) -> str:
    """The reader option ``stream_reader`` picks for this connection: "socket" or "libpq"."""
    plain = not pgconn.ssl_in_use and not pgconn.used_gssapi
    if cfg.stream_reader == "socket" and not plain:
        raise SourceConfigError(
            "fetcher option stream_reader = 'socket' needs a connection without "
            "TLS or GSS encryption; use 'auto' or 'libpq'"
        )
    return "socket" if cfg.stream_reader != "libpq" and plain else "libpq"


def start_reader(kind: str, repl: Any, cfg: PostgresConfig, command: str) -> CopyDataReader:
    """Send ``command`` (START_REPLICATION) on the replication connection ``repl``;
    returns the reader of the stream (``kind`` from :func:`reader_kind`)."""
    if kind == "socket":
        wire = CopyBothSocket(repl.pgconn.socket, cfg.socket_read_bytes)
        try:
            wire.start(command)
        except ServerError as exc:
            if exc.sqlstate == "55006":  # object_in_use
                raise SourceError(
                    f"slot {cfg.slot!r} is in use by another process: {exc.message}"
                ) from None
            raise SourceError(f"START_REPLICATION failed: {exc.message}") from None
        except (OSError, TimeoutError) as exc:
            raise SourceError(f"lost the Postgres connection: {exc}") from None
        return wire
    import psycopg

    try:
        repl.execute(command)
    except psycopg.errors.ObjectInUse as exc:
        raise SourceError(
            f"slot {cfg.slot!r} is in use by another process: {exc.diag.message_primary}"
        ) from None
    except psycopg.Error as exc:
        raise SourceError(f"START_REPLICATION failed: {reason(exc)}") from None
    return LibpqReader(repl.pgconn)
