"""ChangeEvent as the decoder builds it (through its mutable twin) is a plain ChangeEvent."""

from __future__ import annotations

import dataclasses

import pytest

from changebus.client import ChangeEvent, ChangeOp, MemoryCheckpointPersister
from changebus.client._model import Window, _EventTwin, _new_event
from changebus.client._position import PositionTracker
from changebus.schemas import (
    BootstrapProgress,
    Checkpoint,
    CheckpointError,
    Mode,
    PartitionCheckpoint,
)

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


async def test_a_relay_window_after_a_bootstrap_commits_an_online_position() -> None:
    """``auto_commit=False`` and a commit now and then: the catch-up's last window
    (carrying the online checkpoint) may be passed over uncommitted, so the first
    relay window committed follows a snapshot-mode position. It must not inherit
    that mode: a restart would have replayed the snapshot from its old page."""
    persister = MemoryCheckpointPersister()
    tracker = PositionTracker(Checkpoint({}), persister)
    progress = BootstrapProgress(since_scn=-1, start_scn=100, snapshot_position="p1", server="b")
    snapshot = PartitionCheckpoint(mode=Mode.SNAPSHOT, bootstrap=progress)
    tracker.advance(Window(100, 0, "p", phase="snapshot", checkpoint=snapshot))
    await tracker.persist()
    assert tracker.committed.get("p").mode is Mode.SNAPSHOT
    tracker.advance(Window(130, 77, "p"))  # the catch-up's last window was skipped
    await tracker.persist()
    committed = tracker.committed.get("p")
    assert committed == PartitionCheckpoint(window_scn=130, prev_scn=130, timestamp_ns=77)
    saved = await persister.load()
    assert saved is not None and saved.get("p") == committed
    # and a relay window older than a catch-up's position is refused, not taken
    catchup = PartitionCheckpoint(
        mode=Mode.CATCHUP,
        window_scn=150,
        prev_scn=150,
        bootstrap=BootstrapProgress(since_scn=-1, start_scn=100, target_scn=200, server="b"),
    )
    with pytest.raises(CheckpointError, match="goes back"):
        Window(140, 0, "p").position_after(catchup)
