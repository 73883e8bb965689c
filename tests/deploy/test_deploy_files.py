"""deploy/: every file parses, every ``changebus`` command line in it is valid, configs pass ``--check``.

Command lines are collected from the systemd units (``ExecStart``/``ExecStartPre``), the
compose file (``command`` of the services running the changebus image) and the Kubernetes
manifests (``args`` of containers running the changebus image), each with the environment
and config files that run would see: a config path on the command line is resolved to the
file deploy/ gives it (a compose bind mount, a ConfigMap key mounted by the pod, the
example config a unit's install notes copy to /etc/changebus), environment variables to
their values (literal, the example Secret's, the pod's own name). Each is parsed with the
real ``changebus`` argument parser, and each daemon's config is validated as
``changebus relay|bootstrap --config X --check`` would (no server, no source needed).

The structural checks (hardening, probes, volumes, what Prometheus and Grafana load) are
here too; tests/deploy/test_deploy_live.py asks running servers for the paths and metrics.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from changebus.schemas._cli import build_parser, main
from changebus.schemas.config import scrub, secret_values

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE = DEPLOY / "compose"
SYSTEMD = DEPLOY / "systemd"
IMAGE = "changebus"


@dataclass
class CommandLine:
    """One ``changebus`` invocation found in deploy/: its argv (after the program),
    the environment it runs with, and the text of the files it names (by path)."""

    origin: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.origin}: changebus {shlex.join(self.argv)}"


def _yaml_docs(path: Path) -> list[Any]:
    with path.open() as fh:
        return [d for d in yaml.safe_load_all(fh) if d is not None]


def _k8s_objects() -> list[dict[str, Any]]:
    return [d for p in sorted(K8S.glob("*.yaml")) for d in _yaml_docs(p)]


def _k8s(kind: str, name: str) -> dict[str, Any]:
    for obj in _k8s_objects():
        if obj.get("kind") == kind and obj["metadata"]["name"] == name:
            return obj
    raise AssertionError(f"no {kind} {name} in deploy/k8s")


def _compose() -> dict[str, Any]:
    doc = _yaml_docs(COMPOSE / "compose.yaml")[0]
    assert isinstance(doc, dict)
    return doc


# --- collecting the command lines --------------------------------------------------


def _systemd_lines() -> list[CommandLine]:
    lines = []
    for unit in sorted(SYSTEMD.glob("*.service")):
        for raw in unit.read_text().splitlines():
            key, sep, value = raw.partition("=")
            if not sep or key.strip() not in ("ExecStart", "ExecStartPre"):
                continue
            argv = shlex.split(value.strip().lstrip("-@+!:"))
            assert argv[0].endswith("/changebus"), f"{unit.name}: {raw}"
            # the unit's install notes copy deploy/config/<name>.toml to /etc/changebus/
            files = {
                a: (DEPLOY / "config" / PurePosixPath(a).name).read_text()
                for a in argv
                if a.startswith("/etc/changebus/") and a.endswith(".toml")
            }
            lines.append(CommandLine(f"systemd/{unit.name} {key}", argv[1:], {}, files))
    return lines


def _compose_lines() -> list[CommandLine]:
    lines = []
    for name, svc in _compose()["services"].items():
        if not str(svc.get("image", "")).startswith(IMAGE + ":"):
            continue
        files = {}
        for vol in svc.get("volumes", []):
            source, _, rest = vol.partition(":")
            target = rest.split(":")[0]
            if source.startswith("."):
                host = (COMPOSE / source).resolve()
                if host.is_file():
                    files[target] = host.read_text()
        env = {k: str(v) for k, v in (svc.get("environment") or {}).items()}
        lines.append(CommandLine(f"compose service {name}", list(svc["command"]), env, files))
    return lines


def _pod_env(container: dict[str, Any], pod_name: str) -> dict[str, str]:
    secret = _k8s("Secret", "changebus-secrets")["stringData"]
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = re.sub(
                r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                lambda m: env.get(m.group(1), m.group(0)),
                item["value"],
            )
            continue
        src = item["valueFrom"]
        if "fieldRef" in src:
            env[item["name"]] = {"metadata.name": pod_name, "metadata.namespace": "changebus"}[
                src["fieldRef"]["fieldPath"]
            ]
        else:
            ref = src["secretKeyRef"]
            assert ref["name"] == "changebus-secrets"
            env[item["name"]] = secret[ref["key"]]
    return env


def _pod_files(spec: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    files = {}
    for mount in container.get("volumeMounts", []):
        cm = volumes.get(mount["name"], {}).get("configMap")
        if cm is None:
            continue
        data = _k8s("ConfigMap", cm["name"])["data"]
        for item in cm.get("items") or [{"key": k, "path": k} for k in data]:
            files[f"{mount['mountPath']}/{item['path']}"] = data[item["key"]]
    return files


def _workloads() -> list[dict[str, Any]]:
    return [o for o in _k8s_objects() if o.get("kind") in ("StatefulSet", "Deployment", "Job")]


def _k8s_lines() -> list[CommandLine]:
    lines = []
    for obj in _workloads():
        spec = obj["spec"]["template"]["spec"]
        pod = f"{obj['metadata']['name']}-0"
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            if c["image"].split(":")[0] != IMAGE:
                continue
            assert "command" not in c, "the image's ENTRYPOINT is changebus: give args only"
            lines.append(
                CommandLine(
                    f"k8s {obj['kind']} {obj['metadata']['name']}/{c['name']}",
                    list(c["args"]),
                    _pod_env(c, pod),
                    _pod_files(spec, c),
                )
            )
    return lines


def _all_lines() -> list[CommandLine]:
    return _systemd_lines() + _compose_lines() + _k8s_lines()


LINES = _all_lines()


# --- the files parse ---------------------------------------------------------------


def test_every_yaml_and_json_file_parses() -> None:
    yamls = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])
    assert len(yamls) >= 10, yamls
    for path in yamls:
        docs = _yaml_docs(path)
        assert docs, f"{path} is empty"
        assert all(isinstance(d, dict) for d in docs), path
    for path in DEPLOY.rglob("*.json"):
        json.loads(path.read_text())


def test_command_lines_were_found_everywhere() -> None:
    origins = " | ".join(str(c) for c in LINES)
    for expected in (
        "systemd/changebus-relay.service ExecStart: changebus relay",
        "systemd/changebus-bootstrap.service ExecStart: changebus bootstrap",
        "compose service relay-1: changebus relay",
        "compose service relay-2: changebus relay",
        "compose service bootstrap: changebus bootstrap",
        "compose service replicate: changebus replicate",
        "k8s StatefulSet changebus-relay/relay: changebus relay",
        "k8s StatefulSet changebus-bootstrap/bootstrap: changebus bootstrap",
        "k8s StatefulSet changebus-relay/check-config: changebus relay --config /etc/changebus/relay.toml --check",
    ):
        assert expected in origins, origins


def _has_real_check_source() -> bool:
    """Whether ``check-source`` takes ``--config`` (main holds a stub until checksrc merges)."""
    _, extra = build_parser().parse_known_args(["check-source", "--config", "x.toml"])
    return not extra


@pytest.mark.parametrize("line", LINES, ids=str)
def test_command_line_parses(line: CommandLine) -> None:
    if line.argv[0] == "check-source" and not _has_real_check_source():
        pytest.skip("changebus check-source lands with the checksrc branch")
    args = build_parser().parse_args(line.argv)
    assert getattr(args, "func", None) is not None, line
    for path in vars(args).values():
        # every file a command line names is one deploy/ provides (or a data path)
        if isinstance(path, Path) and str(path).startswith("/etc/"):
            assert str(path) in line.files, f"{line}: nothing in deploy/ provides {path}"


# --- the daemons' configs pass --check ---------------------------------------------


def run_check(
    kind: str, text: str, env: dict[str, str], tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> str:
    """``changebus <kind> --config <text> --check`` in-process with ``env``; its output."""
    for name in list(os.environ):
        if name.startswith(("CHANGEBUS_", "PG")):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cfg = tmp / f"{kind}.toml"
    cfg.write_text(text)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        status = main([kind, "--config", str(cfg), "--check"])
    assert status == 0, f"{kind} --check failed ({status}):\n{out.getvalue()}"
    return out.getvalue()


DAEMON_LINES = [c for c in LINES if c.argv[0] in ("relay", "bootstrap")]


@pytest.mark.parametrize("line", DAEMON_LINES, ids=str)
def test_daemon_config_passes_check(
    line: CommandLine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = line.argv[line.argv.index("--config") + 1]
    out = run_check(line.argv[0], line.files[config], line.env, tmp_path, monkeypatch)
    assert "config OK" in out
    # no secret is printed: the Secret's values, the compose demo's passwords
    secrets = [v for k, v in line.env.items() if re.search("PASSWORD|DSN|TOKEN", k)]
    for secret in [*secrets, "changebus-demo", "change-me"]:
        assert secret not in out, f"{line}: --check printed a secret"


def test_every_config_file_is_checked() -> None:
    """Each TOML file in deploy/ is a config some command line above runs with."""
    used = {text for line in DAEMON_LINES for text in line.files.values()}
    for path in sorted(DEPLOY.rglob("*.toml")):
        assert path.read_text() in used, f"{path.relative_to(ROOT)}: no command line uses it"


@pytest.mark.parametrize("name", ["relay", "bootstrap"])
def test_example_config_passes_check(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = (DEPLOY / "config" / f"{name}.toml").read_text()
    assert "config OK" in run_check(name, text, {}, tmp_path, monkeypatch)


@pytest.mark.parametrize("line", [c for c in DAEMON_LINES if c.origin.startswith("k8s")], ids=str)
def test_kubernetes_configmap_holds_no_password(line: CommandLine, tmp_path: Path) -> None:
    from changebus.bootstrap import BootstrapConfig
    from changebus.relay import RelayConfig
    from changebus.schemas.config import load_config

    kind = line.argv[0]
    cls: type[Any] = RelayConfig if kind == "relay" else BootstrapConfig
    path = tmp_path / "config.toml"
    path.write_text(line.files[line.argv[line.argv.index("--config") + 1]])
    config = load_config(cls, path, env=line.env, env_prefix=f"CHANGEBUS_{kind.upper()}_")
    # the passwords come from the Secret (environment); what the ConfigMap holds in
    # secret fields is empty or a DSN without a password (libpq reads PGPASSWORD)
    from_file = set(secret_values(config)) - set(line.env.values())
    for value in from_file:
        assert scrub(value) == value, f"{line}: the ConfigMap holds a password"
        assert "password" not in value.lower()


# --- structure ---------------------------------------------------------------------


def _unit(name: str) -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for raw in (SYSTEMD / name).read_text().splitlines():
        key, sep, value = raw.partition("=")
        if sep and not raw.startswith(("#", ";", "[")):
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


@pytest.mark.parametrize(
    ("unit", "data_dir"),
    [
        ("changebus-relay.service", "/var/lib/changebus/relay"),
        ("changebus-bootstrap.service", "/var/lib/changebus/bootstrap"),
    ],
)
def test_systemd_units_are_hardened(unit: str, data_dir: str) -> None:
    s = _unit(unit)
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "PrivateDevices": "yes",
        "UMask": "0077",
        "User": "changebus",
        "KillSignal": "SIGTERM",
        "CapabilityBoundingSet": "",
    }.items():
        assert s.get(key) == [value], f"{unit}: {key}={s.get(key)}"
    # the one writable place is the daemon's data_dir (as the example config says)
    assert s["ReadWritePaths"] == [data_dir]
    assert s["StateDirectory"] == [data_dir.removeprefix("/var/lib/")]
    name = unit.removeprefix("changebus-").removesuffix(".service")
    config = (DEPLOY / "config" / f"{name}.toml").read_text()
    assert f'data_dir = "{data_dir}"' in config
    # `systemctl reload` (certbot's and cert-manager's hooks) is SIGHUP: it reloads the
    # certificates; without ExecReload it failed ("not applicable"; review)
    assert s["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    # the daemon says READY=1 once it serves: start returns then, a reload waits for it
    assert s["Type"] == ["notify"] and s["NotifyAccess"] == ["main"]
    # a relay recovers its buffer (minutes for a big one); a bootstrap server waits for a
    # relay, bounded: unbounded, a relay down at boot held multi-user.target back
    assert s["TimeoutStartSec"] == (["300"] if name == "bootstrap" else ["infinity"])


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_systemd_recipe_installs_the_configs_of_the_units_it_enables() -> None:
    """deploy/README.md's recipe enabled changebus-bootstrap but installed only relay.toml:
    the unit's ExecStartPre --check failed on the missing bootstrap.toml (review)."""
    readme = (DEPLOY / "README.md").read_text()
    section = readme.split("## systemd", 1)[1].split("\n## ", 1)[0]
    recipe = section.split("```sh\n", 1)[1].split("```", 1)[0]
    installed: dict[str, str] = {}  # destination -> source
    enabled: list[str] = []
    for line in recipe.splitlines():
        argv = shlex.split(line, comments=True)
        if argv[:1] == ["install"] and "-d" not in argv:
            installed[argv[-1]] = argv[-2]
        if argv[:3] == ["systemctl", "enable", "--now"]:
            enabled += argv[3:]
    assert enabled, recipe
    for unit in enabled:
        assert (SYSTEMD / f"{unit}.service").is_file(), unit
        s = _unit(f"{unit}.service")
        for line in [*s["ExecStartPre"], *s["ExecStart"]]:
            for arg in shlex.split(line):
                if arg.startswith("/etc/changebus/") and arg.endswith(".toml"):
                    assert arg in installed, (
                        f"{unit} reads {arg}, which the recipe does not install"
                    )
                    assert (ROOT / installed[arg]).is_file(), installed[arg]
        for env_file in s.get("EnvironmentFile", []):
            assert env_file.lstrip("-") in installed, f"{unit}: {env_file} is not created"


