"""The replication stream read straight from the connection's socket.

libpq hands over one CopyData message per ``PQgetCopyData`` call: a system
call now and then, a ``malloc`` and a copy per message, and a Python object
around it. :class:`CopyBothSocket` instead reads ~1 MiB at a time with
``os.read`` and splits the backend's protocol messages itself (type byte,
int32 length counting itself, payload); the CopyData payloads are handed on
as ``(chunk, start, end)`` spans of one ``bytes`` chunk, without a copy: the
batch shape of the stream's reader protocol (:mod:`._readers`), which this
class implements (``read``, ``wait``, ``send_copy_data``).

The reads and writes go through libc's ``read``/``write`` called with the
GIL held (``ctypes.PyDLL``), not ``os.read``: the socket is non-blocking, so
they never wait, and a call that let the GIL go would cost the stream thread
a wait to win it back from the relay's busy threads (up to a switch
interval), far more than the read itself. psycopg's C ``PQconsumeInput``
does not let it go either. A message larger than one read is read with
``os.read``.

It starts the stream itself: :meth:`CopyBothSocket.start` writes the
``START_REPLICATION`` query on the socket of an idle connection and reads
the answer up to the CopyBothResponse. libpq never reads from this socket
again, so no byte of the stream can be left behind in libpq's input buffer
(libpq reads ahead: after it had seen the CopyBothResponse, part of a
CopyData message could sit in its buffer with no API to take it out). The
connection must be closed afterwards, never used through libpq again (its
``close`` still sends Terminate, which the walsender understands in COPY
mode).

Only for connections without TLS or GSS encryption: the bytes on the socket
are then the protocol itself.

Backend messages handled while streaming: ``d`` CopyData (handed on),
``E`` ErrorResponse (raised as :class:`ServerError` after the messages before
it were handed on), ``c`` CopyDone (:class:`ServerError` too: the server
ended the stream), ``N`` NoticeResponse (logged), ``S`` ParameterStatus and
``A`` NotificationResponse (ignored). Any other type is a protocol error.

Thread-safety: none; one thread (the fetcher's stream thread) owns it.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import select
import struct

__all__ = ["CopyBothSocket", "ServerError", "wait_fd"]

log = logging.getLogger("changebus.fetchers.postgres")


def wait_fd(fd: int, timeout_s: float, *, write: bool = False) -> bool:
    """Wait until ``fd`` is readable (or writable); False after ``timeout_s``.

    ``poll``, not ``select``: a relay serving a thousand consumers has
    descriptors past 1023, which ``select`` refuses (``ValueError``).
    """
    poller = select.poll()
    poller.register(fd, select.POLLOUT if write else select.POLLIN)
    return bool(poller.poll(max(0, int(timeout_s * 1000))))


_HEAD = struct.Struct(">BI").unpack_from
_LEN = struct.Struct(">I")
_D, _E, _C, _N, _S, _A, _W, _Z = b"dEcNSAWZ"
_IGNORED = frozenset(b"SA")
#: the largest single read (a message larger than this takes several)
_MAX_READ = 64 << 20
_AGAIN = frozenset((errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR))

# libc's read and write, called without letting the GIL go (see the module docstring)
_libc = ctypes.PyDLL(None, use_errno=True)
_read = _libc.read
_read.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t)
_read.restype = ctypes.c_ssize_t
_write = _libc.write
_write.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t)
_write.restype = ctypes.c_ssize_t


class ServerError(Exception):
    """An ErrorResponse (or the end of the stream) from the server.

    ``fields`` maps the ErrorResponse's one-letter field codes to their text
    (``S`` severity, ``C`` SQLSTATE, ``M`` message, ...).
    """

    def __init__(self, fields: dict[str, str]) -> None:
        self.fields = fields
        super().__init__(self.text)

    @property
    def sqlstate(self) -> str:
        return self.fields.get("C", "")

    @property
    def message(self) -> str:
        return self.fields.get("M", "")

    @property
    def text(self) -> str:
        """The way libpq words it: ``FATAL:  terminating connection ...``."""
        severity = self.fields.get("S", "")
        return f"{severity}:  {self.message}" if severity else self.message


def parse_fields(payload: bytes | memoryview) -> dict[str, str]:
    """The fields of an ErrorResponse or NoticeResponse body."""
    fields: dict[str, str] = {}
    data = bytes(payload)
    pos = 0
    while pos < len(data) and data[pos] != 0:
        end = data.find(b"\x00", pos + 1)
        if end < 0:
            end = len(data)
        fields[chr(data[pos])] = data[pos + 1 : end].decode("utf-8", errors="replace")
        pos = end + 1
    return fields


class CopyBothSocket:
    """Reads a COPY BOTH stream from a socket's file descriptor (see the module docstring).

    Invariant: ``self._buf[self._pos:]`` holds the bytes read but not yet
    handed on: at most one incomplete message once :meth:`read` returned.
    """

    def __init__(self, fd: int, recv_bytes: int = 1 << 20) -> None:
        if recv_bytes < 1:
            raise ValueError("recv_bytes must be positive")
        self.fd = fd
        self.recv_bytes = recv_bytes
        #: the read target; each read's bytes are copied out once (into the chunk)
        self._rbuf = bytearray(recv_bytes)
        self._rview = memoryview(self._rbuf)
        self._rptr = ctypes.addressof((ctypes.c_char * recv_bytes).from_buffer(self._rbuf))
        self._buf = b""
        self._pos = 0
        #: the pieces of a message longer than one read, joined once it is whole
        #: (appended to ``_buf`` each time, a big value cost what it had read so far
        #: per read: minutes and the GIL for a value of a GB); ``_need``: its size
        self._pieces: list[bytes] = []
        self._have = self._need = 0
        self._error: ServerError | None = None
        self.bytes_read = 0
        self.reads = 0

    # ---- start ---------------------------------------------------------------

    def start(self, command: str, timeout_s: float = 60.0) -> None:
        """Send ``command`` (START_REPLICATION) as a simple Query; wait for COPY BOTH.

        Raises :class:`ServerError` for the server's ErrorResponse,
        :class:`ConnectionError` when the connection ends, ``TimeoutError``.
        """
        body = command.encode() + b"\x00"
        self.send(b"Q" + _LEN.pack(len(body) + 4) + body)
        error: ServerError | None = None
        while True:
            kind, start, end = self._next_raw(timeout_s)
            if kind == _W:
                return
            if kind == _E:
                error = ServerError(parse_fields(self._buf[start:end]))
            elif kind == _Z:  # ReadyForQuery after an error
                raise error if error is not None else ServerError({"M": "no COPY BOTH mode"})
            elif kind == _N:
                self._notice(start, end)
            elif kind not in _IGNORED:
                raise ConnectionError(f"unexpected message {chr(kind)!r} before COPY BOTH")

    def _next_raw(self, timeout_s: float) -> tuple[int, int, int]:
        """The next whole message of any type: (type, payload start, payload end)."""
        while True:
            avail = len(self._buf) - self._pos
            if avail >= 5:
                kind, length = _HEAD(self._buf, self._pos)
                if avail >= length + 1:
                    start = self._pos + 5
                    self._pos += length + 1
                    return kind, start, self._pos
            if not self.fill() and not self.wait(timeout_s):
                raise TimeoutError("the server did not answer START_REPLICATION")

    # ---- streaming -------------------------------------------------------------

    def read(self) -> list[tuple[bytes, int, int]]:
        """The CopyData payloads that are complete now, without waiting.

        Returns ``(chunk, start, end)`` of each payload (one chunk for all of
        them); the list is empty when nothing complete is there (then
        :meth:`wait`). Reads the socket (once) only when no whole message is
        buffered. Raises the :class:`ServerError` that ended the stream once
        the messages before it were handed on, :class:`ConnectionError` when
        the server closed the connection.
        """
        spans = self._split()
        if not spans and self._error is None and self.fill():
            spans = self._split()
        if not spans and self._error is not None:
            raise self._error
        return spans

    def _split(self) -> list[tuple[bytes, int, int]]:
        buf = self._buf
        pos = self._pos
        size = len(buf)
        spans: list[tuple[bytes, int, int]] = []
        append = spans.append
        head = _HEAD
        while pos + 5 <= size and self._error is None:
            kind, length = head(buf, pos)
            end = pos + 1 + length
            if end > size:
                break
            if kind == _D:
                append((buf, pos + 5, end))
            elif kind == _E:
                self._error = ServerError(parse_fields(buf[pos + 5 : end]))
            elif kind == _C:
                self._error = ServerError({"M": "the server ended the replication stream"})
            elif kind == _N:
                self._notice(pos + 5, end)
            elif kind not in _IGNORED:
                self._error = ServerError(
                    {"M": f"unexpected message {chr(kind)!r} in the replication stream"}
                )
            pos = end
        self._pos = pos
        return spans

    def fill(self) -> bool:
        """One non-blocking read; False when the socket had nothing."""
        if self._pieces:
            return self._fill_pieces()
        rest = len(self._buf) - self._pos
        want = self.recv_bytes
        need = 0
        if rest >= 5:  # a message larger than one read: ask for all of it at once
            need = _HEAD(self._buf, self._pos)[1] + 1
            want = min(max(want, need - rest), _MAX_READ)
        data: bytes | memoryview
        if want > self.recv_bytes:
            try:
                data = os.read(self.fd, want)
            except (BlockingIOError, InterruptedError):
                return False
            n = len(data)
        else:
            n = _read(self.fd, self._rptr, want)
            if n < 0:
                err = ctypes.get_errno()
                if err in _AGAIN:
                    return False
                if err == errno.ECONNRESET:
                    raise ConnectionError("the server closed the connection")
                raise OSError(err, os.strerror(err))
            data = self._rview[:n]
        if not n:
            raise ConnectionError("the server closed the connection")
        self.reads += 1
        self.bytes_read += n
        if rest and rest + n < need:  # still not whole: collect its pieces
            self._pieces = [self._buf[self._pos :], bytes(data)]
            self._have, self._need = rest + n, need
            self._buf, self._pos = b"", 0
            return True
        self._buf = self._buf[self._pos :] + data if rest else bytes(data)
        self._pos = 0
        return True

    def _fill_pieces(self) -> bool:
        """A read of the rest of a message being collected; joined when it is whole."""
        try:
            data = os.read(self.fd, min(self._need - self._have, _MAX_READ))
        except (BlockingIOError, InterruptedError):
            return False
        if not data:
            raise ConnectionError("the server closed the connection")
        self.reads += 1
        self.bytes_read += len(data)
        self._pieces.append(data)
        self._have += len(data)
        if self._have >= self._need:
            self._buf, self._pos = b"".join(self._pieces), 0
            self._pieces, self._have, self._need = [], 0, 0
        return True

    def wait(self, timeout_s: float) -> bool:
        """Wait until the socket is readable; False after ``timeout_s``."""
        return wait_fd(self.fd, timeout_s)

    def send_copy_data(self, payload: bytes) -> None:
        """Send one CopyData message (a standby status update)."""
        self.send(b"d" + _LEN.pack(len(payload) + 4) + payload)

    def send(self, data: bytes) -> None:
        """Write all of ``data`` on the non-blocking socket (waits while it is full)."""
        while data:
            n = _write(self.fd, data, len(data))
            if n < 0:
                err = ctypes.get_errno()
                if err in _AGAIN:
                    wait_fd(self.fd, 1.0, write=True)
                    continue
                if err in (errno.EPIPE, errno.ECONNRESET):
                    raise ConnectionError("the server closed the connection")
                raise OSError(err, os.strerror(err))
            data = data[n:]

    def _notice(self, start: int, end: int) -> None:
        fields = parse_fields(self._buf[start:end])
        log.info("postgres notice: %s", fields.get("M", ""))
