"""A raw HTTP/1.1 client for fuzzing: writes any bytes, reads whatever comes back.

:func:`exchange` runs one :class:`~_fuzz_values.Request` on a fresh
connection: writes its bytes (with its pauses, then a half-close when asked),
then reads the answers it owes (status line, headers, a body by
``Content-Length``, chunks or until the close; ``HEAD``, 1xx, 204 and 304
without one), or closes abruptly (RST) when it owes none. Everything runs
under one deadline: the hang time plus the case's own wait, pauses and
reading time; past it the case is *hung*. The first 64 KB of every answer's
body is kept (for the reports), and every byte is searched for :data:`SECRET`.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import struct
import time
from dataclasses import dataclass, field

from _fuzz_values import Request

__all__ = ["SECRET", "Outcome", "exchange"]

#: the password in the bootstrap server's seed DSN: must never be seen
SECRET = "fuzz-secret-pw-7f3a"
_STATUS = re.compile(rb"HTTP/1\.[01] ([0-9]{3})")
_KEEP_BODY = 64 * 1024


@dataclass
class Outcome:
    """What one case got back."""

    statuses: list[int] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)  # the first 64 KB of each answer
    closed: bool = False  # the server closed before (another) answer
    cut: bool = False  # an answer's body ended early
    hung: bool = False
    aborted: bool = False  # the fuzzer closed on purpose
    follow_cut: bool = False  # a follow stream read for its time
    connect_error: str = ""
    bad_answer: bytes = b""
    leaked: bool = False
    seconds: float = 0.0


async def _send(writer: asyncio.StreamWriter, req: Request) -> None:
    sent = 0
    for offset, pause in req.pauses:
        writer.write(req.data[sent:offset])
        await writer.drain()
        sent = offset
        await asyncio.sleep(pause)
    writer.write(req.data[sent:])
    await writer.drain()
    if req.half_close and writer.can_write_eof():
        writer.write_eof()


async def _read_body(
    reader: asyncio.StreamReader, headers: dict[bytes, bytes], out: Outcome
) -> None:
    kept = bytearray()

    def keep(chunk: bytes) -> None:
        if len(kept) < _KEEP_BODY:
            kept.extend(chunk[: _KEEP_BODY - len(kept)])
        if SECRET.encode() in chunk:
            out.leaked = True

    try:
        if b"chunked" in headers.get(b"transfer-encoding", b"").lower():
            while True:
                line = await reader.readline()
                if not line.endswith(b"\n"):
                    raise asyncio.IncompleteReadError(line, None)
                size = int(line.split(b";")[0].strip(), 16)
                if size == 0:
                    while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                        pass
                    break
                while size > 0:
                    chunk = await reader.readexactly(min(size, 1 << 18))
                    keep(chunk)
                    size -= len(chunk)
                await reader.readexactly(2)
        elif b"content-length" in headers:
            left = int(headers[b"content-length"])
            while left > 0:
                chunk = await reader.readexactly(min(left, 1 << 18))
                keep(chunk)
                left -= len(chunk)
        else:
            while chunk := await reader.read(1 << 18):
                keep(chunk)
    except (asyncio.IncompleteReadError, OSError, ValueError):
        out.cut = True
    finally:
        out.bodies.append(bytes(kept))


async def _read_answer(
    reader: asyncio.StreamReader, method: str, read_for: float | None, out: Outcome
) -> bool:
    """Read one answer into ``out``; False when no further answer can follow."""
    while True:
        line = await reader.readline()
        if not line:
            out.closed = True
            return False
        m = _STATUS.match(line)
        if m is None:
            out.bad_answer = line[:200]
            return False
        status = int(m[1])
        headers: dict[bytes, bytes] = {}
        while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
            k, _sep, v = h.partition(b":")
            headers[k.strip().lower()] = v.strip()
        if not 100 <= status < 200 or status == 101:
            break
    out.statuses.append(status)
    if method == "HEAD" or status in (101, 204, 304):
        out.bodies.append(b"")
    elif read_for is not None and status == 200:
        try:
            await asyncio.wait_for(_read_body(reader, headers, out), read_for)
        except TimeoutError:
            out.follow_cut = True
            out.bodies.append(b"")
            return False
    else:
        await _read_body(reader, headers, out)
    if out.cut or status == 101:
        return False
    return headers.get(b"connection", b"").lower() != b"close"


def _rst(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


async def exchange(port: int, req: Request, hang_s: float) -> Outcome:
    """Run one case on a fresh connection to ``port``."""
    out = Outcome()
    t0 = time.monotonic()
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", port, limit=1 << 22), hang_s
        )
    except (OSError, TimeoutError) as exc:
        out.connect_error = type(exc).__name__
        return out
    budget = hang_s + req.wait_s + sum(p for _o, p in req.pauses) + (req.read_for_s or 0)
    try:
        async with asyncio.timeout(budget + req.abort_after_s):
            with contextlib.suppress(OSError):  # ConnectionError, ENOTCONN at the half-close
                await _send(writer, req)  # a server may answer and close before all is sent
            if not req.expect_answer:
                await asyncio.sleep(req.abort_after_s)
                out.aborted = True
                _rst(writer)
            else:
                for method in req.methods or ("GET",):
                    if not await _read_answer(reader, method, req.read_for_s, out):
                        break
    except TimeoutError:
        out.hung = True
    except (OSError, ValueError) as exc:  # reset, or an over-long answer line
        out.closed = True
        out.bad_answer = out.bad_answer or type(exc).__name__.encode()
    finally:
        writer.transport.abort()
    out.seconds = time.monotonic() - t0
    return out