def test_systemd_units_verify(tmp_path: Path) -> None:
    """systemd itself knows every directive and value (the program path is not installed here)."""
    units = []
    for unit in sorted(SYSTEMD.glob("*.service")):
        copy = tmp_path / unit.name
        copy.write_text(unit.read_text().replace("/opt/changebus/.venv/bin/changebus", "/bin/true"))
        units.append(str(copy))
    result = subprocess.run(
        ["systemd-analyze", "verify", *units], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), result


def test_dockerfile_is_multistage_non_root_and_runs_changebus() -> None:
    text = (DEPLOY / "docker" / "Dockerfile").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    froms = [i for i, ln in enumerate(lines) if ln.startswith("FROM ")]
    assert len(froms) >= 2, "multi-stage: a builder and the final image"
    final = lines[froms[-1] :]
    assert any(ln.startswith("COPY --from=builder") for ln in final)
    users = [ln.split()[1] for ln in final if ln.startswith("USER ")]
    assert users, "the final image runs as a named unprivileged user"
    assert users[-1].split(":")[0] not in ("0", "root")
    assert 'ENTRYPOINT ["changebus"]' in final
    assert not any(ln.startswith("HEALTHCHECK") for ln in lines)
    assert not any(re.search(r"\b(gcc|build-essential|g\+\+)\b", ln) for ln in final)
    # the build context: everything is left out but what `pip install .` needs
    ignore = [ln for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln[:1] not in "#"]
    assert ignore[0] == "**"
    assert not any(ln.startswith(("!.git", "!.venv", "!var", "!tests")) for ln in ignore)


