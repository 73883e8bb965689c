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

from changebus.schemas import ConfigError, SourceConfigError

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


def _run_as(user: str | None, args: list[str]) -> subprocess.CompletedProcess[str]:
    cmd = ["runuser", "-u", user, "--", *args] if user else args
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
