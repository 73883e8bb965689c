"""ChangeEvent as the decoder builds it (through its mutable twin) is a plain ChangeEvent."""

from __future__ import annotations

import dataclasses

import pytest

from changebus.client import ChangeEvent, ChangeOp
from changebus.client._model import _EventTwin, _new_event

ARGS = (5, 2, ChangeOp.UPDATE, "public.t", {"id": 1}, {"id": 1, "v": "b"}, {"id": 1, "v": "a"},
        ("x",), (), 123, 7, 3, None)  # fmt: skip


def test_twin_has_the_same_fields_and_slots() -> None:
    ours = [(f.name, f.type, f.default, f.compare, f.repr) for f in dataclasses.fields(ChangeEvent)]
    twin = [(f.name, f.type, f.default, f.compare, f.repr) for f in dataclasses.fields(_EventTwin)]
    assert ours == twin
    assert ChangeEvent.__slots__ == _EventTwin.__slots__


def test_fast_built_event_equals_a_normal_one_and_stays_frozen() -> None:
    fast = _new_event(*ARGS)
    normal = ChangeEvent(*ARGS)
    assert type(fast) is ChangeEvent
    assert fast == normal and repr(fast) == repr(normal)
    assert fast.dedupe_key == (5, 2)
    assert dataclasses.replace(fast, scn=6).scn == 6
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.scn = 9  # type: ignore[misc]
