"""The shared config loader: TOML + env + overrides into frozen dataclasses."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from changebus.schemas import ConfigError
from changebus.schemas.config import load_config, parse_size, redacted, secret, size_field


@dataclass(frozen=True)
class Http:
    host: str = "127.0.0.1"
    port: int = 8400


@dataclass(frozen=True)
class Source:
    name: str
    dsn: str = secret()
    kind: Literal["postgres", "mysql"] = "postgres"


@dataclass(frozen=True)
class Cfg:
    http: Http = field(default_factory=Http)
    buffer_bytes: int = size_field(1 << 20)
    poll_seconds: float = 0.5
    debug: bool = False
    data_dir: Path = Path("var")
    sources: tuple[Source, ...] = ()
    tags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.poll_seconds <= 0:
            raise ValueError("poll_seconds must be positive")


def test_defaults() -> None:
    cfg = load_config(Cfg, env={})
    assert cfg == Cfg()


def test_layers_apply_in_order(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text(
        'buffer_bytes = "64MiB"\npoll_seconds = 2\n[http]\nport = 9000\n'
        '[[sources]]\nname = "pg"\ndsn = "postgresql://u:hunter2@h/db"\n'
    )
    env = {"CB_HTTP__PORT": "9100", "CB_DEBUG": "true", "OTHER": "x"}
    cfg = load_config(
        Cfg, p, env=env, env_prefix="CB_", overrides=["http.host=0.0.0.0", 'tags=["a","b"]']
    )
    assert cfg.buffer_bytes == 64 * 1024 * 1024
    assert cfg.poll_seconds == 2.0
    assert cfg.http == Http("0.0.0.0", 9100)
    assert cfg.debug is True
    assert cfg.sources == (Source("pg", "postgresql://u:hunter2@h/db"),)
    assert cfg.tags == ("a", "b")
    shown = redacted(cfg)
    assert shown["sources"][0]["dsn"] == "***"
    assert "hunter2" not in repr(shown)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["nope=1"], "unknown config key"),
        (["http.port=high"], "expected an integer"),
        (["poll_seconds=-1"], "poll_seconds must be positive"),
        (["debug=maybe"], "true or false"),
        (["buffer_bytes=lots"], "bad size"),
        (["sources=[{name='x', kind='oracle'}]"], "not one of"),
        (["justtext"], "bad override"),
        # inf and nan (TOML has both): a deadline that never expires, a ratio whose
        # product with 0 is nan (bootstrap's catchup_ratio = inf made a plan fail: review)
        (["poll_seconds=inf"], "expected a finite number"),
        (["poll_seconds=nan"], "expected a finite number"),
        (["poll_seconds=-inf"], "expected a finite number"),
    ],
)
def test_errors_are_clear(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(Cfg, env={}, overrides=overrides)


def test_missing_and_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Cfg, tmp_path / "absent.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[http\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(Cfg, bad)


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("4096", 4096),
        ("1KiB", 1024),
        ("1kB", 1000),
        ("2GB", 2 * 10**9),
        ("64MiB", 64 << 20),
        ("1.5MiB", 3 << 19),
    ],
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


def test_config_errors_never_quote_a_secret(tmp_path: Path) -> None:
    """A section that fit none of its types was quoted whole (a [cluster] table with its
    zk_password), an override named its value (a DSN, a token), a URL its password
    (review). Errors name keys and types; URLs are shown without their user."""
    from changebus.bootstrap import BootstrapConfig
    from changebus.client import ConsumerConfig
    from changebus.relay import FetcherConfig, RelayConfig

    toml = tmp_path / "relay.toml"
    toml.write_text(
        '[cluster]\nzookeeper = "127.0.0.1:2181"\nzk_user = "cb"\n'
        'zk_password = "hunter2-zk"\nlease_fraction = 7\n'
    )
    with pytest.raises(ConfigError) as info:
        load_config(RelayConfig, toml, env={})
    assert "hunter2-zk" not in str(info.value) and "cluster" in str(info.value)
    for item in (
        "debug.dsn=postgresql://u:hunter2@h/db",  # a table where a flag goes
        "http.port.dsn=postgresql://u:hunter2@h/db",  # through a non-section value
        "http.port=postgresql://u:hunter2@h/db",  # a DSN where a number goes
    ):
        with pytest.raises(ConfigError) as info:
            load_config(Cfg, env={}, overrides=[item])
        assert "hunter2" not in str(info.value), item
        assert item.partition(".")[0] in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(Cfg, env={}, overrides=["token-s3cr3t"])
    assert "s3cr3t" not in str(info.value)
    with pytest.raises(ConfigError) as info:
        ConsumerConfig(relays=("htps://admin:pw-s3cr3t@relay:8470",))
    assert "pw-s3cr3t" not in str(info.value) and "relay:8470" in str(info.value)
    with pytest.raises(ConfigError) as info:
        BootstrapConfig(relays=("HTTPS://admin:pw-s3cr3t@relay",), partitions=("p",))
    assert "pw-s3cr3t" not in str(info.value)
    # a fetcher's options (DSNs, keys) are redacted in its repr
    shown = repr(FetcherConfig("postgres", {"dsn": "postgresql://u:hunter2@h/db", "slot": "s"}))
    assert "hunter2" not in shown and "'slot': 's'" in shown


def test_a_replica_dsn_libpq_cannot_parse_is_refused_without_quoting_it() -> None:
    """libpq quotes the piece of a DSN it choked on: with an unquoted password that
    holds a space, a piece of the password (review)."""
    from changebus.client._pgsession import connect

    with pytest.raises(ConfigError) as info:
        connect("host=127.0.0.1 password=correct horse battery", 0)
    assert "horse" not in str(info.value) and "battery" not in str(info.value)


#: what the kubelet puts in a pod's environment for a Service changebus-bootstrap
#: (port 8471, named http) and a Service changebus-bootstrap-metrics (9102/UDP)
SERVICE_LINKS = {
    "CHANGEBUS_BOOTSTRAP_SERVICE_HOST": "10.96.0.7",
    "CHANGEBUS_BOOTSTRAP_SERVICE_PORT": "8471",
    "CHANGEBUS_BOOTSTRAP_SERVICE_PORT_HTTP": "8471",
    "CHANGEBUS_BOOTSTRAP_PORT": "tcp://10.96.0.7:8471",
    "CHANGEBUS_BOOTSTRAP_PORT_8471_TCP": "tcp://10.96.0.7:8471",
    "CHANGEBUS_BOOTSTRAP_PORT_8471_TCP_PROTO": "tcp",
    "CHANGEBUS_BOOTSTRAP_PORT_8471_TCP_PORT": "8471",
    "CHANGEBUS_BOOTSTRAP_PORT_8471_TCP_ADDR": "10.96.0.7",
    "CHANGEBUS_BOOTSTRAP_METRICS_SERVICE_HOST": "10.96.0.8",
    "CHANGEBUS_BOOTSTRAP_METRICS_PORT_9102_UDP_ADDR": "10.96.0.8",
}


def test_kubernetes_service_links_are_skipped(caplog: pytest.LogCaptureFixture) -> None:
    """A Service named changebus-bootstrap made every pod of the namespace fail its
    ``--check`` with "unknown config key port" (review): service-link variables that
    are no config key are skipped (debug line, name only); real keys and other
    unknown names are not."""
    from changebus.bootstrap import BootstrapConfig
    from changebus.relay import RelayConfig

    env = {
        **SERVICE_LINKS,
        "CHANGEBUS_BOOTSTRAP_RELAYS": '["http://127.0.0.1:8470"]',
        "CHANGEBUS_BOOTSTRAP_HTTP__PORT": "9000",  # ends in _PORT, and is http.port
    }
    with caplog.at_level(logging.DEBUG, logger="changebus.schemas"):
        cfg = load_config(BootstrapConfig, env=env, env_prefix="CHANGEBUS_BOOTSTRAP_")
    assert cfg.http.port == 9000 and cfg.relays == ("http://127.0.0.1:8470",)
    skipped = {
        r.getMessage().split()[2] for r in caplog.records if "service link" in r.getMessage()
    }
    assert skipped == set(SERVICE_LINKS)
    assert "10.96.0" not in caplog.text  # names, not values
    relay_links = {k.replace("BOOTSTRAP", "RELAY", 1): v for k, v in SERVICE_LINKS.items()}
    assert load_config(RelayConfig, env=relay_links, env_prefix="CHANGEBUS_RELAY_") == (
        load_config(RelayConfig, env={})
    )
    # a config key of that form is a key
    assert load_config(Port, env={"CB_PORT": "9"}, env_prefix="CB_").port == 9
    # names of no other form still fail, naming the nearest key
    for name, message in (
        ("CHANGEBUS_BOOTSTRAP_HTTP__PROT", "did you mean http.port"),
        ("CHANGEBUS_BOOTSTRAP_PORTS", "unknown config key ports"),
        ("CHANGEBUS_BOOTSTRAP_PORT_8471_HTTP", "unknown config key port_8471_http"),
        # a service link's name without a service link's value: a typo (one _ for two),
        # refused, not skipped (review)
        ("CHANGEBUS_BOOTSTRAP_HTTP_PORT", "unknown config key http_port"),
        ("CHANGEBUS_BOOTSTRAP_PARTITIONS__PORT", "partitions"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config(BootstrapConfig, env={**env, name: "1"}, env_prefix="CHANGEBUS_BOOTSTRAP_")


@dataclass(frozen=True)
class Port:
    port: int = 0


def test_env_values_of_string_keys_stay_text() -> None:
    """CHANGEBUS_RELAY_CLUSTER__ZK_PASSWORD=123456 became the integer 123456 and was
    refused (review): a string key takes the variable's text as it is, whatever TOML
    would read in it; keys of other types still parse."""
    from changebus.bootstrap import BootstrapConfig
    from changebus.relay import RelayConfig

    env = {
        "CHANGEBUS_RELAY_CLUSTER__ZOOKEEPER": "127.0.0.1:2181",
        "CHANGEBUS_RELAY_CLUSTER__NAME": "2024-01-01",  # a TOML date
        "CHANGEBUS_RELAY_CLUSTER__MEMBER_ID": "0x1F",  # a TOML integer (31)
        "CHANGEBUS_RELAY_CLUSTER__ZK_USER": "true",  # a TOML boolean
        "CHANGEBUS_RELAY_CLUSTER__ZK_PASSWORD": "123456",  # a secret field
        "CHANGEBUS_RELAY_UPSTREAM__TOKEN": '"quoted' + "q" * 30 + '"',  # taken with its quotes
        "CHANGEBUS_RELAY_DATA_DIR": "1e3",  # a Path
        "CHANGEBUS_RELAY_HTTP__PORT": "9000",
        "CHANGEBUS_RELAY_HTTP__MAX_COPY_BYTES": "64MiB",
        "CHANGEBUS_RELAY_CLUSTER__ZK_WORLD_READABLE": "false",
        "CHANGEBUS_RELAY_CLUSTER__LEASE_FRACTION": "0.25",
    }
    cfg = load_config(RelayConfig, env=env, env_prefix="CHANGEBUS_RELAY_")
    assert cfg.cluster is not None
    assert cfg.cluster.name == "2024-01-01" and cfg.cluster.member_id == "0x1F"
    assert cfg.cluster.zk_user == "true" and cfg.cluster.zk_password == "123456"
    assert cfg.upstream.token == '"quoted' + "q" * 30 + '"' and cfg.data_dir == Path("1e3")
    assert cfg.http.port == 9000 and cfg.http.max_copy_bytes == 64 << 20
    assert cfg.cluster.zk_world_readable is False and cfg.cluster.lease_fraction == 0.25
    # items of a list of strings: text, unless the value is a TOML array
    boot = {"CHANGEBUS_BOOTSTRAP_RELAYS": '["http://127.0.0.1:8470"]'}
    for text, partitions in (("1", ("1",)), ("1,2", ("1", "2")), ('["3", "x"]', ("3", "x"))):
        env = {**boot, "CHANGEBUS_BOOTSTRAP_PARTITIONS": text}
        cfg2 = load_config(BootstrapConfig, env=env, env_prefix="CHANGEBUS_BOOTSTRAP_")
        assert cfg2.partitions == partitions, text
    # --set keeps TOML's reading: a number for a string key is refused, quoted it passes
    with pytest.raises(ConfigError, match=r"cluster\.zk_password: bad value"):
        load_config(RelayConfig, env={}, overrides=[*_ZK, "cluster.zk_password=123456"])
    cfg = load_config(RelayConfig, env={}, overrides=[*_ZK, 'cluster.zk_password="123456"'])
    assert cfg.cluster is not None and cfg.cluster.zk_password == "123456"


_ZK = [
    "cluster.zookeeper=127.0.0.1:2181",
    "cluster.name=c",
    "cluster.member_id=m",
    "cluster.zk_user=cb",
]


def test_keys_inside_arrays_of_tables_have_no_override(tmp_path: Path) -> None:
    """What docs/operations.md says: an array of tables is overridden whole or not at all;
    an override of a key inside one is an error, never silently dropped."""
    from changebus.relay import RelayConfig

    path = tmp_path / "relay.toml"
    path.write_text('[[partitions]]\nname = "a"\nid = 1\n')
    prefix = "CHANGEBUS_RELAY_"
    with pytest.raises(ConfigError, match=r"partitions\.0\.name"):
        load_config(RelayConfig, path, env={f"{prefix}PARTITIONS__0__NAME": "b"}, env_prefix=prefix)
    with pytest.raises(ConfigError, match=r"partitions\.0\.name"):
        load_config(RelayConfig, path, env={}, overrides=["partitions.0.name=b"])
    whole = {f"{prefix}PARTITIONS": '[{name = "b", id = 2}]'}
    cfg = load_config(RelayConfig, path, env=whole, env_prefix=prefix)
    assert [(p.name, p.id) for p in cfg.partitions] == [("b", 2)]


@dataclass(frozen=True)
class Files:
    ca_file: Path | None = None
    data_dir: Path = Path("var")
    buffer_bytes: int = size_field(1 << 20)


def test_a_float_size_and_an_empty_path() -> None:
    """Found by review: a float size (TOML ``6.4e7``, env ``1e8``) raised a TypeError (a
    traceback, not the one-line config error), and ``""`` for an optional path became
    ``Path(".")`` (the working directory) instead of clearing it."""
    cfg = load_config(Files, env={}, overrides=["buffer_bytes=6.4e7", 'ca_file=""'])
    assert (cfg.buffer_bytes, cfg.ca_file) == (64_000_000, None)
    cfg = load_config(Files, env={"X_BUFFER_BYTES": "1e8"}, env_prefix="X_")
    assert cfg.buffer_bytes == 100_000_000
    with pytest.raises(ConfigError, match="whole number"):
        load_config(Files, env={}, overrides=["buffer_bytes=1.5"])
    with pytest.raises(ConfigError, match="empty string"):
        load_config(Files, env={}, overrides=['data_dir=""'])


def test_a_secret_read_from_a_file_later_is_scrubbed_by_formatters_built_before(
    tmp_path: Path,
) -> None:
    """The daemons build their log formatters, with the config's secrets, before any
    secret file is read (cluster.zk_password_file, the MySQL password_file, the upstream
    token file): those passwords were hidden by patterns only (review)."""
    from changebus.schemas._logsetup import _JsonFormatter, _TextFormatter
    from changebus.schemas.config import read_secret_file

    text, structured = _TextFormatter(()), _JsonFormatter(())  # (built first)
    path = tmp_path / "zk-password"
    path.write_text("zk-Pa55-read-later\n")
    assert read_secret_file(path, "cluster.zk_password_file") == "zk-Pa55-read-later"
    record = logging.LogRecord(
        "changebus.test",
        logging.ERROR,
        __file__,
        1,
        "auth failed for %s",
        ("zk-Pa55-read-later",),
        None,
    )
    assert "zk-Pa55-read-later" not in text.format(record)
    assert "zk-Pa55-read-later" not in structured.format(record)


def test_a_bootstrap_catchup_ratio_of_inf_is_refused() -> None:
    from changebus.bootstrap import BootstrapConfig

    with pytest.raises(ConfigError, match="catchup_ratio: expected a finite number"):
        load_config(BootstrapConfig, env={}, overrides=["catchup_ratio=inf"])