def test_kubernetes_relays_statefulset_with_volume_probes_and_pdb() -> None:
    sts = _k8s("StatefulSet", "changebus-relay")
    svc = _k8s("Service", sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None", "a headless Service for the members"
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    pdb = _k8s("PodDisruptionBudget", "changebus-relay")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    claims = {t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]}
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    config = _k8s("ConfigMap", "changebus-config")["data"]["relay.toml"]
    data_dir = re.search(r'^data_dir = "([^"]+)"', config, re.M)
    assert data_dir is not None
    # inside the claim, not its root: the volume's root is root's, and the daemon keeps its
    # data_dir at mode 0700 (review: the chmod of the root crash-looped the pod)
    assert any(Path(data_dir.group(1)).parent == Path(mounts[c]) for c in claims), (
        "the ring lives on the claim, in a directory of its own"
    )


def test_kubernetes_relay_volume_holds_the_buffer_files() -> None:
    """The ring, its event table and its index are sparse files: a volume too small fails
    late, on a write through the memory map (SIGBUS, no log line). The 10Gi volume held
    10.03 GiB of files for the 8GiB ring (review)."""
    import math

    from changebus.relay._bufconfig import BufferConfig
    from changebus.relay._tables import EVENT_DTYPE, INDEX_DTYPE
    from changebus.schemas.config import parse_size

    sts = _k8s("StatefulSet", "changebus-relay")
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    volume = parse_size(claim["spec"]["resources"]["requests"]["storage"].replace("Gi", "GiB"))
    config = _k8s("ConfigMap", "changebus-config")["data"]["relay.toml"]
    found = re.findall(r'^\s*capacity_bytes = "([^"]+)"', config, re.M)
    assert found
    total = 0
    for text in found:
        cfg = BufferConfig(capacity_bytes=parse_size(text))
        index_slots = math.ceil(cfg.capacity_bytes / cfg.block) + 4
        total += (
            cfg.capacity_bytes
            + cfg.slots * EVENT_DTYPE.itemsize
            + index_slots * INDEX_DTYPE.itemsize
        )
    assert total <= 0.9 * volume, (total / 2**30, volume / 2**30)


