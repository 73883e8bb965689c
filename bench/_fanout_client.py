"""The consumer processes of ``bench/relay_fanout.py`` (and its raw push baseline).

Each process runs ``tasks`` consumers as asyncio tasks, each on its own
keep-alive HTTP/1.1 connection (:class:`_leanconn.LeanConn`, parsed in its
protocol's callback), in one of
three modes: ``longpoll`` (a request per response), ``follow`` (one held
request, a chunk per push) and ``raw`` (the raw push server, which answers
any request with a chunked stream, so it is read like ``follow``).

Every consumer receives every byte on its own socket. Parsing is shared in a
process: chunks are identified by their length and first and last event
headers (the relay's shared responses are byte-identical), parsed once with
:func:`~changebus.schemas.parse_stream` for their END_OF_WINDOW timestamps,
and each consumer notes (receipt time, chunk) pairs; latencies are computed
after the measured interval, so the client processes do little per receipt.

Receipts are counted only within ``[record_from, record_to]`` (wall clock,
the same interval in every process); request loops end at ``record_to`` and
after at most :data:`MAX_REQUESTS` requests per consumer.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from _leanconn import LeanConn
from changebus.schemas import Op, parse_stream

__all__ = ["BINS", "BIN_MS", "ConsumerFigures", "consumer_proc", "idle_proc", "percentile"]

#: latency histogram: bins of 0.05 ms up to 5 s (the last bin takes everything above)
BIN_MS = 0.05
BINS = 100_000
#: an upper bound on the requests (long-poll) or re-requests (follow) of one consumer
MAX_REQUESTS = 1_000_000
_EOW = int(Op.END_OF_WINDOW)


@dataclass
class ConsumerFigures:
    """What one consumer saw within the measured interval."""

    windows: int = 0
    max_ms: float = 0.0
    last_scn: int = -1
    errors: int = 0
    error: str = ""
    #: when the consumer's first answer (from=latest, or the raw stream's head) arrived
    ready_at: float = 0.0
    receipts: list[tuple[int, int]] = field(default_factory=list)


class Chunks:
    """Chunks parsed once per process, by identity (module docstring)."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, bytes, bytes], int] = {}
        self.timestamps: list[npt.NDArray[np.int64]] = []
        self.last_scn: list[int] = []

    def id_of(self, body: bytes | memoryview) -> int:
        key = (len(body), bytes(body[:64]), bytes(body[-64:]))
        found = self._ids.get(key)
        if found is None:
            _, hdr = parse_stream(bytes(body), verify_payload=False)
            eow = hdr["op"] == _EOW
            found = self._ids[key] = len(self.timestamps)
            self.timestamps.append(hdr["timestamp_ns"][eow].astype(np.int64))
            self.last_scn.append(int(hdr["scn"][-1]) if len(hdr) else -1)
        return found

    def __len__(self) -> int:
        return len(self.timestamps)


async def _follow(
    http: LeanConn,
    target: str,
    fig: ConsumerFigures,
    chunks: Chunks,
    window: tuple[float, float],
) -> None:
    """Read one chunked follow response (or the raw push stream) until ``window`` ends."""
    record_from, record_to = window

    def on_chunk(body: bytes | memoryview) -> bool:
        if http.status != 200:
            return False  # (an error's body: the status is reported below)
        now = time.time()
        cid = chunks.id_of(body)
        fig.last_scn = chunks.last_scn[cid]
        if record_from <= now < record_to:
            fig.receipts.append((time.time_ns(), cid))
        fig.ready_at = fig.ready_at or now
        return now < record_to

    status, _, _ = await http.get(target, on_chunk)
    if status != 200:
        raise RuntimeError(f"follow request answered {status}")


