"""The one JSON form of decoded values (the relay's ndjson, ``changebus tail``, the
replicas' JSON columns): strict JSON, whatever a row holds."""

from __future__ import annotations

import datetime
import decimal
import json
import math
import uuid
from typing import Any

import pytest

from changebus.client._json import event_json
from changebus.client._model import ChangeEvent, ChangeOp
from changebus.schemas import json_text


def _strict(text: str) -> Any:
    def refuse(token: str) -> Any:
        raise AssertionError(f"not JSON: {token}")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (math.nan, "NaN"),
        (math.inf, "Infinity"),
        (-math.inf, "-Infinity"),
    ],
)
def test_non_finite_floats_are_text_as_decimals_are(value: float, shown: str) -> None:
    """Python wrote bare NaN / Infinity tokens: jq, JSON.parse and Postgres' jsonb refuse
    the whole line or row (review)."""
    doc = {"f": value, "arr": [1.5, value, {"deep": (value,)}], "d": decimal.Decimal(shown)}
    out = _strict(json_text(doc))
    assert out == {"f": shown, "arr": [1.5, shown, {"deep": [shown]}], "d": shown}


def test_other_values_keep_their_form() -> None:
    u = uuid.uuid4()
    doc = {
        "b": b"\x00\x01",
        "u": u,
        "t": datetime.date(2026, 12, 1),
        "x": 2.5,
        "n": None,
        "s": {1},
    }
    assert _strict(json_text(doc)) == {
        "b": "AAE=",
        "u": str(u),
        "t": "2026-12-01",
        "x": 2.5,
        "n": None,
        "s": [1],
    }
    assert json_text({"a": 1}) == '{"a":1}'


def test_changebus_tail_lines_are_strict_json() -> None:
    ev = ChangeEvent(
        scn=7,
        seq=0,
        op=ChangeOp.UPDATE,
        table="public.t",
        key={"id": 1},
        after={"id": 1, "f": math.nan},
        before={"id": 1, "f": -math.inf},
    )
    line = _strict(event_json(ev))
    assert (line["after"]["f"], line["before"]["f"]) == ("NaN", "-Infinity")
