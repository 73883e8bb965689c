"""deploy/ against running servers: every metric it names exists, every path it probes answers.

One relay with a Postgres partition and a MariaDB partition (the session's servers), a
consumer pulling from each, and a bootstrap server reading the relay. Their ``/metrics``
must hold every metric family named by the Grafana dashboard, the Prometheus alert rules,
docs/operations.md, docs/metrics.md and deploy/README.md (``changebus_relay_*`` names in
the relay's output, ``changebus_bootstrap_*`` names in the bootstrap server's); the
Kubernetes probes and the Prometheus scrape paths must answer 200 on the daemon they point at.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import aiohttp
import psycopg
import pytest
import yaml

from changebus.bootstrap import (
    BootstrapConfig,
    BootstrapServer,
    HttpConfig as BootstrapHttp,
    StoreConfig,
)
from changebus.fetchers.mysql import EmbeddedMariaDB
from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from fix_mysql import mysql_execute
from waiting import wait_until

pytestmark = [pytest.mark.pg, pytest.mark.mysql]

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
#: where metric names are promised to operators
NAMED_IN = [
    DEPLOY / "grafana" / "changebus.json",
    DEPLOY / "prometheus" / "alerts.yml",
    DEPLOY / "README.md",
    ROOT / "docs" / "operations.md",
    ROOT / "docs" / "metrics.md",
]
#: a metric name (every family is ``changebus_relay_*`` or ``changebus_bootstrap_*``; lower
#: case: CHANGEBUS_RELAY_... are environment variables; other ``changebus_x`` words are
#: slots or tables), or a prefix written ``changebus_relay_buffer_*``
_NAME = re.compile(r"\bchangebus_(?:relay|bootstrap)_[a-z0-9_]*[a-z0-9](_\*)?(?![a-z0-9_.-])")
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "summary": ("_count", "_sum", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
}


def named_metrics() -> dict[str, set[str]]:
    """Metric names (and ``prefix_*`` patterns) per file that names them."""
    found: dict[str, set[str]] = {}
    for path in NAMED_IN:
        if path.exists():
            found[str(path.relative_to(ROOT))] = {
                m.group(0) for m in _NAME.finditer(path.read_text())
            }
    return found


def exposed_names(text: str) -> set[str]:
    """Every name a PromQL query may use for the families in a ``/metrics`` text."""
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            base = name.removesuffix("_total") if kind == "counter" else name
            names.update({name, base, *(base + s for s in _SUFFIXES.get(kind, ()))})
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def missing(named: set[str], exposed: set[str]) -> set[str]:
    out = set()
    for name in named:
        if name.endswith("_*"):
            if not any(e.startswith(name[:-1]) for e in exposed):
                out.add(name)
        elif name not in exposed:
            out.add(name)
    return out


def probed_paths() -> dict[str, set[str]]:
    """The HTTP paths deploy/ probes or scrapes, per daemon (``relay``, ``bootstrap``)."""
    paths: dict[str, set[str]] = {"relay": set(), "bootstrap": set()}
    for manifest in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for obj in yaml.safe_load_all(manifest.read_text()):
            if not obj or obj.get("kind") not in ("StatefulSet", "Deployment"):
                continue
            template = obj["spec"]["template"]
            for c in template["spec"]["containers"]:
                daemon = c["args"][0]
                for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
                    if probe in c:
                        paths[daemon].add(c[probe]["httpGet"]["path"])
                annotations = template["metadata"].get("annotations", {})
                if "prometheus.io/path" in annotations:
                    paths[daemon].add(annotations["prometheus.io/path"])
    compose = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())
    services = compose["services"]
    prom = yaml.safe_load((DEPLOY / "compose" / "config" / "prometheus.yml").read_text())
    for job in prom["scrape_configs"]:
        for sc in job["static_configs"]:
            for target in sc["targets"]:
                daemon = services[target.split(":")[0]]["command"][0]
                paths[daemon].add(job.get("metrics_path", "/metrics"))
    return paths


async def get(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with session.get(url) as resp:
        return resp.status, (await resp.read()).decode(errors="replace")


async def test_metrics_and_paths_named_in_deploy_exist(
    tmp_path: Path, pg_dsn: str, mysql_server: EmbeddedMariaDB, mysql_db: str
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id int PRIMARY KEY, note text)")
    mysql_execute(
        mysql_server, mysql_db, "CREATE TABLE items (id INT PRIMARY KEY, title VARCHAR(40))"
    )
    cfg = RelayConfig(
        data_dir=tmp_path / "relay",
        http=HttpConfig(port=0),
        flush_interval_s=0,
        partitions=(
            PartitionConfig(
                "pg",
                1,
                capacity_bytes=1 << 20,
                fetcher=FetcherConfig("postgres", {"dsn": pg_dsn, "status_interval_s": 0.2}),
            ),
            PartitionConfig(
                "maria",
                2,
                capacity_bytes=1 << 20,
                fetcher=FetcherConfig("mysql", mysql_server.options(databases=[mysql_db])),
            ),
        ),
    )
    texts: dict[str, str] = {}
    statuses: dict[tuple[str, str], int] = {}
    paths = probed_paths()
    async with Relay(cfg) as relay, aiohttp.ClientSession() as http:
        await wait_until(
            lambda: all(h.state == "streaming" for h in relay.hosts.values()), 60, "fetchers"
        )
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO orders VALUES (1, 'a'), (2, 'b')")
        mysql_execute(mysql_server, mysql_db, "INSERT INTO items VALUES (1, 'x')", "COMMIT")
        await wait_until(
            lambda: all(h.status()["windows"] > 0 for h in relay.hosts.values()), 30, "windows"
        )
        for p in relay.hosts:  # a consumer pulls from each partition, and stays behind
            status, _ = await get(
                http,
                f"{relay.url}/v1/stream?partition={p}&from=earliest&client=deploy-test&max_bytes=1",
            )
            assert status == 200
        boot_cfg = BootstrapConfig(
            relays=(relay.url,),
            data_dir=tmp_path / "boot",
            store=StoreConfig(kind="sqlite", path=tmp_path / "boot" / "b.db"),
            http=BootstrapHttp(port=0),
        )
        async with BootstrapServer(boot_cfg) as boot:
            urls = {"relay": relay.url, "bootstrap": boot.url}
            ready: dict[str, Any] = {}

            async def poll_ready() -> None:
                for daemon, url in urls.items():
                    ready[daemon] = (await get(http, f"{url}/readyz"))[0]

            for _ in range(300):
                await poll_ready()
                if set(ready.values()) == {200}:
                    break
                await asyncio.sleep(0.1)
            assert set(ready.values()) == {200}, ready
            for daemon, url in urls.items():
                status, texts[daemon] = await get(http, f"{url}/metrics")
                assert status == 200
                for path in paths[daemon]:
                    statuses[daemon, path] = (await get(http, url + path))[0]

    assert {"/healthz", "/readyz", "/metrics"} <= paths["relay"] & paths["bootstrap"]
    bad = {k: v for k, v in statuses.items() if v != 200}
    assert not bad, f"deploy/ probes paths the daemons do not answer 200: {bad}"

    exposed = {d: exposed_names(t) for d, t in texts.items()}
    # the consumer's lag series is there for both partitions (the panels have data)
    for p in ("pg", "maria"):
        sample = rf'^changebus_relay_consumer_lag_scn{{(?=[^}}]*partition="{p}")(?=[^}}]*consumer="deploy-test")'
        assert re.search(sample, texts["relay"], re.M), texts["relay"]
    named = named_metrics()
    for source in ("deploy/grafana/changebus.json", "deploy/prometheus/alerts.yml"):
        assert len(named[source]) >= 10, f"{source}: the name pattern went blind"
    problems = {}
    for where, names in named.items():
        relay_names = {n for n in names if n.startswith("changebus_relay_")}
        gone = missing(relay_names, exposed["relay"]) | missing(
            names - relay_names, exposed["bootstrap"]
        )
        if gone:
            problems[where] = sorted(gone)
    assert not problems, "metrics named but not exported:\n" + json.dumps(problems, indent=1)
