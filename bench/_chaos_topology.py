"""The chaos harness's system under test: databases, ZooKeeper, relays, bootstrap servers, consumers.

:class:`Topology` starts, all on 127.0.0.1 and stopped by pid at the end:

* a real Postgres 15 (``EmbeddedPostgres``; source database ``chaos``, replica
  database ``replica``) and a real MariaDB (``EmbeddedMariaDB``; database
  ``chaos``), a real ZooKeeper (``_zk.ZkServer``);
* three ``changebus relay`` processes in one cluster (``relay-1..3``), each with
  two partitions: ``pg`` (postgres fetcher, slot/publication ``chaos``) and
  ``my`` (mysql fetcher, database ``chaos``, a ``server_id`` per member derived by
  the relay); a small ``capacity_bytes`` so that a stopped consumer falls off;
* two ``changebus bootstrap`` processes, ``boot-pg`` and ``boot-my`` (one per
  partition: a server seeds only one source, and it must re-seed by itself after a
  gap in its log -- ``seed.dsn`` -- or a process would need a manual step);
* consumers: ``changebus replicate`` pg -> SQLite (``rep-pg-sqlite``), pg ->
  Postgres (``rep-pg-pg``, database ``replica``), my -> SQLite (``rep-my-sqlite``)
  and ``changebus tail --checkpoint FILE`` on pg (``tail-pg``); every consumer finds
  the relays in the cluster's routing table (``--zookeeper/--cluster``) and
  bootstraps from its partition's server (``--bootstrap URL``).

Network paths go through :class:`FaultProxy` instances of the harness (their
names are the fault targets):

==================  ===========================================  =====================
proxy               path                                         how it is wired
==================  ===========================================  =====================
``c-relay-N``       consumers and following relays -> relay N    relay N's ``advertised_url``
``b-relay-N``       bootstrap servers -> relay N                 the servers' ``relays`` list
``pg-relay-N``      relay N's postgres fetcher -> Postgres       its ``dsn``
``my-relay-N``      relay N's mysql fetcher -> MariaDB           its ``host``/``port``
``c-boot-pg/my``    consumers -> bootstrap server                the consumers' ``--bootstrap``
==================  ===========================================  =====================

The replicas' own connections (the pg -> Postgres sink, the bootstrap servers'
seeding, the harness's checks) go to the databases directly.

The processes run under a :class:`Supervisor` (restart like systemd's
``Restart=always``); their logs are ``<base>/logs/<name>.<incarnation>.log``.
Everything here is driven from the harness's one event loop; blocking database
starts run in threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import logging
import os
import random
import socket
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from _chaos_bank import stored_checkpoint_scn
from _chaos_check import tail_checkpoint_scn
from _chaos_procs import ProcSpec, Supervisor
from _chaos_proxy import FaultProxy
from _zk import ZkServer
from changebus.fetchers.mysql import EmbeddedMariaDB
from changebus.fetchers.postgres import EmbeddedPostgres

__all__ = [
    "CLUSTER",
    "CONSUMER",
    "PARTITIONS",
    "RELAYS",
    "ReplicaSpec",
    "Topology",
    "TopologyOptions",
    "free_port",
]

log = logging.getLogger("chaos.topology")

ROOT = Path(__file__).resolve().parents[1]
SLICES = ("schemas", "cluster", "fetchers", "relay", "bootstrap", "client", "discovery")
CLUSTER = "chaos"
#: partition name -> source kind
PARTITIONS = {"pg": "pg", "my": "mysql"}
RELAYS = ("relay-1", "relay-2", "relay-3")
SOURCE_DB = "chaos"
REPLICA_DB = "replica"
#: the replicate processes' --consumer-name (the key of their stored checkpoint)
CONSUMER = "chaos"


def free_port() -> int:
    """A port free now, below the ephemeral range (32768+ on Linux).

    The daemons bind it a few seconds later (after their start-up): a port from the
    ephemeral range may meanwhile become the local end of any outgoing connection on
    the (shared) machine, and the daemon could not listen.
    """
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError("no free port found in 20000..32000")


def _toml_str(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string


@dataclass(frozen=True)
class TopologyOptions:
    """What the topology is made of (sizes small: the machine is shared)."""

    base: Path
    #: each relay partition's ring: small, so that a stopped consumer falls off (it must
    #: hold the largest transaction: the workload's initial rows, ~440 KB from MariaDB)
    relay_capacity_bytes: int = 512 << 10
    #: the relays' ZooKeeper session (a dead leader is replaced after about this long)
    session_timeout_s: float = 3.0
    #: the partitions' ``durability`` ("page_cache" | "fsync"); None: not written
    durability: str | None = None
    #: how long the relays' long polls hold a request
    relay_max_wait_s: float = 5.0
    restart_delay_s: float = 1.0
    log_level: str = "info"


@dataclass(frozen=True)
class ReplicaSpec:
    """One effectively-once replica kept by a ``replicate`` process."""

    name: str  # the process's name
    partition: str  # "pg" | "my"
    source_kind: str  # "pg" | "mysql"
    sink: str  # "sqlite" | "pg"
    path: Path | None = None  # sqlite
    dsn: str = ""  # pg

    @property
    def schema(self) -> str:
        """The source tables' schema: ``public`` (Postgres) or the database (MariaDB)."""
        return "public" if self.source_kind == "pg" else SOURCE_DB

    def table(self, table: str) -> str:
        """The replica's name of a source table (the replicate sink's naming)."""
        sep = "_" if self.sink == "sqlite" else "."
        return f"{self.schema}{sep}{table}"