@pytest.mark.parametrize("name", ["changebus-relay", "changebus-bootstrap"])
def test_kubernetes_pods_run_unprivileged_with_resources_and_probes(name: str) -> None:
    sts = _k8s("StatefulSet", name)
    spec = sts["spec"]["template"]["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] != 0
    assert "volumeClaimTemplates" in sts["spec"]
    (c,) = spec["containers"]
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    for kind in ("requests", "limits"):
        assert c["resources"][kind]["memory"]
    assert c["resources"]["requests"]["cpu"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["port"] in ports
    annotations = sts["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) in ports.values()
    # the port the config listens on is the container's
    config_file = c["args"][c["args"].index("--config") + 1]
    text = _pod_files(spec, c)[config_file]
    port = re.search(r"^port = (\d+)", text, re.M)
    assert port is not None and int(port.group(1)) in ports.values()


def test_kubernetes_pods_take_no_service_links() -> None:
    """The kubelet's service-link variables of the Service changebus-bootstrap
    (``CHANGEBUS_BOOTSTRAP_PORT=tcp://...``) read as config overrides (review)."""
    for obj in _workloads():
        spec = obj["spec"]["template"]["spec"]
        assert spec.get("enableServiceLinks") is False, obj["metadata"]["name"]


def test_compose_has_the_whole_system() -> None:
    services = _compose()["services"]
    pg = " ".join(services["postgres"]["command"])
    assert "wal_level=logical" in pg
    maria = " ".join(services["mariadb"]["command"])
    for flag in (
        "--binlog-format=ROW",
        "--binlog-row-image=FULL",
        "--binlog-row-metadata=FULL",
        "--log-bin",
    ):
        assert flag in maria
    assert "zookeeper" in services
    relays = [n for n, s in services.items() if s.get("command", [None])[0] == "relay"]
    assert len(relays) >= 2
    assert any(s.get("command", [None])[0] == "bootstrap" for s in services.values())
    assert any(s.get("command", [None])[0] == "replicate" for s in services.values())
    # Prometheus scrapes every daemon and loads the alert rules deploy/prometheus holds
    prom = services["prometheus"]
    mounts = dict(v.split(":")[:2] for v in prom["volumes"])
    inverse = {target: source for source, target in mounts.items()}
    prom_cfg = yaml.safe_load((COMPOSE / inverse["/etc/prometheus/prometheus.yml"]).read_text())
    for rules in prom_cfg["rule_files"]:
        assert (COMPOSE / inverse[rules]).resolve() == DEPLOY / "prometheus" / "alerts.yml"
    targets = {
        t
        for job in prom_cfg["scrape_configs"]
        for sc in job["static_configs"]
        for t in sc["targets"]
    }
    daemons = [
        n for n, s in services.items() if s.get("command", [None])[0] in ("relay", "bootstrap")
    ]
    assert {t.split(":")[0] for t in targets} == set(daemons)
    # Grafana: the provisioned dashboard is deploy/grafana/changebus.json
    graf = services["grafana"]
    gm = {t.split(":")[1]: t.split(":")[0] for t in graf["volumes"]}
    prov = COMPOSE / gm["/etc/grafana/provisioning"]
    provider = yaml.safe_load((prov / "dashboards" / "changebus.yaml").read_text())
    path = provider["providers"][0]["options"]["path"]
    dash = [src for tgt, src in gm.items() if tgt.startswith(path + "/")]
    assert [(COMPOSE / d).resolve() for d in dash] == [DEPLOY / "grafana" / "changebus.json"]
    ds = yaml.safe_load((prov / "datasources" / "prometheus.yaml").read_text())
    assert ds["datasources"][0]["url"] == "http://prometheus:9090"


REQUIRED_ALERT_METRICS = {
    "fetcher down": "changebus_relay_fetcher_state",
    "consumer lag": "changebus_relay_consumer_lag_seconds",
    "retained WAL": "changebus_relay_source_retained_wal_bytes",
    "relay not ready": "changebus_relay_ready",
    "data loss": "changebus_relay_data_loss_events_total",
    "consumer fell off": "changebus_relay_consumers_fell_off_total",
    # (a daemon down exports nothing: only Prometheus's own series sees it)
    "daemon down": "up",
}


def test_alert_rules_are_complete() -> None:
    doc = _yaml_docs(DEPLOY / "prometheus" / "alerts.yml")[0]
    names, exprs = set(), []
    for group in doc["groups"]:
        for rule in group["rules"]:
            assert rule["alert"] not in names, f"duplicate alert {rule['alert']}"
            names.add(rule["alert"])
            assert rule["labels"]["severity"] in ("critical", "warning")
            assert rule["annotations"]["summary"] and rule["annotations"]["description"]
            assert re.fullmatch(r"\d+[smh]", rule.get("for", "0s")), rule
            assert rule["expr"].count("(") == rule["expr"].count(")")
            exprs.append(rule["expr"])
    for what, metric in REQUIRED_ALERT_METRICS.items():
        assert any(re.search(rf"\b{metric}\b", e) for e in exprs), f"no alert on {what}"


def test_dashboard_is_well_formed() -> None:
    dash = json.loads((DEPLOY / "grafana" / "changebus.json").read_text())
    panels = dash["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    exprs = []
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24
        if p["type"] == "row":
            continue
        assert p["title"] and p["description"]
        assert p["targets"]
        for t in p["targets"]:
            assert t["expr"].count("(") == t["expr"].count(")")
            assert t["expr"].count("{") == t["expr"].count("}")
            exprs.append(t["expr"])
    text = " ".join(exprs)
    for metric in (
        "changebus_relay_windows_appended_total",  # ingest rate
        "changebus_relay_source_lag_seconds",  # relay head vs source
        "changebus_relay_source_retained_wal_bytes",
        "changebus_relay_source_binlog_distance_bytes",
        "changebus_relay_consumer_lag_seconds",  # consumer lag
        "changebus_bootstrap_snapshot_table_rows",  # bootstrap progress
        "changebus_relay_data_loss_events_total",  # errors
    ):
        assert metric in text, f"the dashboard shows no {metric}"
    variables = {v["name"] for v in dash["templating"]["list"]}
    for var in re.findall(r"\$(\w+)", text):
        assert var in variables or var.startswith("__"), var
