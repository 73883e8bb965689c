"""The blocking-call detector for tests that run daemons in the test's event loop.

``no_blocking`` activates `blockbuster <https://pypi.org/project/blockbuster/>`_
(as aiohttp's own test suite does): while it is active, a blocking call --
``time.sleep``, file reads and writes, ``os.stat``/``mkdir``/..., blocking
sockets, SQLite, a contended ``threading.Lock`` -- made on a thread that runs
an event loop raises ``BlockingError`` when a daemon's code (the relay, the
bootstrap server, the fetchers the relay hosts, the server frame) is on the
call stack. The same calls on the daemons' worker threads are fine, and so
is the tests' own code (a test may block its loop; a daemon may not).

Use it with ``pytestmark = pytest.mark.usefixtures("no_blocking")``. Every
allowance below says why the call does not block the loop for long.
"""

from __future__ import annotations

import importlib
import threading
import traceback
from collections.abc import Iterator
from types import ModuleType

import blockbuster.blockbuster as bb_module
import pytest
from blockbuster import BlockBuster, BlockingError, blockbuster_ctx

#: the code that runs on a daemon's event loop
DAEMON_MODULES = [
    "changebus.cluster",
    "changebus.relay",
    "changebus.bootstrap",
    "changebus.fetchers",
    "changebus.schemas._server",
    "changebus.schemas._server_app",
    "changebus.schemas._server_limits",
    "changebus.schemas._server_query",
]
#: not daemon code: the throwaway database servers the tests start (blocking by design)
TEST_HELPERS = [
    "changebus.fetchers.mysql._embedded",
    "changebus.fetchers.postgres._embedded",
]


def _modules(names: list[str]) -> list[ModuleType]:
    """The modules of ``names`` that import here (an optional extra may be missing)."""
    found = []
    for name in names:
        try:
            found.append(importlib.import_module(name))
        except ImportError:
            continue
    return found


class _Seen:
    """Every BlockingError raised while the fixture is active (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.errors: list[str] = []


@pytest.fixture
def no_blocking(monkeypatch: pytest.MonkeyPatch) -> Iterator[BlockBuster]:
    """Fail the test when a daemon blocks its event loop (module docstring).

    A daemon catches unexpected exceptions on purpose (the HTTP error
    middleware answers 500, fetchers and producers retry), so the test may not
    see the ``BlockingError`` itself: every one raised is recorded with its
    stack, and the test fails at teardown when there was any.
    """
    seen = _Seen()

    class RecordedBlockingError(BlockingError):
        def __init__(self, func: str) -> None:
            super().__init__(func)
            stack = "".join(traceback.format_stack(limit=12)[:-1])
            with seen.lock:
                seen.errors.append(f"{self}\n{stack}")

    # blockbuster raises the class its module names at the time of the call
    monkeypatch.setattr(bb_module, "BlockingError", RecordedBlockingError)
    with blockbuster_ctx(_modules(DAEMON_MODULES), excluded_modules=_modules(TEST_HELPERS)) as bb:
        # Log records reach the handlers the program configured, on the thread
        # that logs: the daemons log to stderr (which blockbuster itself lets
        # pass) and under pytest a warning also reaches pytest's log-file
        # handler, which writes to os.devnull unless --log-file is given.
        for func in ("io.TextIOWrapper.write", "io.BufferedWriter.write"):
            bb.functions[func].can_block_in("logging/__init__.py", "emit")
        yield bb
    if seen.errors:
        pytest.fail(
            f"{len(seen.errors)} blocking call(s) on a daemon's event loop; the first:\n"
            + seen.errors[0],
            pytrace=False,
        )