async def _consume(
    port: int,
    mode: str,
    partition: str,
    client: str,
    fig: ConsumerFigures,
    chunks: Chunks,
    window: tuple[float, float],
) -> None:
    record_to = window[1]
    http = await LeanConn.connect("127.0.0.1", port, 64 * 1024 if mode == "follow" else 0)
    try:
        if mode == "raw":
            await _follow(http, "/raw", fig, chunks, window)
            return
        base = f"/v1/stream?partition={partition}&client={client}"
        _, headers, _ = await http.get(f"{base}&from=latest")
        fig.ready_at = time.time()
        scn, offset = int(headers["x-changebus-next-scn"]), int(headers["x-changebus-next-offset"])
        for _ in range(MAX_REQUESTS):
            if time.time() >= record_to:
                return
            if mode == "follow":
                await _follow(http, f"{base}&scn={scn}&follow=1&wait=5", fig, chunks, window)
                scn, offset = max(fig.last_scn, scn), -1
                continue
            status, headers, body = await http.get(f"{base}&scn={scn}&offset={offset}&wait=5")
            if status == 204:
                continue
            if status != 200:
                raise RuntimeError(f"long-poll answered {status}")
            now = time.time()
            scn = int(headers["x-changebus-next-scn"])
            offset = int(headers["x-changebus-next-offset"])
            cid = chunks.id_of(body)
            if window[0] <= now < record_to:
                fig.receipts.append((time.time_ns(), cid))
    finally:
        http.close()


def consumer_proc(
    port: int,
    mode: str,
    partition: str,
    tasks: int,
    first: int,
    window: tuple[float, float],
    out: mp.Queue,  # type: ignore[type-arg]
) -> None:
    """Run ``tasks`` consumers; put (histogram, per-consumer rows, distinct chunks) on ``out``."""
    chunks = Chunks()
    figs = [ConsumerFigures() for _ in range(tasks)]

    async def one(i: int) -> None:
        try:
            await _consume(port, mode, partition, f"c{first + i}", figs[i], chunks, window)
        except (OSError, RuntimeError, asyncio.IncompleteReadError, ValueError) as exc:
            figs[i].errors += 1
            figs[i].error = repr(exc)[:200]

    async def main() -> None:
        await asyncio.gather(*(one(i) for i in range(tasks)))

    asyncio.run(main())
    hist = np.zeros(BINS, dtype=np.int64)
    rows = []
    for fig in figs:
        if fig.receipts:
            now = np.fromiter((r[0] for r in fig.receipts), np.int64, len(fig.receipts))
            ids = [r[1] for r in fig.receipts]
            counts = np.fromiter((len(chunks.timestamps[c]) for c in ids), np.int64, len(ids))
            ts = np.concatenate([chunks.timestamps[c] for c in ids])
            lat_ms = (np.repeat(now, counts) - ts) / 1e6
            fig.windows = int(lat_ms.size)
            fig.max_ms = float(lat_ms.max()) if lat_ms.size else 0.0
            bins = np.clip((lat_ms / BIN_MS).astype(np.int64), 0, BINS - 1)
            hist += np.bincount(bins, minlength=BINS)
        rows.append(
            (
                fig.windows,
                fig.max_ms,
                fig.last_scn,
                fig.errors,
                fig.error,
                fig.ready_at,
                len(fig.receipts),
            )
        )
    out.put((hist, rows, len(chunks)))


def idle_proc(port: int, partition: str, tasks: int, hold_s: float, out: mp.Queue) -> None:  # type: ignore[type-arg]
    """Open ``tasks`` long-polls (``wait=60``) on an idle partition and hold them ``hold_s``."""

    async def main() -> None:
        conns = []
        for i in range(tasks):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                f"GET /v1/stream?partition={partition}&client=idle{i}&wait=60 HTTP/1.1\r\n"
                f"Host: 127.0.0.1\r\n\r\n".encode()
            )
            conns.append((reader, writer))
        out.put(len(conns))
        await asyncio.sleep(hold_s)
        for _, writer in conns:
            writer.close()

    asyncio.run(main())


def percentile(hist: npt.NDArray[np.int64], q: float) -> float:
    """The ``q`` percentile (0-100) of a latency histogram, in ms (bin's upper edge)."""
    total = int(hist.sum())
    if total == 0:
        return float("nan")
    rank = int(np.searchsorted(np.cumsum(hist), q / 100 * total))
    return (rank + 1) * BIN_MS
