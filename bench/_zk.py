"""A throwaway standalone ZooKeeper process (used by the tests' ``fix_zk`` and the benchmarks).

:class:`ZkServer` runs Debian's ZooKeeper 3.8 (``/usr/share/java/zookeeper.jar``;
`make test` installs the ``zookeeper`` package when missing) as
``java -cp ... QuorumPeerMain zoo.cfg``: 127.0.0.1 on a free port,
``tickTime=500`` (so sessions may last 1 to 10 s), the admin server off, the
data directory under the given base directory. It is ready when a kazoo client
connects, and it is stopped by its pid (SIGTERM, then SIGKILL).
:meth:`ZkServer.restart` (and :meth:`ZkServer.stop` / :meth:`ZkServer.start`)
keep the port and the data directory.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from kazoo.client import KazooClient

JAR = Path("/usr/share/java/zookeeper.jar")
CONF_DIR = Path("/etc/zookeeper/conf")
#: the server's tick: it expires sessions on tick boundaries, up to a tick after their timeout
TICK_MS = 500


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class ZkServer:
    """One standalone ZooKeeper process with its own data directory and port."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.port = _free_port()
        self.hosts = f"127.0.0.1:{self.port}"
        self.cfg = base / "zoo.cfg"
        (base / "data").mkdir(parents=True, exist_ok=True)
        self.cfg.write_text(
            "\n".join(
                [
                    f"tickTime={TICK_MS}",
                    f"dataDir={base / 'data'}",
                    f"clientPort={self.port}",
                    "clientPortAddress=127.0.0.1",
                    "admin.enableServer=false",
                    "4lw.commands.whitelist=ruok,srvr,mntr,stat,cons",
                    "maxClientCnxns=0",
                    "",
                ]
            )
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> None:
        """Start the server and wait until a kazoo client connects."""
        assert self.proc is None, "already running"
        classpath = f"{CONF_DIR}:{JAR}" if CONF_DIR.is_dir() else str(JAR)
        with (self.base / "zk.log").open("ab") as logfile:
            self.proc = subprocess.Popen(
                [
                    "java",
                    "-Xmx256m",
                    "-XX:+UseSerialGC",
                    "-cp",
                    classpath,
                    "org.apache.zookeeper.server.quorum.QuorumPeerMain",
                    str(self.cfg),
                ],
                stdin=subprocess.DEVNULL,
                stdout=logfile,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"ZooKeeper exited: {self.proc.returncode}"
            zk = KazooClient(hosts=self.hosts, timeout=2.0)
            try:
                zk.start(timeout=1.0)
                zk.exists("/")
                return
            except Exception:  # not up yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
            finally:
                with contextlib.suppress(Exception):
                    zk.stop()
                    zk.close()

    def stop(self) -> None:
        """Stop the server by its pid: SIGTERM, then SIGKILL after 10 s."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def restart(self) -> None:
        """Stop and start again on the same port with the same data directory."""
        self.stop()
        self.start()