@dataclass
class Topology:
    """The running system (module docstring). ``await start()`` then ``await close()``."""

    options: TopologyOptions
    pg: EmbeddedPostgres | None = None
    my: EmbeddedMariaDB | None = None
    zk: ZkServer | None = None
    proxies: dict[str, FaultProxy] = field(default_factory=dict)
    sup: Supervisor | None = None
    #: relay name -> its own HTTP port (the harness observes relays directly)
    relay_ports: dict[str, int] = field(default_factory=dict)
    #: bootstrap server name ("boot-pg") -> its own HTTP port
    boot_ports: dict[str, int] = field(default_factory=dict)
    replicas: list[ReplicaSpec] = field(default_factory=list)
    tail_checkpoint: Path | None = None
    #: the tail's checkpoint SCN read before each restart (supervisor hook), by incarnation
    tail_checkpoints: list[int] = field(default_factory=list)

    # -- derived -------------------------------------------------------------------------

    @property
    def base(self) -> Path:
        return self.options.base

    def pg_dsn(self, db: str = SOURCE_DB) -> str:
        assert self.pg is not None
        return self.pg.dsn(db)

    def pg_connect(self) -> psycopg.Connection[Any]:
        """A new autocommit connection to the Postgres source database."""
        return psycopg.connect(self.pg_dsn(), autocommit=True, connect_timeout=5)

    def my_connect(self) -> Any:
        """A new autocommit PyMySQL connection to the MariaDB source database."""
        assert self.my is not None
        return self.my.connect(SOURCE_DB, read_timeout=30, write_timeout=30)

    def connect(self, kind: str) -> Any:
        return self.pg_connect() if kind == "pg" else self.my_connect()

    @property
    def supervisor(self) -> Supervisor:
        assert self.sup is not None
        return self.sup

    def proxy_url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.proxies[name].port}"

    def relay_url(self, relay: str) -> str:
        """The relay's own URL (not through a proxy): for the harness's observations."""
        return f"http://127.0.0.1:{self.relay_ports[relay]}"

    def boot_url(self, boot: str) -> str:
        return f"http://127.0.0.1:{self.boot_ports[boot]}"

    @property
    def consumers(self) -> list[str]:
        return [*(r.name for r in self.replicas), "tail-pg"]

    @property
    def daemons(self) -> list[str]:
        return [*RELAYS, *self.boot_ports]

    # -- start / stop --------------------------------------------------------------------

    async def start(self) -> None:
        """Start everything; returns when every partition streams and every consumer runs."""
        base = self.base
        base.mkdir(parents=True, exist_ok=True)
        base.chmod(0o755)  # the databases' own users must reach their directories
        (base / "logs").mkdir(exist_ok=True)
        pg, my, zk = await asyncio.gather(
            asyncio.to_thread(EmbeddedPostgres.start, base / "pg"),
            asyncio.to_thread(self._start_mariadb),
            asyncio.to_thread(self._start_zk),
            return_exceptions=True,
        )
        # keep what started (close() stops it) before raising what did not
        self.pg = pg if isinstance(pg, EmbeddedPostgres) else None
        self.my = my if isinstance(my, EmbeddedMariaDB) else None
        self.zk = zk if isinstance(zk, ZkServer) else None
        for outcome in (pg, my, zk):
            if isinstance(outcome, BaseException):
                raise outcome
        await asyncio.to_thread(self._create_databases)
        for r in RELAYS:
            self.relay_ports[r] = free_port()
        for p in PARTITIONS:
            self.boot_ports[f"boot-{p}"] = free_port()
        await self._start_proxies()
        self.sup = Supervisor(base / "logs")
        self.sup.before_restart = self._before_restart
        for r in RELAYS:
            self.sup.add(self._relay_spec(r))
        for p, kind in PARTITIONS.items():
            self.sup.add(self._boot_spec(p, kind))
        self._add_consumers()
        for r in RELAYS:
            await self.sup.start(r)
        await self.wait_cluster_settled(90)
        for boot in self.boot_ports:
            await self.sup.start(boot)
        await self.wait_boot_streaming(60)
        for name in self.consumers:
            await self.sup.start(name)

    def _start_mariadb(self) -> EmbeddedMariaDB:
        """Install and start MariaDB; a second try in a new directory (blocking).

        ``mariadb-install-db`` sometimes fails on a machine where other servers
        are being installed at the same moment (temporary tables in /tmp).
        """
        try:
            return EmbeddedMariaDB.start(self.base / "my")
        except Exception:  # retried once, then raised
            log.warning("MariaDB did not start; trying again", exc_info=True)
            return EmbeddedMariaDB.start(self.base / "my2")

    def _start_zk(self) -> ZkServer:
        zk = ZkServer(self.base / "zk")
        zk.start()
        return zk

    def _create_databases(self) -> None:
        with psycopg.connect(self.pg_dsn("postgres"), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {SOURCE_DB}")
            conn.execute(f"CREATE DATABASE {REPLICA_DB}")
        assert self.my is not None
        conn = self.my.connect()
        try:
            with conn.cursor() as cur:
                cur.execute(f"CREATE DATABASE IF NOT EXISTS {SOURCE_DB}")
        finally:
            conn.close()

    async def _start_proxies(self) -> None:
        assert self.pg is not None
        assert self.my is not None
        for r in RELAYS:
            n = r.rsplit("-", 1)[1]
            self.proxies[f"c-relay-{n}"] = FaultProxy(
                f"c-relay-{n}", "127.0.0.1", self.relay_ports[r]
            )
            self.proxies[f"b-relay-{n}"] = FaultProxy(
                f"b-relay-{n}", "127.0.0.1", self.relay_ports[r]
            )
            self.proxies[f"pg-relay-{n}"] = FaultProxy(f"pg-relay-{n}", "127.0.0.1", self.pg.port)
            self.proxies[f"my-relay-{n}"] = FaultProxy(f"my-relay-{n}", "127.0.0.1", self.my.port)
        for boot, port in self.boot_ports.items():
            self.proxies[f"c-{boot}"] = FaultProxy(f"c-{boot}", "127.0.0.1", port)
        for proxy in self.proxies.values():
            await proxy.start()

    # -- configs and process specs -------------------------------------------------------

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(str(ROOT / d) for d in SLICES)
        env.pop("CHANGEBUS_TOKEN", None)
        return env

    def _spec(self, name: str, kind: str, argv: list[str], **env: str) -> ProcSpec:
        return ProcSpec(
            name=name,
            kind=kind,
            argv=[sys.executable, "-m", "changebus.schemas", *argv],
            env={**self._env(), **env},
            cwd=self.base,
            restart_delay_s=self.options.restart_delay_s,
        )

    def _relay_spec(self, relay: str) -> ProcSpec:
        assert self.zk is not None
        n = relay.rsplit("-", 1)[1]
        o = self.options
        home = self.base / relay
        home.mkdir(exist_ok=True)
        pg_dsn = (
            f"host=127.0.0.1 port={self.proxies[f'pg-relay-{n}'].port} user=postgres "
            f"dbname={SOURCE_DB} connect_timeout=5"
        )
        durability = f"durability = {_toml_str(o.durability)}\n" if o.durability else ""
        fetcher_retry = "retry_initial_s = 0.2\nretry_max_s = 2.0\n"
        text = (
            f"data_dir = {_toml_str(str(home / 'data'))}\n"
            "flush_interval_s = 1.0\n"
            f"log_level = {_toml_str(o.log_level)}\n"
            f"[http]\nport = {self.relay_ports[relay]}\nmax_wait_s = {o.relay_max_wait_s}\n"
            f"[cluster]\nzookeeper = {_toml_str(self.zk.hosts)}\nname = {_toml_str(CLUSTER)}\n"
            f"member_id = {_toml_str(relay)}\n"
            f"advertised_url = {_toml_str(self.proxy_url(f'c-relay-{n}'))}\n"
            f"session_timeout_s = {o.session_timeout_s}\n"
            f'[[partitions]]\nname = "pg"\nid = 1\ncapacity_bytes = {o.relay_capacity_bytes}\n'
            f"{durability}"
            f'[partitions.fetcher]\nkind = "postgres"\n{fetcher_retry}'
            f"options = {{ dsn = {_toml_str(pg_dsn)}, slot = {_toml_str(SOURCE_DB)}, "
            f"publication = {_toml_str(SOURCE_DB)}, status_interval_s = 0.5, "
            "io_timeout_s = 6.0 }\n"
            f'[[partitions]]\nname = "my"\nid = 2\ncapacity_bytes = {o.relay_capacity_bytes}\n'
            f"{durability}"
            f'[partitions.fetcher]\nkind = "mysql"\n{fetcher_retry}'
            f'options = {{ host = "127.0.0.1", port = {self.proxies[f"my-relay-{n}"].port}, '
            f'user = "root", databases = [{_toml_str(SOURCE_DB)}], connect_timeout_s = 5.0 }}\n'
        )
        cfg = home / "relay.toml"
        cfg.write_text(text)
        return self._spec(relay, "relay", ["relay", "--config", str(cfg)])

    def _boot_spec(self, partition: str, kind: str) -> ProcSpec:
        assert self.my is not None
        name = f"boot-{partition}"
        home = self.base / name
        home.mkdir(exist_ok=True)
        relays = ", ".join(
            _toml_str(self.proxy_url(f"b-relay-{r.rsplit('-', 1)[1]}")) for r in RELAYS
        )
        if kind == "pg":
            seed = f'kind = "postgres"\ndsn = {_toml_str(self.pg_dsn())}\n'
        else:
            seed = f'kind = "mysql"\ndsn = {_toml_str(f"mysql://root:@127.0.0.1:{self.my.port}")}\n'
        text = (
            f"relays = [{relays}]\n"
            f"partitions = [{_toml_str(partition)}]\n"
            f"data_dir = {_toml_str(str(home / 'data'))}\n"
            f"log_level = {_toml_str(self.options.log_level)}\n"
            f'[store]\nkind = "sqlite"\npath = {_toml_str(str(home / "boot.db"))}\n'
            f"[http]\nport = {self.boot_ports[name]}\n"
            "[producer]\nwait_s = 2.0\nfell_off_retry_s = 1.0\n"
            f"[seed]\n{seed}partition = {_toml_str(partition)}\nchunk_rows = 500\n"
        )
        cfg = home / "bootstrap.toml"
        cfg.write_text(text)
        return self._spec(name, "bootstrap", ["bootstrap", "--config", str(cfg)])

    def _route(self, partition: str) -> list[str]:
        assert self.zk is not None
        return [
            *("--zookeeper", self.zk.hosts, "--cluster", CLUSTER, "--partition", partition),
            *("--bootstrap", self.proxy_url(f"c-boot-{partition}")),
        ]

    def _add_consumers(self) -> None:
        sup = self.supervisor
        replicas = self.base / "replicas"
        replicas.mkdir(exist_ok=True)
        self.replicas = [
            ReplicaSpec("rep-pg-sqlite", "pg", "pg", "sqlite", path=replicas / "pg.sqlite"),
            ReplicaSpec("rep-pg-pg", "pg", "pg", "pg", dsn=self.pg_dsn(REPLICA_DB)),
            ReplicaSpec("rep-my-sqlite", "my", "mysql", "sqlite", path=replicas / "my.sqlite"),
        ]
        # a pull through a half-open proxy is given up after 2 + 4 s, not the default 20
        common = ["--consumer-name", CONSUMER, "--log-level", "info"]
        common += ["--wait-s", "2", "--read-margin-s", "4"]
        # a position in SCNs a bootstrap server never received (its producer fell off
        # while the replica read the relay): the replica starts again by itself
        common += ["--on-unservable", "reset"]
        for rep in self.replicas:
            if rep.sink == "sqlite":
                assert rep.path is not None
                argv = ["replicate", *self._route(rep.partition), "--sqlite", str(rep.path)]
                sup.add(self._spec(rep.name, "consumer", [*argv, *common]))
            else:
                argv = ["replicate", *self._route(rep.partition), "--postgres"]
                sup.add(
                    self._spec(
                        rep.name, "consumer", [*argv, *common], CHANGEBUS_REPLICA_DSN=rep.dsn
                    )
                )
        self.tail_checkpoint = self.base / "tail" / "checkpoint.json"
        self.tail_checkpoint.parent.mkdir(exist_ok=True)
        argv = [
            "tail",
            *self._route("pg"),
            *("--checkpoint", str(self.tail_checkpoint), "--log-level", "info"),
            # not "latest" (the default): that is wherever the relay is when the tail first
            # reaches it, which may be after the first changes
            *("--from", "earliest"),
        ]
        sup.add(self._spec("tail-pg", "tail", argv))

    def _before_restart(self, name: str, incarnation: int) -> None:
        """Supervisor hook: the checkpoint the tail's next incarnation will read."""
        if name != "tail-pg" or self.tail_checkpoint is None:
            return
        self.tail_checkpoints.append(tail_checkpoint_scn(self.tail_checkpoint, "pg"))

    # -- observations --------------------------------------------------------------------

    def relay_status(self, relay: str) -> dict[str, dict[str, Any]] | None:
        """The relay's partitions by name (its /v1/status, asked directly), or None."""
        if self.sup is not None and self.sup.is_stopped(relay):
            return None
        body = _get_json(f"{self.relay_url(relay)}/v1/status")
        return None if body is None else {p["name"]: p for p in body.get("partitions", [])}

    def boot_status(self, boot: str) -> dict[str, Any] | None:
        if self.sup is not None and self.sup.is_stopped(boot):
            return None
        return _get_json(f"{self.boot_url(boot)}/v1/status")

    def cluster_state(self) -> dict[str, dict[str, dict[str, Any]] | None]:
        return {r: self.relay_status(r) for r in RELAYS}

    def settled(self) -> bool:
        """Every partition: one streaming leader and two streaming followers."""
        states = self.cluster_state()
        for p in PARTITIONS:
            roles: list[str] = []
            for st in states.values():
                part = None if st is None else st.get(p)
                if part is None or part.get("state") != "streaming":
                    return False
                roles.append(str(part.get("role")))
            if sorted(roles) != ["follower", "follower", "leader"]:
                return False
        return True

    async def wait_cluster_settled(self, seconds: float) -> None:
        await _wait(lambda: asyncio.to_thread(self.settled), seconds, "the relay cluster settled")

    def boot_streaming(self) -> bool:
        for boot in self.boot_ports:
            st = self.boot_status(boot)
            if st is None:
                return False
            parts = st.get("partitions", [])
            if not parts or any(p.get("state") != "streaming" for p in parts):
                return False
        return True

    async def wait_boot_streaming(self, seconds: float) -> None:
        await _wait(
            lambda: asyncio.to_thread(self.boot_streaming), seconds, "bootstrap servers streaming"
        )

    def evicted_past(self, partition: str, scn: int) -> bool:
        """Whether every relay that answers has evicted the window ``scn`` (and those before)."""
        answered = 0
        for st in self.cluster_state().values():
            part = None if st is None else st.get(partition)
            if part is None:
                continue
            answered += 1
            if int(part.get("prev_scn", -1)) <= scn:  # a consumer at prev_scn missed nothing
                return False
        return answered > 0

    def partition_of(self, consumer: str) -> str:
        """The partition a consumer reads."""
        for rep in self.replicas:
            if rep.name == consumer:
                return rep.partition
        return "pg"  # the tail

    def consumer_checkpoint_scn(self, consumer: str) -> int:
        """The window SCN a consumer's stored checkpoint resumes after (-1: none; blocking)."""
        partition = self.partition_of(consumer)
        if consumer == "tail-pg":
            assert self.tail_checkpoint is not None
            return tail_checkpoint_scn(self.tail_checkpoint, partition)
        rep = next(r for r in self.replicas if r.name == consumer)
        return stored_checkpoint_scn(rep.sink, rep.path, rep.dsn, CONSUMER, partition)

    def leader(self, partition: str) -> str:
        """The relay leading ``partition`` now (by the relays' own status; blocking).

        The first relay when none says so (between leaders, or none answers).
        """
        for relay, st in self.cluster_state().items():
            part = None if st is None else st.get(partition)
            if part is not None and part.get("role") == "leader":
                return relay
        return RELAYS[0]

    def newest_scn(self, partition: str) -> int:
        """The newest window SCN any relay holds of ``partition`` (-1: none answers)."""
        best = -1
        for st in self.cluster_state().values():
            part = None if st is None else st.get(partition)
            if part is not None:
                best = max(best, int(part.get("max_scn", -1)))
        return best

    # -- databases -----------------------------------------------------------------------

    def restart_db(self, kind: str) -> None:
        """Immediate restart of one database (blocking: run it in a thread)."""
        if kind == "pg":
            assert self.pg is not None
            self.pg.restart(mode="immediate")
        else:
            assert self.my is not None
            self.my.restart(kill=True)

    def restart_zk(self, down_s: float) -> None:
        """Stop ZooKeeper (by pid), leave it down ``down_s``, start it again on the same
        port and data (blocking: run it in a thread)."""
        assert self.zk is not None
        self.zk.stop()
        time.sleep(down_s)
        self.zk.start()

    # -- shutdown ------------------------------------------------------------------------

    async def close(self) -> None:
        """Stop everything by pid (processes, proxies, ZooKeeper, databases)."""
        if self.sup is not None:
            with contextlib.suppress(Exception):
                await self.sup.shutdown()
        for proxy in self.proxies.values():
            with contextlib.suppress(Exception):
                await proxy.close()
        stops = [x.stop for x in (self.zk, self.my, self.pg) if x is not None]
        for stop in stops:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(stop)


async def _wait(check: Any, seconds: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not await check():
        if loop.time() > deadline:
            raise TimeoutError(f"timed out after {seconds:.0f} s waiting for {what}")
        await asyncio.sleep(0.25)


def _get_json(url: str) -> dict[str, Any] | None:
    """A status page's JSON object, or None when the server does not answer well (blocking)."""
    try:
        with urllib.request.urlopen(url, timeout=3) as resp:
            body: dict[str, Any] = json.loads(resp.read())
    except (OSError, ValueError, http.client.HTTPException):
        return None
    return body
