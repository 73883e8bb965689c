"""A process supervisor for the chaos harness: start, kill -9, SIGSTOP/SIGCONT, restart like systemd.

:class:`Supervisor` runs the daemons and consumers of a chaos run (``changebus relay``,
``bootstrap``, ``replicate``, ``tail``...) as child processes described by a
:class:`ProcSpec`, each in its own session (``start_new_session``: a terminal's signals do
not reach them). :meth:`Supervisor.watch` is the ``Restart=always`` of systemd: a process
that exits -- killed by the harness or on its own -- is recorded as an :class:`Exit` and
started again after ``restart_delay_s``, as a new *incarnation* (1, 2, ...), unless the
supervisor is shutting down.

Signals go by pid, never by name: ``kill9`` and ``SIGTERM`` to the pid this supervisor
started. Its own child processes (e.g. the MySQL fetcher's decoding workers) share its
process group, whose id is that pid: like systemd's ``KillMode=control-group``, once the
main process has ended whatever is left of its group is SIGKILLed before the restart, and
``stop``/``cont`` freeze and thaw the whole group (a paused machine). A group id is not
reused while any member lives, so this never reaches another process.

Files, under ``base``: ``<name>.<incarnation>.log`` receives stdout and stderr; for kind
``"tail"`` stdout goes to ``<name>.<incarnation>.out`` (the JSON lines a checker reads,
:meth:`Supervisor.outputs`) and stderr to the ``.log``.

The child's environment is the harness's ``os.environ`` overlaid with ``ProcSpec.env``.

Thread-safety: use one supervisor from one event loop. :meth:`kill9`, :meth:`stop` and
:meth:`cont` are plain calls (a signal); process starts and log reads run in a worker
thread, so the loop is not blocked by ``fork``/``exec`` or file I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Exit", "ProcSpec", "Supervisor"]

log = logging.getLogger("changebus.bench.chaos.procs")

_POLL_S = 0.05
_TAIL_CHARS = 2000
_TERM_WAIT_S = 10.0


@dataclass
class ProcSpec:
    """How to run one supervised process (``name`` is unique within a supervisor)."""

    name: str
    kind: str  # "relay" | "bootstrap" | "consumer" | "tail"
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    restart_delay_s: float = 1.0  # like systemd Restart=always RestartSec=1


@dataclass(frozen=True)
class Exit:
    """One recorded end of an incarnation.

    ``returncode`` is negative for a signal (``-9``: SIGKILL). ``killed_by_harness`` is true
    when the supervisor sent the signal that ended it (:meth:`Supervisor.kill9` or
    :meth:`Supervisor.shutdown`); false means the process ended on its own. ``log_tail`` is
    the end of the incarnation's ``.log``. ``at`` is the ``time.monotonic()`` of the
    observation and ``uptime_s`` how long the incarnation ran.
    """

    name: str
    incarnation: int
    returncode: int
    killed_by_harness: bool
    log_tail: str
    at: float = 0.0
    uptime_s: float = 0.0


@dataclass
class _Running:
    """The live incarnation of a process."""

    popen: subprocess.Popen[bytes]
    incarnation: int
    started: float
    killed: bool = False  # the harness sent the signal that will end it
    stopped: bool = False  # SIGSTOP sent and no SIGCONT since
    files: list[Path] = field(default_factory=list)


class Supervisor:
    """Starts, signals and restarts :class:`ProcSpec` processes (see the module doc).

    ``incarnations[name]`` is the number of the latest start (1 for the first). ``exits``
    lists every observed end in order. ``before_restart(name, next_incarnation)`` is called
    (on the loop) just before a restart, e.g. to read a checkpoint file the process left;
    an exception it raises is logged and the restart goes on.
    """

    def __init__(self, base: Path) -> None:
        self.base = base
        self.specs: dict[str, ProcSpec] = {}
        self.incarnations: dict[str, int] = {}
        self.exits: list[Exit] = []
        self.before_restart: Callable[[str, int], None] | None = None
        self._running: dict[str, _Running] = {}
        self._restart_at: dict[str, float] = {}
        self._closing = False
        self._start_lock = asyncio.Lock()

    def add(self, spec: ProcSpec) -> None:
        """Register ``spec`` (not started yet)."""
        if spec.name in self.specs:
            raise ValueError(f"duplicate process name {spec.name!r}")
        self.specs[spec.name] = spec

    def log_path(self, name: str, incarnation: int) -> Path:
        """The ``.log`` file of an incarnation (stdout+stderr, or stderr for kind tail)."""
        return self.base / f"{name}.{incarnation}.log"

    def outputs(self, name: str) -> list[Path]:
        """The stdout files of a kind ``"tail"`` process, by incarnation (those that exist)."""
        found = []
        for n in range(1, self.incarnations.get(name, 0) + 1):
            path = self.base / f"{name}.{n}.out"
            if path.exists():
                found.append(path)
        return found

    def pid(self, name: str) -> int | None:
        """The pid of the running incarnation, or None while it is down."""
        run = self._running.get(name)
        return run.popen.pid if run is not None else None

    def is_running(self, name: str) -> bool:
        """True while an incarnation of ``name`` runs (possibly SIGSTOPped)."""
        return name in self._running

    async def start(self, name: str) -> None:
        """Start the next incarnation of ``name`` (nothing when it is running)."""
        async with self._start_lock:
            if name in self._running or self._closing:
                return
            spec = self.specs[name]
            n = self.incarnations.get(name, 0) + 1
            self._restart_at.pop(name, None)
            run = await asyncio.to_thread(self._spawn, spec, n)
            self.incarnations[name] = n
            self._running[name] = run
            log.info("started %s #%d (pid %d)", name, n, run.popen.pid)

    def _spawn(self, spec: ProcSpec, n: int) -> _Running:
        self.base.mkdir(parents=True, exist_ok=True)
        log_file = self.log_path(spec.name, n)
        env = {**os.environ, **spec.env}
        with contextlib.ExitStack() as files:
            err = files.enter_context(log_file.open("ab"))
            paths = [log_file]
            if spec.kind == "tail":
                out_path = self.base / f"{spec.name}.{n}.out"
                out = files.enter_context(out_path.open("ab"))
                paths.append(out_path)
            else:
                out = err
            popen = subprocess.Popen(
                spec.argv,
                cwd=spec.cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
        return _Running(popen, n, time.monotonic(), files=paths)

    async def start_all(self) -> None:
        """Start every registered process (in the order added)."""
        for name in self.specs:
            await self.start(name)

    def _signal(self, name: str, sig: signal.Signals, *, group: bool = False) -> _Running | None:
        run = self._running.get(name)
        if run is None or run.popen.returncode is not None:
            log.info("%s is not running: %s not sent", name, sig.name)
            return None
        try:
            if group:
                os.killpg(run.popen.pid, sig)
            else:
                os.kill(run.popen.pid, sig)
        except ProcessLookupError:
            return None
        return run

    def kill9(self, name: str) -> None:
        """SIGKILL the running incarnation; the watcher restarts it after its delay."""
        self._mark_killed(name)
        self._signal(name, signal.SIGKILL)

    def _mark_killed(self, name: str) -> None:
        run = self._running.get(name)
        # poll() first: a process that already ended on its own is not counted as killed
        if run is not None and run.popen.poll() is None:
            run.killed = True

    def stop(self, name: str) -> None:
        """SIGSTOP the running incarnation (it keeps its sockets; nothing runs)."""
        run = self._signal(name, signal.SIGSTOP, group=True)
        if run is not None:
            run.stopped = True

    def cont(self, name: str) -> None:
        """SIGCONT a stopped incarnation."""
        run = self._signal(name, signal.SIGCONT, group=True)
        if run is not None:
            run.stopped = False

    def is_stopped(self, name: str) -> bool:
        """True when the running incarnation was SIGSTOPped and not continued."""
        run = self._running.get(name)
        return run is not None and run.stopped

    async def watch(self) -> None:
        """Run until cancelled: record every exit and restart the dead after their delay."""
        while True:
            try:
                await self.poll()
            except Exception:  # the watcher must not die: log and go on
                log.exception("supervisor watch round failed")
            await asyncio.sleep(_POLL_S)

    async def poll(self) -> None:
        """One round of :meth:`watch` (reap exits, start what is due)."""
        now = time.monotonic()
        for name, run in list(self._running.items()):
            code = run.popen.poll()
            if code is None:
                continue
            del self._running[name]
            _kill_leftovers(run.popen.pid)
            await self._record(name, run, code)
            if not self._closing:
                self._restart_at[name] = now + self.specs[name].restart_delay_s
        for name, due in list(self._restart_at.items()):
            if self._closing or due > now or name in self._running:
                continue
            del self._restart_at[name]
            hook = self.before_restart
            if hook is not None:
                try:
                    hook(name, self.incarnations.get(name, 0) + 1)
                except Exception:
                    log.exception("before_restart hook failed for %s", name)
            try:
                await self.start(name)
            except OSError:
                log.exception("could not restart %s; trying again", name)
                self._restart_at[name] = time.monotonic() + self.specs[name].restart_delay_s

    async def _record(self, name: str, run: _Running, code: int) -> None:
        tail = await asyncio.to_thread(_read_tail, run.files[0])
        ended = Exit(
            name,
            run.incarnation,
            code,
            run.killed,
            tail,
            at=time.monotonic(),
            uptime_s=time.monotonic() - run.started,
        )
        self.exits.append(ended)
        level = logging.INFO if run.killed else logging.WARNING
        log.log(level, "%s #%d exited with %d", name, run.incarnation, code)

    async def shutdown(self) -> None:
        """No more restarts; SIGCONT all, SIGTERM, wait up to 10 s, then SIGKILL (by pid)."""
        self._closing = True
        self._restart_at.clear()
        async with self._start_lock:
            pass  # a start in progress has finished and registered its process
        for name in list(self._running):
            self._mark_killed(name)
            self._signal(name, signal.SIGCONT, group=True)
            self._signal(name, signal.SIGTERM)
        deadline = time.monotonic() + _TERM_WAIT_S
        for _ in range(int(_TERM_WAIT_S / _POLL_S)):
            if time.monotonic() > deadline:
                break
            if all(r.popen.poll() is not None for r in self._running.values()):
                break
            await asyncio.sleep(_POLL_S)
        for name in list(self._running):
            run = self._running.pop(name, None)
            if run is None:
                continue  # the watcher recorded it meanwhile
            if run.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(run.popen.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    await asyncio.to_thread(run.popen.wait, _TERM_WAIT_S)
            _kill_leftovers(run.popen.pid)
            code = run.popen.returncode
            await self._record(name, run, -signal.SIGKILL if code is None else code)


def _kill_leftovers(pgid: int) -> None:
    """SIGKILL what is left of the process group of an ended main process (see module doc)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _read_tail(path: Path) -> str:
    try:
        with path.open("rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - _TAIL_CHARS))
            return f.read().decode(errors="replace")
    except OSError:
        return ""
