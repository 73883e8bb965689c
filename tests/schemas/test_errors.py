"""The error tree's round trip: a daemon's JSON body back into the same exception."""

from __future__ import annotations

import pickle

import pytest

from changebus.schemas import (
    BadRequestError,
    BootstrapFailedError,
    ChangebusError,
    CheckpointError,
    CorruptEventError,
    NotYetError,
    OverwrittenError,
    SchemaChangedError,
    SchemaChangeRefusedError,
    ScnNotFoundError,
    TransportError,
    UnknownSourceError,
)


@pytest.mark.parametrize(
    "error",
    [
        BadRequestError("max_bytes must be positive"),
        CheckpointError("bad token"),
        OverwrittenError("the writer overtook this reader"),
        ScnNotFoundError("too old", oldest_scn=7, prev_scn=6),
        NotYetError("retry soon"),
        BootstrapFailedError("history too short"),
        UnknownSourceError("no partition 'x'"),
        CorruptEventError("crc mismatch", retriable=True),
        SchemaChangedError("t v1 -> v2: added ['c']", changes=[{"table": "t"}], at={"p": 7}),
        SchemaChangeRefusedError("t v2 -> v3: dropped ['n']", needs=["drop"]),
        ChangebusError("boom"),
    ],
)
def test_to_json_and_back_gives_the_same_class_verdict_and_details(error: ChangebusError) -> None:
    back = ChangebusError.from_json(error.to_json(), status=error.http_status, where="relay x")
    assert type(back) is type(error)
    assert back.retriable == error.retriable
    assert back.details == error.details
    assert back.message == f"relay x: {error.message}"
    assert pickle.loads(pickle.dumps(back)).details == error.details


def test_the_servers_retriable_verdict_wins_over_the_class_default() -> None:
    back = ChangebusError.from_json({"error": "overwritten", "message": "m", "retriable": False})
    assert isinstance(back, OverwrittenError)
    assert back.retriable is False
    back = ChangebusError.from_json({"error": "overwritten", "message": "m", "retriable": "yes"})
    assert back.retriable is True  # not a boolean: the class default


@pytest.mark.parametrize(
    ("status", "cls", "retriable"),
    [
        (400, BadRequestError, False),
        (404, UnknownSourceError, False),
        (409, OverwrittenError, True),
        (410, ScnNotFoundError, True),
        (408, TransportError, True),
        (429, TransportError, True),
        (502, TransportError, True),
        (503, TransportError, True),
        (418, ChangebusError, False),
        (None, ChangebusError, False),
    ],
)
def test_unknown_codes_fall_back_on_the_status(
    status: int | None, cls: type[ChangebusError], retriable: bool
) -> None:
    for body in ({"error": "from_the_future", "message": "m"}, {}, {"error": 5}):
        back = ChangebusError.from_json(body, status=status)
        assert type(back) is cls
        assert back.retriable is retriable
        assert back.message


def test_every_code_names_one_class() -> None:
    seen: dict[str, type[ChangebusError]] = {}
    stack: list[type[ChangebusError]] = [ChangebusError]
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if "code" in cls.__dict__:
            assert seen.setdefault(cls.code, cls) is cls, f"code {cls.code!r} used twice"


def test_from_json_never_raises_on_odd_keys() -> None:
    """The body's other keys become details; one named like a parameter of the
    constructor ("self", "message") made it raise TypeError instead."""
    body = {"error": "overwritten", "message": "m", "self": 1, "cls": 2, "details": 3}
    back = ChangebusError.from_json(body, status=409)
    assert isinstance(back, OverwrittenError) and back.message == "m"
    assert back.details == {"self": 1, "cls": 2, "details": 3}
