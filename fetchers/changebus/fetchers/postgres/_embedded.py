"""A private, throwaway Postgres server: for the demo, the tests and benchmarks.

:class:`EmbeddedPostgres` runs ``initdb`` into a directory, starts the
postmaster on 127.0.0.1 with a free port, ``wal_level = logical`` and a
private socket directory, and stops it **by its pid** (``SIGINT``: fast
shutdown; ``SIGKILL`` after ``stop_timeout_s``). Binaries come from
``$CHANGEBUS_PG_BIN``, else Debian's ``/usr/lib/postgresql/<15..17>/bin``,
else the directory of ``pg_ctl`` on ``PATH``.

``initdb`` refuses to run as root: as root the server runs as an unprivileged
system user (``changebus-pg``, created when missing) that owns the data
directory. Authentication is ``trust`` on loopback only: never expose this
server. Blocking (subprocess) API; call it from a thread in async code.

:meth:`EmbeddedPostgres.restart` restarts the server on the same port and data
directory (``mode="immediate"``: no shutdown checkpoint, the start runs crash
recovery, as after a power loss of the process -- the fault-injection harness
uses it) and returns once it accepts connections again, or raises
:class:`~changebus.schemas.SourceError` after ``timeout_s``.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from changebus.schemas import ConfigError, SourceConfigError, SourceError

__all__ = ["EmbeddedPostgres", "find_pg_bin"]

_USER = "changebus-pg"


def find_pg_bin() -> Path:
    """The directory holding ``initdb`` and ``pg_ctl`` (see the module docstring)."""
    env = os.environ.get("CHANGEBUS_PG_BIN")
    candidates = [Path(env)] if env else []
    candidates += [Path(f"/usr/lib/postgresql/{v}/bin") for v in (15, 16, 17)]
    found = shutil.which("pg_ctl")
    if found:
        candidates.append(Path(found).resolve().parent)
    for c in candidates:
        if (c / "initdb").exists() and (c / "pg_ctl").exists():
            return c
    raise ConfigError(
        "PostgreSQL server binaries not found (initdb, pg_ctl); install them "
        "(apt-get install postgresql-15) or set CHANGEBUS_PG_BIN"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class EmbeddedPostgres:
    """A running throwaway server (see the module docstring). Not thread-safe."""

    directory: Path
    port: int
    pid: int
    bin_dir: Path
    stop_timeout_s: float = 30.0

    @classmethod
    def start(cls, directory: Path, *, settings: dict[str, str] | None = None) -> EmbeddedPostgres:
        """initdb into ``directory/data`` and start; returns the running server."""
        bin_dir = find_pg_bin()
        directory.mkdir(parents=True, exist_ok=True)
        user: str | None = None
        if os.geteuid() == 0:
            user = _USER
            try:
                pwd.getpwnam(user)
            except KeyError:
                subprocess.run(
                    ["useradd", "--system", "--no-create-home", user],
                    check=True,
                    capture_output=True,
                )
            shutil.chown(directory, user)
            directory.chmod(0o755)
        data = directory / "data"
        init = _run_as(
            user,
            [
                str(bin_dir / "initdb"),
                "-D",
                str(data),
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--locale=C.UTF-8",
                "--no-sync",
            ],
        )
        if init.returncode != 0:
            raise SourceConfigError(f"initdb failed: {init.stderr.strip()[-2000:]}")
        port = _free_port()
        conf = {
            "listen_addresses": "'127.0.0.1'",
            "port": str(port),
            "unix_socket_directories": f"'{directory}'",
            "wal_level": "logical",
            "max_replication_slots": "20",
            "max_wal_senders": "20",
            "max_slot_wal_keep_size": "1GB",
            "fsync": "off",
            "full_page_writes": "off",
            "shared_buffers": "128MB",
            "log_min_messages": "warning",
            **(settings or {}),
        }
        with (data / "postgresql.conf").open("a") as f:
            f.write("".join(f"{k} = {v}\n" for k, v in conf.items()))
        log = directory / "server.log"
        started = _run_as(
            user,
            [str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(log), "-w", "-t", "60", "start"],
        )
        if started.returncode != 0:
            text = log.read_text()[-2000:] if log.exists() else ""
            raise SourceConfigError(f"postgres did not start: {started.stderr.strip()}\n{text}")
        pid = int((data / "postmaster.pid").read_text().splitlines()[0])
        return cls(directory, port, pid, bin_dir)

    def dsn(self, dbname: str = "postgres") -> str:
        """A libpq connection string for the superuser ``postgres``."""
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={dbname}"

    def restart(
        self, mode: Literal["immediate", "fast", "smart"] = "immediate", *, timeout_s: float = 60.0
    ) -> None:
        """``pg_ctl restart -m mode``: same port and data directory; returns once it accepts
        connections (``pid`` is the new postmaster's), else raises :class:`SourceError`.

        ``immediate`` ends every backend at once without a checkpoint (open connections and
        replication streams break; what was committed survives through WAL replay).
        """
        import psycopg

        data = self.directory / "data"
        wait = max(1, int(timeout_s))
        log = self.directory / "server.log"
        args = [str(self.bin_dir / "pg_ctl"), "-D", str(data), "-l", str(log), "-m", mode]
        try:
            done = _run_as(
                _server_user(), [*args, "-w", "-t", str(wait), "restart"], timeout=2 * wait + 10
            )
        except subprocess.TimeoutExpired:
            raise SourceError(f"pg_ctl restart did not finish in {2 * wait + 10} s") from None
        if done.returncode != 0:
            text = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise SourceError(f"postgres did not restart: {done.stderr.strip()}\n{text}")
        self.pid = int((data / "postmaster.pid").read_text().splitlines()[0])
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                psycopg.connect(self.dsn(), connect_timeout=5).close()
                return
            except psycopg.OperationalError as exc:
                if time.monotonic() > deadline:
                    raise SourceError(
                        f"postgres did not accept connections after a restart: {exc}"
                    ) from None
                time.sleep(0.05)

    def stop(self) -> None:
        """Fast shutdown by pid; SIGKILL if it does not end in time. Idempotent."""
        try:
            os.kill(self.pid, signal.SIGINT)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + self.stop_timeout_s
        while time.monotonic() < deadline:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)
        os.kill(self.pid, signal.SIGKILL)


def _server_user() -> str | None:
    """The user the server runs as (:meth:`EmbeddedPostgres.start` created it)."""
    return _USER if os.geteuid() == 0 else None


def _run_as(
    user: str | None, args: list[str], *, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    cmd = ["runuser", "-u", user, "--", *args] if user else args
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
