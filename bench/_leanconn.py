"""A keep-alive HTTP/1.1 GET connection parsed in ``data_received`` (benchmark clients).

:class:`relay_latency.LeanHttp` reads through an ``asyncio.StreamReader``:
four awaits per chunk (size line, body, CRLF, and the task's wake-up). With
a thousand followers in a few processes that costs more CPU than the relay
spends serving them, and the figures end up describing the clients. Here a
protocol parses the bytes in the callback that receives them, so a pushed
chunk costs one ``recv`` and a few slices; a task wakes only when a whole
response has ended.

Parser state (``_state``): ``head`` (until the empty line), ``body`` (a
``Content-Length`` body), ``size`` (a chunk-size line), ``chunk`` (chunk
data and its CRLF), ``trailer`` (the CRLF after the last chunk). ``_buf``
holds bytes received but not yet parsed. Only what the relay and the raw push
server send is understood; anything else raises in the waiting request.
Single-threaded: everything runs on the loop that made the connection.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

__all__ = ["LeanConn"]

Response = tuple[int, dict[str, str], bytes]


class LeanConn(asyncio.Protocol):
    """One connection; :meth:`get` sends a GET and returns its response (module docstring)."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._state = "idle"
        self._need = 0
        self._status = 0
        self._headers: dict[str, str] = {}
        self._parts: list[bytes] = []
        self._on_chunk: Callable[[bytes | memoryview], bool] | None = None
        self._done: asyncio.Future[Response] | None = None
        #: why the connection ended (a later request raises it)
        self._lost: BaseException | None = None

    @property
    def status(self) -> int:
        """The status of the response being read (or the last one)."""
        return self._status

    @classmethod
    async def connect(cls, host: str, port: int, rcvbuf: int = 0) -> LeanConn:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf:  # a small receive window: the server cannot run far ahead
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, (host, port))
        _, conn = await loop.create_connection(lambda: cls(f"{host}:{port}"), sock=sock)
        return conn

    async def get(
        self, target: str, on_chunk: Callable[[bytes | memoryview], bool] | None = None
    ) -> Response:
        """GET ``target``; with ``on_chunk``, chunks go to it (False: stop, close) unkept."""
        assert self.transport is not None
        assert self._done is None
        if self._lost is not None:
            raise self._lost
        self._done = asyncio.get_running_loop().create_future()
        self._on_chunk, self._parts, self._state = on_chunk, [], "head"
        try:
            self.transport.write(f"GET {target} HTTP/1.1\r\nHost: {self.host}\r\n\r\n".encode())
            self._parse()  # bytes that came early
            return await self._done
        finally:
            self._done = None

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    # ---- asyncio.Protocol ----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            if not self._buf and self._state == "size" and self._on_chunk is not None:
                data = self._whole_chunks(data)  # the common case of a follow stream: no copies
                if not data:
                    return
            self._buf += data
            self._parse()
        except Exception as exc:  # noqa: BLE001 - handed to the waiting request
            self._fail(exc)
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = exc or ConnectionResetError("the server closed the connection")
        self._fail(self._lost)

    # ---- parsing ---------------------------------------------------------------------

    def _fail(self, exc: BaseException) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_exception(exc)
        self._state = "idle"

    def _finish(self, body: bytes) -> None:
        self._state = "idle"
        if self._done is not None and not self._done.done():
            self._done.set_result((self._status, self._headers, body))

    def _whole_chunks(self, data: bytes) -> bytes:
        """Hand the whole chunks at the start of ``data`` to ``on_chunk``; the rest back."""
        assert self._on_chunk is not None
        view, pos, end = memoryview(data), 0, len(data)
        while pos < end:
            eol = data.find(b"\r\n", pos)
            if eol < 0:
                break
            size = int(data[pos:eol], 16)
            stop = eol + 2 + size
            if size == 0 or stop + 2 > end:
                break
            pos = stop + 2
            if not self._on_chunk(view[eol + 2 : stop]):
                self._finish(b"")
                self.close()
                return b""
        return data[pos:] if pos else data

    def _parse(self) -> None:
        buf = self._buf
        while buf:
            state = self._state
            if state == "chunk":
                need = self._need
                if len(buf) < need + 2:
                    return
                body = bytes(buf[:need])
                del buf[: need + 2]
                self._state = "size"
                if self._on_chunk is None:
                    self._parts.append(body)
                elif not self._on_chunk(body):
                    self._finish(b"")
                    self.close()
                    return
            elif state == "size":
                end = buf.find(b"\r\n")
                if end < 0:
                    return
                size = int(buf[:end], 16)
                del buf[: end + 2]
                self._state, self._need = ("chunk", size) if size else ("trailer", 0)
            elif state == "trailer":
                if len(buf) < 2:
                    return
                del buf[:2]
                self._finish(b"".join(self._parts))
            elif state == "head":
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
                del buf[: end + 4]
                self._status = int(lines[0].split(" ", 2)[1])
                headers = self._headers = {}
                for line in lines[1:]:
                    k, _, v = line.partition(":")
                    headers[k.strip().lower()] = v.strip()
                if headers.get("content-length", "0") != "0":
                    self._state, self._need = "body", int(headers["content-length"])
                elif headers.get("transfer-encoding") == "chunked":
                    self._state = "size"
                else:
                    self._finish(b"")
            elif state == "body":
                if len(buf) < self._need:
                    return
                body = bytes(buf[: self._need])
                del buf[: self._need]
                self._finish(body)
            else:
                raise RuntimeError(f"{len(buf)} bytes arrived outside a response")
