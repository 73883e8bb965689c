"""A private, throwaway MariaDB server: for the tests and benchmarks.

:class:`EmbeddedMariaDB` runs ``mariadb-install-db`` into a directory and
starts ``mariadbd`` on 127.0.0.1 with a free port, a private socket and the
binlog settings the fetcher needs (``binlog_format=ROW``,
``binlog_row_image=FULL``, ``binlog_row_metadata=FULL``, ``server_id=1``);
``settings`` overrides or adds server options (``{"binlog-format":
"STATEMENT"}``). It stops the server **by its pid** (``SIGTERM``, then
``SIGKILL`` after ``stop_timeout_s``). Binaries come from
``$CHANGEBUS_MARIADB_BIN``, else ``/usr/sbin`` + ``/usr/bin`` (Debian's
``mariadb-server``), else ``PATH``.

As root the server runs as the ``mysql`` system user (Debian's package
creates it; ``changebus-mysql`` is created when it is missing), which owns
the directory. ``root`` has no password and is reachable on loopback only:
never expose this server. Durability is relaxed for speed
(``innodb_flush_log_at_trx_commit=2``, ``sync_binlog=0``: a crash of the
process loses nothing committed, a crash of the OS may). Blocking
(subprocess) API; call it from a thread in async code.

:meth:`EmbeddedMariaDB.restart` kills the server (``kill -9`` by pid, or a
clean stop) and starts it again with the same options -- port, data
directory -- returning once it accepts connections (after InnoDB's crash
recovery) or raising :class:`~changebus.schemas.SourceError` after
``timeout_s``; the fault-injection harness uses it.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from changebus.schemas import ConfigError, SourceConfigError, SourceError

__all__ = ["EmbeddedMariaDB", "find_mariadb_bin"]


def find_mariadb_bin() -> tuple[Path, Path]:
    """``(mariadbd, mariadb-install-db)`` paths (see the module docstring)."""
    env = os.environ.get("CHANGEBUS_MARIADB_BIN")
    dirs = [Path(env)] if env else []
    dirs += [Path("/usr/sbin"), Path("/usr/bin")]
    dirs += [Path(p) for p in os.environ.get("PATH", "").split(os.pathsep) if p]
    server = next((d / "mariadbd" for d in dirs if (d / "mariadbd").exists()), None)
    install = next(
        (d / "mariadb-install-db" for d in dirs if (d / "mariadb-install-db").exists()), None
    )
    if server is None or install is None:
        raise ConfigError(
            "MariaDB server binaries not found (mariadbd, mariadb-install-db); install them "
            "(apt-get install mariadb-server) or set CHANGEBUS_MARIADB_BIN"
        )
    return server, install


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _server_user() -> str | None:
    if os.geteuid() != 0:
        return None
    for user in ("mysql", "changebus-mysql"):
        try:
            pwd.getpwnam(user)
            return user
        except KeyError:
            continue
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "changebus-mysql"],
        check=True,
        capture_output=True,
    )
    return "changebus-mysql"


@dataclass
class EmbeddedMariaDB:
    """A running throwaway server (see the module docstring). Not thread-safe."""

    directory: Path
    port: int
    pid: int
    stop_timeout_s: float = 30.0
    #: the server process when this object started it (reaped on stop)
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False, compare=False)
    #: the server's command line (``restart`` runs it again)
    argv: list[str] = field(default_factory=list, repr=False, compare=False)

    @classmethod
    def start(cls, directory: Path, *, settings: dict[str, str] | None = None) -> EmbeddedMariaDB:
        """Install a data directory into ``directory/data`` and start the server."""
        server, install = find_mariadb_bin()
        directory.mkdir(parents=True, exist_ok=True)
        user = _server_user()
        if user is not None:
            for parent in directory.resolve().parents:
                if not parent.stat().st_mode & 0o001:
                    raise ConfigError(
                        f"{directory} is inside {parent}, which the server's user {user} "
                        f"cannot enter (mode {parent.stat().st_mode & 0o777:o}): use a "
                        "directory whose parents are searchable by others (tempfile.mkdtemp())"
                    )
            shutil.chown(directory, user)
            directory.chmod(0o755)
        data = directory / "data"
        # temporary files of its own: servers installed at once in /tmp collided on
        # names ("Error on delete of '/tmp/#sql-temptable-...'")
        tmp = directory / "tmp"
        tmp.mkdir(exist_ok=True)
        if user is not None:
            shutil.chown(tmp, user)
        user_args = [f"--user={user}"] if user else []
        done = subprocess.run(
            [
                str(install),
                "--no-defaults",
                *user_args,
                f"--datadir={data}",
                "--auth-root-authentication-method=normal",
                "--skip-test-db",
                f"--tmpdir={tmp}",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if done.returncode != 0:
            raise SourceConfigError(
                f"mariadb-install-db failed: {(done.stderr or done.stdout).strip()[-2000:]}"
            )
        port = _free_port()
        options = {
            "datadir": str(data),
            "tmpdir": str(tmp),
            "port": str(port),
            "bind-address": "127.0.0.1",
            "socket": str(directory / "mysqld.sock"),
            "pid-file": str(directory / "mysqld.pid"),
            "log-error": str(directory / "error.log"),
            "server-id": "1",
            "log-bin": str(data / "mysql-bin"),
            "binlog-format": "ROW",
            "binlog-row-image": "FULL",
            "binlog-row-metadata": "FULL",
            "skip-name-resolve": "",
            "innodb-buffer-pool-size": "128M",
            "innodb-flush-log-at-trx-commit": "2",
            "sync-binlog": "0",
            "character-set-server": "utf8mb4",
            "collation-server": "utf8mb4_general_ci",
            **(settings or {}),
        }
        args = [str(server), "--no-defaults", *user_args]
        args += [f"--{k}={v}" if v != "" else f"--{k}" for k, v in options.items()]
        self = cls(directory, port, 0, argv=args)
        self._launch(args, 60.0, SourceConfigError)
        return self

    def _launch(self, args: list[str], timeout_s: float, error: type[SourceError]) -> None:
        """Run ``args`` and wait until the server accepts connections (else ``error``)."""
        process = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.process, self.pid = process, process.pid
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                raise error(f"mariadbd did not start:\n{self._error_tail()}")
            try:
                self.connect(read_timeout=5, write_timeout=5).close()
                return
            except Exception:  # noqa: BLE001 - not accepting connections yet
                if time.monotonic() > deadline:
                    self.stop()
                    raise error(
                        f"mariadbd did not accept connections:\n{self._error_tail()}"
                    ) from None
                time.sleep(0.05)

    def restart(self, *, kill: bool = True, timeout_s: float = 60.0) -> None:
        """Kill the server by pid (``kill=True``: SIGKILL, no shutdown at all; else a clean
        stop) and start it again on the same port and data directory; returns once it
        accepts connections (``pid`` is the new server's), else raises :class:`SourceError`.
        """
        if not self.argv:
            raise ConfigError("restart needs a server started by EmbeddedMariaDB.start")
        if kill:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            if not self._wait_gone(timeout_s):
                raise SourceError(f"mariadbd (pid {self.pid}) did not end after SIGKILL")
        else:
            self.stop()
        # a new server may find the port still held for a moment: let it wait for it
        self._launch([*self.argv, "--port-open-timeout=10"], timeout_s, SourceError)

    def _wait_gone(self, timeout_s: float) -> bool:
        if self.process is not None and self.process.pid == self.pid:
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                return False
            return True
        deadline = time.monotonic() + timeout_s
        while not _reaped(self.pid):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def _error_tail(self) -> str:
        log = self.directory / "error.log"
        return log.read_text(errors="replace")[-2000:] if log.exists() else ""

    def connect(self, database: str | None = None, **kwargs: Any) -> Any:
        """A PyMySQL connection as ``root`` (autocommit, utf8mb4)."""
        import pymysql

        return pymysql.connect(
            host="127.0.0.1",
            port=self.port,
            user="root",
            password="",
            database=database,
            autocommit=True,
            charset="utf8mb4",
            connect_timeout=5,
            **kwargs,
        )

    def options(self, **extra: Any) -> dict[str, Any]:
        """Fetcher options (kind ``mysql``) for this server as ``root``."""
        return {"host": "127.0.0.1", "port": self.port, "user": "root", **extra}

    def stop(self) -> None:
        """Shutdown by pid (SIGTERM); SIGKILL if it does not end in time. Idempotent."""
        try:
            os.kill(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        if self.process is not None:
            try:
                self.process.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            return
        deadline = time.monotonic() + self.stop_timeout_s
        while time.monotonic() < deadline:
            if _reaped(self.pid):
                return
            time.sleep(0.05)
        os.kill(self.pid, signal.SIGKILL)


def _reaped(pid: int) -> bool:
    """True when ``pid`` is gone (reaping it when it is our child)."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return True
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False
