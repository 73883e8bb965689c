"""Probes of a daemon under fuzzing: event-loop latency and memory, from threads.

:class:`Probe` asks a daemon's ``/healthz`` every 10 ms on its own keep-alive
connection (a thread with a blocking socket, so the fuzzer's own event loop
does not delay it; it shares this process's GIL, so a sample may be late by
up to one switch interval, 5 ms); a sample's *block* is its latency minus
the median latency before fuzzing began. :class:`MemorySampler` reads each
daemon's ``VmRSS`` and ``RssAnon`` from ``/proc/<pid>/status`` every 0.1 s.
:func:`blockers` names the cases in flight during the worst blocks.
"""

from __future__ import annotations

import re
import socket
import statistics
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["MemorySampler", "Probe", "blockers"]


class Probe(threading.Thread):
    """``GET /healthz`` every ``interval`` seconds on one keep-alive connection.

    ``samples`` holds ``(monotonic time, latency seconds)``; a failed request
    counts in ``errors`` (a closed keep-alive connection is reopened and not
    counted). Only this thread appends; read the list after :meth:`stop`.
    """

    def __init__(self, port: int, interval: float) -> None:
        super().__init__(daemon=True, name=f"probe-{port}")
        self.port = port
        self.interval = interval
        self.samples: list[tuple[float, float]] = []
        self.errors = 0
        self.reconnects = 0
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()
        self.join(60)

    def _once(self, sock: socket.socket) -> float | None:
        t0 = time.perf_counter()
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: probe\r\n\r\n")
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = sock.recv(65536)
            if not chunk:
                return None
            buf += chunk
        head, _sep, rest = buf.partition(b"\r\n\r\n")
        m = re.search(rb"(?i)\r\ncontent-length: *([0-9]+)", head)
        size = int(m[1]) if m else 0
        while len(rest) < size:
            chunk = sock.recv(65536)
            if not chunk:
                return None
            rest += chunk
        if not head.startswith(b"HTTP/1.1 200"):
            self.errors += 1
        return time.perf_counter() - t0

    def run(self) -> None:
        sock: socket.socket | None = None
        while not self._halt.is_set():
            try:
                if sock is None:
                    sock = socket.create_connection(("127.0.0.1", self.port), timeout=30)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                latency = self._once(sock)
                if latency is None:
                    self.reconnects += 1
                    sock.close()
                    sock = None
                    continue
                self.samples.append((time.monotonic(), latency))
            except OSError:
                self.errors += 1
                if sock is not None:
                    sock.close()
                sock = None
            self._halt.wait(self.interval)
        if sock is not None:
            sock.close()

    def figures(self, since: float) -> dict[str, float]:
        """Block figures (ms) of the samples after ``since``, against the ones before."""
        before = [lat for t, lat in self.samples if t < since]
        during = sorted(lat for t, lat in self.samples if t >= since)
        base = statistics.median(before) if before else 0.0
        if not during:
            return {"max_ms": 0.0, "p99_ms": 0.0, "baseline_ms": round(base * 1e3, 3)}
        p99 = during[min(len(during) - 1, int(len(during) * 0.99))]
        return {
            "max_ms": round(max(0.0, during[-1] - base) * 1e3, 1),
            "p99_ms": round(max(0.0, p99 - base) * 1e3, 1),
            "baseline_ms": round(base * 1e3, 3),
            "samples": len(during),
            "errors": self.errors,
            "reconnects": self.reconnects,
        }


def _memory(pid: int) -> tuple[int, int]:
    """(VmRSS, RssAnon) of ``pid`` in bytes; (0, 0) when it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return (0, 0)
    values = dict(re.findall(r"(VmRSS|RssAnon):\s+([0-9]+) kB", text))
    return int(values.get("VmRSS", 0)) * 1024, int(values.get("RssAnon", 0)) * 1024


class MemorySampler(threading.Thread):
    """Every 0.1 s: each daemon's (VmRSS, RssAnon); keeps the largest and the last."""

    def __init__(self, pids: dict[str, int]) -> None:
        super().__init__(daemon=True, name="rss-sampler")
        self.pids = pids
        self.start_values = {name: _memory(pid) for name, pid in pids.items()}
        self.peak = dict(self.start_values)
        self.last = dict(self.start_values)
        self._halt = threading.Event()

    def mark_start(self) -> None:
        self.start_values = {name: _memory(pid) for name, pid in self.pids.items()}
        self.peak = dict(self.start_values)

    def run(self) -> None:
        while not self._halt.wait(0.1):
            self.sample()

    def sample(self) -> None:
        for name, pid in self.pids.items():
            rss, anon = _memory(pid)
            if rss:
                peak = self.peak[name]
                self.peak[name] = (max(peak[0], rss), max(peak[1], anon))
                self.last[name] = (rss, anon)

    def stop(self) -> None:
        self._halt.set()
        self.join(10)
        self.sample()

    def figures(self) -> dict[str, dict[str, float]]:
        mb = 1 << 20
        out = {}
        for name, (rss0, anon0) in self.start_values.items():
            out[name] = {
                "anon_start_mb": round(anon0 / mb, 1),
                "anon_max_growth_mb": round((self.peak[name][1] - anon0) / mb, 1),
                "anon_end_growth_mb": round((self.last[name][1] - anon0) / mb, 1),
                "vmrss_max_growth_mb": round((self.peak[name][0] - rss0) / mb, 1),
            }
        return out


def _slow(probe: Probe, since: float) -> list[tuple[float, float]]:
    """(latency, end time) of the samples after ``since`` late by over 50 ms, worst first."""
    base = statistics.median([lat for t, lat in probe.samples if t < since] or [0.0])
    return sorted(
        ((lat - base, t) for t, lat in probe.samples if t >= since and lat - base > 0.05),
        reverse=True,
    )


def blockers(probes: dict[str, Probe], since: float, spans: list[Any]) -> list[dict[str, Any]]:
    """The worst loop blocks (> 50 ms) of each daemon with the cases in flight meanwhile.

    ``also_late`` names the other daemons whose probe was late at the same
    time: a stall of every daemon at once is the machine's (or this
    process's), not a request's.
    """
    slow = {name: _slow(p, since) for name, p in probes.items()}
    out = []
    for daemon, samples in slow.items():
        for lat, t in samples[:30]:
            began = t - lat  # the culprit was in flight when the block began
            flight = [h for d, a, b, h in spans if d == daemon and a < began < b]
            others = [
                name
                for name, other in slow.items()
                if name != daemon and any(t2 - l2 < t and t2 > began for l2, t2 in other)
            ]
            out.append(
                {
                    "daemon": daemon,
                    "block_ms": round(lat * 1e3),
                    "also_late": others,
                    "in_flight": flight,
                }
            )
    return sorted(out, key=lambda b: -int(b["block_ms"]))
