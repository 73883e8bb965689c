"""A blocking facade over :class:`~._consumer.Consumer` for code without asyncio.

:class:`SyncConsumer` starts a private event loop in a background thread
(``changebus-consumer``) and runs the async consumer there; each blocking
method submits a coroutine to that loop and waits for its result. So the
async core is the only implementation: the sync API adds no behaviour.

Thread-safety: one application thread at a time may call the blocking
methods (they serialise on the loop anyway); :meth:`SyncConsumer.stop` may
be called from any thread. Always :meth:`~SyncConsumer.close` (or use
``with``): it stops the loop thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Coroutine
from types import TracebackType
from typing import Any, Self, TypeVar

from changebus.schemas import Checkpoint, Unit, UnitStore

from ._callbacks import AsyncCallbacks, Callbacks
from ._config import ConsumerConfig
from ._consumer import Consumer
from ._dispatch import in_callback
from ._model import Window
from ._persist import CheckpointPersister

__all__ = ["SyncConsumer"]

#: how long :meth:`SyncConsumer.close` lets TLS connections finish closing
_TLS_SETTLE_S = 0.1

T = TypeVar("T")


class SyncConsumer:
    """Blocking consumer: ``for window in consumer`` or ``consumer.run(callbacks)``.

    Same arguments and semantics as :class:`~changebus.client.Consumer`
    (``persister`` methods run on the background loop; plain methods of a
    group's ``listener`` run in a worker thread, so they may call
    :meth:`commit`).
    """

    def __init__(
        self,
        config: ConsumerConfig,
        persister: CheckpointPersister | UnitStore | None = None,
        *,
        listener: object | None = None,
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="changebus-consumer", daemon=True
        )
        self._thread.start()
        self._closed = False
        try:
            self.consumer = self._call(self._make(config, persister, listener))
        except BaseException:
            self._stop_loop()
            raise

    @staticmethod
    async def _make(
        config: ConsumerConfig,
        persister: CheckpointPersister | UnitStore | None,
        listener: object | None,
    ) -> Consumer:
        return Consumer(config, persister, listener=listener)

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            coro.close()
            raise RuntimeError("this consumer is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:
            # interrupted (Ctrl-C) or failed: do not leave the coroutine running
            future.cancel()
            raise

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> Window:
        try:
            return self._call(self.consumer.__anext__())
        except StopAsyncIteration:
            raise StopIteration from None

    def commit(self) -> None:
        """Persist the position after the last window returned."""
        self._call(self.consumer.commit())

    def run(self, callbacks: Callbacks | AsyncCallbacks) -> None:
        """Dispatch to ``callbacks`` until :meth:`stop` or an error (blocks)."""
        self._call(self.consumer.run(callbacks))

    def stop(self) -> None:
        """End a running :meth:`run` or iteration after the current window (any thread)."""
        self.consumer.stop()

    @property
    def units(self) -> frozenset[Unit]:
        """The units this group member holds now (empty outside groups)."""
        return self.consumer.units

    @property
    def checkpoint(self) -> Checkpoint:
        """The position after the last window the application finished."""
        return self.consumer.checkpoint

    def stats(self) -> dict[str, Any]:
        """See :meth:`Consumer.stats` (any thread, also the consumer's own loop's:
        an async callback's; after :meth:`close`, the last figures)."""
        if self._closed or self._loop.is_closed() or not self._loop.is_running():
            return self.consumer.stats()
        with contextlib.suppress(RuntimeError):
            if asyncio.get_running_loop() is self._loop:
                return self.consumer.stats()  # (waiting for the loop on it: a deadlock)
        future = concurrent.futures.Future[dict[str, Any]]()

        def collect() -> None:
            try:
                future.set_result(self.consumer.stats())
            except BaseException as exc:  # noqa: BLE001 - the caller would wait for ever
                future.set_exception(exc)

        self._loop.call_soon_threadsafe(collect)
        try:
            return future.result(timeout=5.0)
        except concurrent.futures.TimeoutError:  # (the loop stopped just now)
            return self.consumer.stats()

    def close(self) -> None:
        """Close the consumer and stop the background loop; idempotent.

        A :meth:`run` under way finishes its window first (its callbacks and
        checkpoint), then returns. From inside a callback that would wait for
        itself: call :meth:`stop` there, and ``close`` once ``run`` returned.
        """
        if self._closed:
            return
        if in_callback():
            raise RuntimeError(
                "SyncConsumer.close() inside a callback would wait for the callback itself:"
                " call stop() there, and close() once run() returned"
            )
        try:
            self._call(self.consumer.close())
            if self._may_use_tls():
                # a TLS connection closed while a response was being read ends with a
                # close_notify exchange that needs the loop a moment longer (otherwise
                # its socket is left to the garbage collector)
                self._call(asyncio.sleep(_TLS_SETTLE_S))
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def _may_use_tls(self) -> bool:
        cfg = self.consumer.config
        urls = (*cfg.relays, *cfg.bootstrap_servers)
        return cfg.uses_cluster or any(u.startswith("https://") for u in urls)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
