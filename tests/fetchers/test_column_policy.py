"""ColumnPolicy on its own: parsing, the canonical text of hashed values, table plans."""

from __future__ import annotations

import datetime
import decimal
import hashlib
import hmac
import logging
import uuid
from pathlib import Path

import pytest

from changebus.fetchers import ColumnPolicy, ColumnRule, canonical_bytes
from changebus.schemas import Column, ConfigError, SourceConfigError, TableSchema

KEY = "k" * 40


def test_canonical_bytes_of_each_kind_of_value() -> None:
    assert canonical_bytes("héllo") == "héllo".encode()
    assert canonical_bytes(-7) == b"-7"
    assert canonical_bytes(decimal.Decimal("18446744073709551615")) == b"18446744073709551615"
    assert canonical_bytes(decimal.Decimal("1.50")) == b"1.50"
    assert canonical_bytes(b"\x00\xff") == b"\x00\xff"
    assert canonical_bytes(memoryview(b"ab")) == b"ab"
    assert canonical_bytes(True) == b"true"
    u = uuid.UUID("12345678-1234-5678-1234-567812345678")
    assert canonical_bytes(u) == b"12345678-1234-5678-1234-567812345678"
    assert canonical_bytes(datetime.date(2024, 2, 29)) == b"2024-02-29"


def test_rules() -> None:
    rule = ColumnRule("hash", key=KEY.encode())
    want = hmac.new(KEY.encode(), b"42", hashlib.sha256).hexdigest()
    assert rule.apply(42) == rule.apply("42") == want
    assert rule.apply(None) is None and rule.label == "hmac-sha256"
    assert KEY not in repr(rule)
    cut = ColumnRule("truncate", 3)
    assert cut.apply("ééééé") == "ééé" and cut.apply(b"abcdef") == b"abc"
    assert cut.apply(None) is None and cut.label == "truncate:3"


def test_a_file_holds_the_table(tmp_path: Path) -> None:
    path = tmp_path / "columns.toml"
    path.write_text('["public.users"]\nemail = "hash"\nssn = "exclude"\n')
    policy = ColumnPolicy.parse(None, KEY, file=path)
    assert policy.rules_for("public.users")["ssn"] == ColumnRule("exclude")
    with pytest.raises(ConfigError, match="not both"):
        ColumnPolicy.parse({"a.b": {"c": "exclude"}}, KEY, file=path)
    assert not ColumnPolicy.parse(None) and not ColumnPolicy.parse({})


def test_the_key_from_the_environment() -> None:
    policy = ColumnPolicy.parse({"a.b": {"c": "hash"}}, "", "K", environ={"K": KEY})
    assert policy.rules_for("a.b")["c"].apply("x") == ColumnRule("hash", key=KEY.encode()).apply(
        "x"
    )
    with pytest.raises(ConfigError, match=r"'K'.*not set"):
        ColumnPolicy.parse({"a.b": {"c": "hash"}}, "", "K", environ={"K": ""})


COLUMNS = (
    Column("id", "long", nullable=False, source_type="bigint"),
    Column("email", "string", source_type="text"),
    Column("n", "int", source_type="integer"),
    Column("pic", "bytes", source_type="bytea"),
)


def test_a_plan_and_its_schema(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    policy = ColumnPolicy.parse(
        {"s.t": {"id": "hash", "email": "exclude", "pic": "truncate:9", "nope": "exclude"}}, KEY
    )
    assert policy.plan("s.other", COLUMNS, ("id",)) is None
    plan = policy.plan("s.t", COLUMNS, ("id",))
    assert plan is not None and plan.excluded == {"email"}
    assert [c.name for c in plan.columns] == ["id", "n", "pic"]
    assert plan.columns[0] == Column("id", "string", False, "bigint", "hmac-sha256")
    schema = TableSchema("s.t", plan.columns, ("id",))
    assert TableSchema.from_json(schema.to_json()) == schema
    assert schema.row_schema["fields"][2]["changebus.policy"] == "truncate:9"
    plain = TableSchema("s.t", COLUMNS, ("id",))
    assert schema.fingerprint != plain.fingerprint
    assert "policy" not in str(plain.to_json())  # unchanged JSON without a policy
    policy.check_schema(schema)
    with pytest.raises(SourceConfigError, match=r"s\.t\.id.*column_policy"):
        ColumnPolicy().check_schema(schema)
    policy.plan("s.t", COLUMNS, ("id",))
    assert caplog.text.count("s.t.nope") == 1  # warned once


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        ({"id": "exclude"}, r"s\.t\.id: exclude is refused on a key column"),
        ({"id": "truncate:3"}, r"s\.t\.id: truncate is refused on a key column"),
        ({"n": "truncate:3"}, r"s\.t\.n: truncate applies to text and binary columns"),
        ({c.name: "exclude" for c in COLUMNS[1:]} | {"id": "hash"}, None),
    ],
)
def test_refused_plans(rules: dict[str, str], message: str | None) -> None:
    policy = ColumnPolicy.parse({"s.t": rules}, KEY)
    if message is None:
        assert policy.plan("s.t", COLUMNS, ("id",)) is not None
        with pytest.raises(SourceConfigError, match="every column"):
            ColumnPolicy.parse({"s.t": {c.name: "exclude" for c in COLUMNS}}).plan(
                "s.t", COLUMNS, ()
            )
        return
    with pytest.raises(SourceConfigError, match=message):
        policy.plan("s.t", COLUMNS, ("id",))
