"""``--progress`` of ``changebus tail`` and ``replicate``: a catch-up bar on stderr.

:class:`CatchUpProgress` turns samples of a consumer's
:meth:`~._consumer.Consumer.stats` into a `tqdm` bar: online, the distance
from the consumer's position to the relay's newest SCN
(``relay_head_scn``: what the relay's last answer said), with the SCN rate
and ETA of tqdm and the windows per second in the postfix; during a
bootstrap, the snapshot's rows, then the catch-up's SCNs towards its target.
The bar counts what the application finished (``processed_scn``; the fetch
position until the first window is done). Once the consumer has fetched up
to the relay's newest SCN and no fetched window waits in its queue, the bar closes, one
line says so (``caught up with the relay at SCN ...``), and the display is
done for good: :meth:`CatchUpProgress.update` returns True and the caller
stops sampling.

The stream itself is never slowed: nothing is done per event or window;
the caller samples the stats a few times a second, from a thread of its own
(:class:`ProgressThread`, for the :class:`~._sync.SyncConsumer` of ``tail``)
or from a task that hands each update to a worker thread (``replicate``:
terminal writes stay off the event loop).

Thread-safety: one :class:`CatchUpProgress` is driven by one thread at a
time.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from tqdm import tqdm

__all__ = ["SAMPLE_EVERY_S", "CatchUpProgress", "ProgressThread"]

#: how often the callers sample the consumer's stats
SAMPLE_EVERY_S = 0.25


def _int(stats: Mapping[str, Any], key: str, default: int = -1) -> int:
    value = stats.get(key, default)
    return value if isinstance(value, int) else default


class CatchUpProgress:
    """The bar (module docstring); ``file`` defaults to stderr."""

    def __init__(self, file: TextIO | None = None) -> None:
        self.file = file if file is not None else sys.stderr
        self.done = False
        self._bar: Any = None  # the open tqdm bar
        self._kind = ""  # "online", "snapshot" or "catchup": what the open bar counts
        self._start = -1  # the SCN the bar's count starts at
        self._began = time.monotonic()
        self._rate_at: tuple[float, int] | None = None  # (time, windows) of the last rate
        self._rate = 0.0

    def update(self, stats: Mapping[str, Any]) -> bool:
        """Show ``stats`` (a consumer's); True once caught up (the bar is closed then)."""
        if self.done:
            return True
        windows = _int(stats, "windows_fetched", 0)
        phase = stats.get("phase", "online")
        if phase == "snapshot":
            self._snapshot(_int(stats, "bootstrap_rows", 0))
        elif phase == "catchup":
            self._scns("catchup", _int(stats, "bootstrap_scn"), _int(stats, "bootstrap_target_scn"))
        else:
            fetched, head = _int(stats, "fetch_position"), _int(stats, "relay_head_scn")
            if head >= 0 and fetched >= head and not _int(stats, "queued_windows", 0):
                self._finish(head, windows)  # fetched up to the head, and nothing waits
                return True
            processed = _int(stats, "processed_scn")
            self._scns("online", processed if processed >= 0 else fetched, head)
        self._windows_rate(windows)
        return False

    def _open(self, kind: str, **options: Any) -> Any:
        if self._bar is not None and self._kind == kind:
            return self._bar
        self.close()
        self._kind = kind
        self._bar = tqdm(
            file=self.file,
            dynamic_ncols=True,
            mininterval=SAMPLE_EVERY_S,
            unit_scale=True,
            **options,
        )
        return self._bar

    def _snapshot(self, rows: int) -> None:
        bar = self._open("snapshot", desc="bootstrap snapshot", unit=" rows", total=None)
        if rows < bar.n:  # a new snapshot began
            bar.reset()
        bar.update(rows - bar.n)

    def _scns(self, kind: str, position: int, target: int) -> None:
        if position < 0 or target < 0:
            return  # nothing known yet
        desc = "bootstrap catch-up" if kind == "catchup" else "catching up with the relay"
        fresh = self._bar is None or self._kind != kind
        bar = self._open(kind, desc=desc, unit=" scn", total=max(target - position, 0))
        if fresh:
            self._start = position
        total = max(target - self._start, 1)
        if bar.total != total:
            bar.total = total
        bar.update(max(position - self._start, 0) - bar.n)

    def _windows_rate(self, windows: int) -> None:
        now = time.monotonic()
        if self._rate_at is None:
            self._rate_at = (now, windows)
            return
        then, before = self._rate_at
        if now - then >= 1.0:
            rate = (windows - before) / (now - then)
            self._rate = rate if not self._rate else 0.7 * self._rate + 0.3 * rate
            self._rate_at = (now, windows)
            if self._bar is not None:
                self._bar.set_postfix_str(f"{self._rate:,.0f} windows/s", refresh=False)

    def _finish(self, position: int, windows: int) -> None:
        self.close()
        self.done = True
        took = time.monotonic() - self._began
        self.file.write(
            f"caught up with the relay at SCN {position} ({windows:,} windows in {took:.1f} s)\n"
        )
        self.file.flush()

    def close(self) -> None:
        """Close the open bar (idempotent; the command ends or the phase changed)."""
        bar, self._bar = self._bar, None
        if bar is not None:
            bar.close()


class ProgressThread:
    """Samples ``stats()`` every :data:`SAMPLE_EVERY_S` into a :class:`CatchUpProgress`.

    A daemon thread, started by the constructor; it ends when caught up,
    when :meth:`stop` is called (which waits for it) or when ``stats``
    raises (the consumer is closing).
    """

    def __init__(
        self, stats: Callable[[], Mapping[str, Any]], progress: CatchUpProgress | None = None
    ) -> None:
        self.progress = progress if progress is not None else CatchUpProgress()
        self._stats = stats
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="changebus-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stopping.wait(SAMPLE_EVERY_S):
                if self.progress.update(self._stats()):
                    return
        except Exception:  # noqa: BLE001 - the consumer is closing: no more display
            return
        finally:
            self.progress.close()

    def stop(self) -> None:
        """End the sampling and close the bar (idempotent)."""
        self._stopping.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
