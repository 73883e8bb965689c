"""The MySQL fetcher's password file and connection options: parsing, errors, redaction.

No server: what the options mean before a connection is opened (the TLS
connections themselves: test_mysql_tls.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from changebus.bootstrap import BootstrapConfig
from changebus.fetchers._check import mysql_options_from_dsn
from changebus.fetchers.mysql import MySQLConfig
from changebus.fetchers.mysql._connect import connection_args
from changebus.relay import RelayConfig
from changebus.schemas import ConfigError
from changebus.schemas.config import load_config, redacted

PASSWORD = "file-Pw-5d2a"


def test_the_password_file_is_read_at_start_without_its_newline(tmp_path: Path) -> None:
    path = tmp_path / "pw"
    path.write_text(PASSWORD + "\n")
    config = MySQLConfig(password_file=str(path))
    assert config.password == ""  # not read when the config is built
    resolved = config.resolved()
    assert resolved.password == PASSWORD and resolved.password_file == ""
    assert resolved.resolved() is resolved  # nothing read again
    assert connection_args(config)["password"] == PASSWORD
    assert "ssl" not in connection_args(config)  # no TLS options: PyMySQL's default
    assert PASSWORD not in repr(resolved) and PASSWORD not in str(redacted(resolved))
    assert redacted(config)["password_file"] == str(path)  # where it is: not a secret


def test_password_and_password_file_exclude_each_other() -> None:
    with pytest.raises(ConfigError, match="password or password_file, not both"):
        MySQLConfig(password=PASSWORD, password_file="/etc/changebus/mysql.pw")


@pytest.mark.parametrize("content", [None, "", " \n", b"\xff\xfe" + PASSWORD.encode()])
def test_an_unreadable_password_file_names_the_path_never_the_content(
    tmp_path: Path, content: str | bytes | None
) -> None:
    path = tmp_path / "pw"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match="password_file") as info:
        MySQLConfig(password_file=str(path)).resolved()
    assert str(path) in info.value.message
    assert PASSWORD not in info.value.message


def test_tls_options_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tls_key_file needs tls_cert_file"):
        MySQLConfig(tls_key_file="/k.pem")
    with pytest.raises(ConfigError, match="tls_check_hostname = false needs TLS"):
        MySQLConfig(tls_check_hostname=False)
    assert not MySQLConfig().tls and MySQLConfig(require_tls=True).tls
    assert MySQLConfig(tls_ca_file="/ca.pem").tls
    missing = tmp_path / "nope.pem"
    with pytest.raises(ConfigError, match=f"tls_ca_file {missing}: cannot load"):
        connection_args(MySQLConfig(tls_ca_file=str(missing), password=PASSWORD))


def test_a_dsn_carries_the_connection_options_as_query_parameters() -> None:
    dsn = "mysql://cdc:p%40ss@db:3307/shop?tls_ca_file=/etc/ca.pem&tls_check_hostname=false"
    options = mysql_options_from_dsn(dsn)  # changebus check-source --dsn
    assert options == {
        "host": "db",
        "port": 3307,
        "user": "cdc",
        "password": "p@ss",
        "databases": ["shop"],
        "tls_ca_file": "/etc/ca.pem",
        "tls_check_hostname": "false",
    }
    config = MySQLConfig.from_dsn("mysql://cdc@db?password_file=/etc/pw&require_tls=true")
    assert config.password_file == "/etc/pw" and config.require_tls
    for bad, why in [
        ("mysql://cdc@db?password=x", "query parameter password is not one of"),
        ("mysql://cdc@db?tls_ca_file=a&tls_ca_file=b", "given twice"),
        ("mysql://cdc:secret@db?password_file=/etc/pw", "not both"),
        ("mysql://cdc@db?x", "malformed query"),
    ]:
        with pytest.raises(ConfigError, match=why) as info:
            MySQLConfig.from_dsn(bad, "seed.dsn")
        assert info.value.message.startswith("seed.dsn") and "secret" not in info.value.message


def test_relay_and_bootstrap_configs_take_the_options(tmp_path: Path) -> None:
    relay = tmp_path / "relay.toml"
    relay.write_text(
        """
[[partitions]]
name = "shop"
id = 1
[partitions.fetcher]
kind = "mysql"
options = { host = "db", password_file = "/etc/changebus/mysql.pw", tls_ca_file = "/etc/ca.pem" }
"""
    )
    options = load_config(RelayConfig, relay).partitions[0].fetcher.options
    config = MySQLConfig(**options)
    assert config.password_file == "/etc/changebus/mysql.pw" and config.tls
    boot = tmp_path / "bootstrap.toml"
    boot.write_text(
        """
relays = ["http://127.0.0.1:8470"]
[seed]
kind = "mysql"
dsn = "mysql://cdc:inline@db:3306?password_file=/etc/changebus/mysql.pw"
"""
    )
    with pytest.raises(ConfigError, match=r"seed\.dsn: .*not both") as info:
        load_config(BootstrapConfig, boot)
    assert "inline" not in info.value.message
