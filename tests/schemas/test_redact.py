"""Secrets never shown: redacted() looks into option tables; scrub() cleans any text."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from changebus.schemas import ConfigError
from changebus.schemas._logsetup import _JsonFormatter, _TextFormatter
from changebus.schemas.config import (
    load_config_dict,
    redacted,
    scrub,
    scrub_exception,
    secret,
    secret_key,
    secret_values,
)

PASSWORD = "cb-Pa55word-7Qz"


@dataclasses.dataclass(frozen=True)
class Fetcher:
    kind: str = "postgres"
    options: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Config:
    fetchers: tuple[Fetcher, ...] = ()
    relays: tuple[str, ...] = ()
    store_dsn: str = secret("")


def config() -> Config:
    return Config(
        fetchers=(
            Fetcher(
                options={
                    "dsn": f"postgresql://cb:{PASSWORD}@db:5432/shop",
                    "slot": "changebus",
                    "column_hash_key": "hash-key-" + PASSWORD,
                    "column_hash_key_env": "CB_KEY",
                    "column_policy": {"public.users": {"email": "hash"}},
                }
            ),
            Fetcher(
                "mysql",
                {"host": "h", "user": "cb", "password": PASSWORD, "nested": {"token": PASSWORD}},
            ),
            Fetcher("relay", {"url": f"http://reader:{PASSWORD}@relay:8470"}),
            Fetcher("postgres", {"conninfo": f"host=db user=cb password={PASSWORD} dbname=x"}),
        ),
        relays=(f"https://u:{PASSWORD}@relay:8470",),
        store_dsn=f"host=db password='{PASSWORD}'",
    )


def test_redacted_masks_secrets_inside_option_tables() -> None:
    shown = redacted(config())
    text = json.dumps(shown)
    assert PASSWORD not in text
    pg = shown["fetchers"][0]["options"]
    assert pg["dsn"] == "***" and pg["column_hash_key"] == "***"
    assert pg["slot"] == "changebus" and pg["column_hash_key_env"] == "CB_KEY"  # no secret
    assert pg["column_policy"] == {"public.users": {"email": "hash"}}
    assert shown["fetchers"][1]["options"]["password"] == "***"
    assert shown["fetchers"][1]["options"]["nested"]["token"] == "***"
    assert shown["fetchers"][2]["options"]["url"] == "http://reader:***@relay:8470"
    assert "password=***" in shown["fetchers"][3]["options"]["conninfo"]
    assert shown["relays"] == ["https://u:***@relay:8470"]
    assert shown["store_dsn"] == "***"


@pytest.mark.parametrize(
    ("name", "is_secret"),
    [
        ("dsn", True),
        ("password", True),
        ("zk_password", True),
        ("passwd", True),
        ("column_hash_key", True),
        ("api_key", True),
        ("token", True),
        ("tokens", True),
        ("client_secret", True),
        ("credentials", True),
        ("column_hash_key_env", False),
        ("token_file", False),
        ("tokenFile", False),
        ("key_file", False),
        ("key_columns", False),
        ("slot", False),
        ("host", False),
    ],
)
def test_secret_key_names(name: str, is_secret: bool) -> None:
    assert secret_key(name) is is_secret


@pytest.mark.parametrize(
    "text",
    [
        f"postgresql://cb:{PASSWORD}@db:5432/shop",
        f"connection to mysql://cb:{PASSWORD}@db:3306 failed",
        f"host=db user=cb password={PASSWORD} dbname=x",
        f"host=db password = '{PASSWORD}' dbname=x",
        f"host=db password='{PASSWORD}",  # unterminated: libpq refuses it
        f"{{'password': '{PASSWORD}', 'user': 'cb'}}",
        f'{{"dsn": "{PASSWORD}"}}',
    ],
)
def test_scrub_masks_dsn_passwords_without_knowing_them(text: str) -> None:
    assert PASSWORD not in scrub(text)
    assert "***" in scrub(text)


def test_scrub_removes_known_secrets_and_the_passwords_of_known_dsns() -> None:
    spaced = f"{PASSWORD} x"  # libpq quotes it: 'unexpected spaces found in "..."'
    dsn = f"postgresql://cb:{spaced}@db/shop"
    assert scrub(f'unexpected spaces found in "{spaced}"', [dsn]) == (
        'unexpected spaces found in "***"'
    )
    encoded = "p%40ss%20" + PASSWORD  # percent-encoded in the URL, decoded in a message
    url = f"mysql://cb:{encoded}@db:3306"
    assert PASSWORD not in scrub(f"login as cb with p@ss {PASSWORD} refused", [url])
    assert scrub("nothing secret here", [dsn]) == "nothing secret here"
    assert scrub("the letter a stays", ["a"]) == "the letter a stays"  # too short to replace
    values = secret_values(config())
    assert PASSWORD in values and "hash-key-" + PASSWORD in values
    assert "CB_KEY" not in values and "changebus" not in values
    assert values == tuple(sorted(values, key=len, reverse=True))


def test_scrub_exception_and_the_daemon_log_formatters() -> None:
    try:
        raise ValueError(f'missing "=" after "{PASSWORD}" in connection info string')
    except ValueError as exc:
        assert PASSWORD not in scrub_exception(exc, [PASSWORD])
        assert PASSWORD not in scrub_exception(exc, [PASSWORD], trace=True)
        assert "Traceback" in scrub_exception(exc, [PASSWORD], trace=True)
        record = logging.LogRecord(
            "changebus.test", logging.ERROR, __file__, 1, "dsn %s", (PASSWORD,), None
        )
        record.exc_info = (type(exc), exc, exc.__traceback__)
        for formatter in (_TextFormatter([PASSWORD]), _JsonFormatter([PASSWORD])):
            line = formatter.format(record)
            assert PASSWORD not in line and "***" in line


def test_a_secret_of_the_wrong_type_is_not_quoted_in_the_config_error() -> None:
    @dataclasses.dataclass(frozen=True)
    class Options:
        dsn: str = secret("")
        api_key: str = ""
        port: int = 0

    for data in ({"dsn": 918273645}, {"api_key": ["x", 918273645]}):
        with pytest.raises(ConfigError) as info:
            load_config_dict(Options, data, "fetcher")
        assert "918273645" not in info.value.message and "secret" in info.value.message
    with pytest.raises(ConfigError, match="918273645"):  # not a secret: shown
        load_config_dict(Options, {"port": "918273645"}, "fetcher")


def test_an_empty_secret_is_shown_empty(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``token = ""`` was printed ``upstream.token = ***`` by ``--check`` and ``'dsn': ''``
    became ``'dsn': '***'``: the mask claimed a value that is not set (review). Empty
    values show as empty; set ones stay masked."""
    from changebus.schemas._cli import main
    from changebus.schemas._daemon_check import config_summary

    assert main(["relay", "--check", "--set", f"data_dir={tmp_path}/relay"]) == 0
    out = capsys.readouterr().out
    assert '  upstream.token = ""' in out.splitlines() and "***" not in out
    empty = Config(fetchers=(Fetcher(options={"dsn": "", "password": "", "slot": "s"}),))
    shown = redacted(empty)
    assert shown["store_dsn"] == ""
    assert shown["fetchers"][0]["options"] == {"dsn": "", "password": "", "slot": "s"}
    lines = config_summary(empty)
    assert 'store_dsn = ""' in lines
    assert 'fetchers[0].options.dsn = ""' in lines
    for text in (
        'upstream.token = ""',
        "upstream.token = ''",
        "host=db password='' dbname=x",
        "{'dsn': '', 'slot': 's'}",
        '{"password": "", "user": "cb"}',
    ):
        assert scrub(text) == text, text
    # a value that is set is still masked, in each of those forms
    assert scrub('upstream.token = "t0ken-x"') == "upstream.token = ***"
    assert scrub("host=db password='pw' dbname=x") == "host=db password=*** dbname=x"
    assert scrub("{'dsn': 'x', 'slot': 's'}") == "{'dsn': '***', 'slot': 's'}"
    assert scrub('{"password": "p", "user": "cb"}') == '{"password": "***", "user": "cb"}'
    assert redacted(Config(store_dsn="x"))["store_dsn"] == "***"
