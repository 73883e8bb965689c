"""Checkpoints: JSON, token and dict forms; invariants; garbage rejected."""

from __future__ import annotations

import base64
import json
import zlib

import pytest
from hypothesis import given, strategies as st

from changebus.schemas import (
    BootstrapProgress,
    Checkpoint,
    CheckpointError,
    Mode,
    PartitionCheckpoint,
)

scn = st.integers(-1, 2**63 - 1)
names = st.from_regex(r"[A-Za-z0-9_.-]{1,20}", fullmatch=True)


@st.composite
def partition_checkpoints(draw: st.DrawFn) -> PartitionCheckpoint:
    mode = draw(st.sampled_from(list(Mode)))
    window = draw(st.integers(-1, 2**62))
    offset = draw(st.integers(-1, 1000)) if window >= 0 else -1
    prev = draw(st.integers(-1, window)) if window >= 0 else -1
    bootstrap = None
    if mode is not Mode.ONLINE:
        start = draw(st.integers(0 if mode is Mode.CATCHUP else -1, 2**61))
        target = (
            draw(st.integers(start, 2**62)) if mode is Mode.CATCHUP or draw(st.booleans()) else -1
        )
        if start < 0:
            target = -1
        bootstrap = BootstrapProgress(
            since_scn=draw(st.integers(-1, 2**62)),
            start_scn=start,
            target_scn=target,
            source=draw(st.text(max_size=10)),
            source_index=draw(st.integers(0, 5)),
            snapshot_position=draw(st.none() | st.text(max_size=20)) if start >= 0 else None,
            server=draw(st.none() | st.just("http://127.0.0.1:8480")),
        )
    return PartitionCheckpoint(mode, window, offset, prev, draw(st.integers(0, 2**62)), bootstrap)


checkpoints = st.dictionaries(names, partition_checkpoints(), max_size=4).map(Checkpoint)


@given(checkpoints)
def test_round_trips(cp: Checkpoint) -> None:
    assert Checkpoint.from_json(cp.to_json()) == cp
    assert Checkpoint.parse(cp.to_json()) == cp
    token = cp.to_token()
    assert token.startswith(("cb1.", "cb1z."))
    assert all(c.isalnum() or c in "._-" for c in token)  # URL-safe
    assert Checkpoint.parse(token) == cp
    d = cp.to_dict()
    assert json.loads(json.dumps(d)) == d  # JSON primitives only
    assert Checkpoint.from_dict(d) == cp
    assert cp.to_json() == json.dumps(cp.to_dict(), separators=(",", ":"), sort_keys=True)


def test_compact_json_omits_defaults() -> None:
    cp = Checkpoint({"pg": PartitionCheckpoint(window_scn=42)})
    assert cp.to_json() == '{"partitions":{"pg":{"window_scn":42}},"v":1}'
    assert Checkpoint().get("anything") == PartitionCheckpoint()


def test_window_progress() -> None:
    pc = PartitionCheckpoint()
    pc = pc.on_event(10)
    assert (pc.window_scn, pc.window_offset) == (10, 1)
    pc = pc.on_event(10).on_event(10)
    assert pc.window_offset == 3 and not pc.is_window_complete
    assert pc.rollback() == PartitionCheckpoint()  # nothing complete yet
    pc = pc.on_end_of_window(10, 777)
    assert (pc.window_scn, pc.window_offset, pc.prev_scn, pc.timestamp_ns) == (10, -1, 10, 777)
    pc2 = pc.on_event(12)
    assert pc2.rollback() == pc
    with pytest.raises(CheckpointError, match="goes back"):
        pc.on_event(9)
    with pytest.raises(CheckpointError, match="goes back"):
        pc.on_event(10)  # window 10 was complete


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("", "must start with"),
        ("{", "not valid JSON"),
        ("[]", "JSON object"),
        ('{"v":2,"partitions":{}}', "version"),
        ('{"v":1,"partitions":{"p":{"window_scn":"7"}}}', "integer"),
        ('{"v":1,"partitions":{"p":{"window_scn":-5}}}', "within"),
        ('{"v":1,"partitions":{"p":{"window_offset":3}}}', "needs a window_scn"),
        ('{"v":1,"partitions":{"p":{"window_scn":5,"prev_scn":9}}}', "after window_scn"),
        ('{"v":1,"partitions":{"p":{"mode":"sideways"}}}', "unknown checkpoint mode"),
        ('{"v":1,"partitions":{"p":{"mode":"bootstrap-catchup"}}}', "needs bootstrap"),
        ('{"v":1,"partitions":{"p":{"colour":1}}}', "unknown checkpoint field"),
        ('{"v":1,"partitions":{"bad name!":{}}}', "partition name"),
        ('{"v":1,"extra":1}', "unknown checkpoint field"),
        ("cb1.!!!!", "base64"),
        ("cb1z." + base64.urlsafe_b64encode(b"not zlib").decode(), "base64url/zlib"),
        ("cb9.abc", "must start with"),
        ("{" + " " * 70000 + "}", "longer than"),
        # wrong JSON types that Python let through (review)
        ('{"v":true,"partitions":{}}', "version"),
        (
            '{"v":1,"partitions":{"p":{"mode":"bootstrap-snapshot","bootstrap":{"source":null}}}}',
            "source must be a string",
        ),
    ],
)
def test_garbage_is_rejected(text: str, needle: str) -> None:
    with pytest.raises(CheckpointError) as info:
        Checkpoint.parse(text)
    assert needle in info.value.message


def test_decompression_bomb_is_refused() -> None:
    bomb = zlib.compress(b'{"v":1,"partitions":{}' + b" " * 5_000_000 + b"}", 9)
    token = "cb1z." + base64.urlsafe_b64encode(bomb).decode().rstrip("=")
    assert len(token) < 64 * 1024
    with pytest.raises(CheckpointError, match="size limit"):
        Checkpoint.from_token(token)


def test_a_5000_digit_number_is_a_checkpoint_error() -> None:
    text = '{"v":1,"partitions":{"p":{"window_scn":' + "9" * 5000 + "}}}"
    with pytest.raises(CheckpointError) as info:
        Checkpoint.parse(text)
    assert not info.value.retriable
    token = "cb1." + base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")
    with pytest.raises(CheckpointError):
        Checkpoint.parse(token)


LONG = "9" * 4000  # under Python's 4,300-digit int() limit: it must not get that far


@pytest.mark.parametrize(
    "body",
    [
        '{"v":1,"partitions":{"p":{"window_scn":' + LONG + "}}}",
        '{"v":1,"partitions":{"p":{"window_scn":-' + LONG + "}}}",
        '{"v":1,"partitions":{"p":{"timestamp_ns":' + "9" * 5000 + "}}}",
        '{"v":' + LONG + ',"partitions":{}}',
        '{"v":1,"partitions":{"p":{"mode":"bootstrap-snapshot","bootstrap":{"source_index":'
        + LONG
        + "}}}}",
        '{"v":1,"partitions":{"p":{"window_scn":1' + "0" * 400 + ".5}}}",
        '{"v":1,"partitions":{"p":{"window_scn":1e99999}}}',
        '{"v":1,"partitions":{"p":{"window_scn":"' + LONG + '"}}}',
        '{"v":1,"partitions":{"p":{"mode":"' + LONG + '"}}}',
        '{"v":1,"partitions":{"' + LONG + '":{}}}',
        '{"v":1,"partitions":{"p":{"' + LONG + '":1}}}',
        '{"v":"' + LONG + '","partitions":{}}',
    ],
)
@pytest.mark.parametrize("form", ["json", "token"])
def test_long_numbers_and_strings_are_short_checkpoint_errors(body: str, form: str) -> None:
    """Every number has at most MAX_DIGITS digits; no error message echoes a long value."""
    text = body if form == "json" else "cb1." + base64.urlsafe_b64encode(body.encode()).decode()
    with pytest.raises(CheckpointError) as info:
        Checkpoint.parse(text)
    assert not info.value.retriable
    assert len(info.value.message) < 300


def test_twenty_digit_numbers_still_parse() -> None:
    cp = Checkpoint.parse('{"v":1,"partitions":{"p":{"window_scn":9223372036854775807}}}')
    assert cp.get("p").window_scn == 2**63 - 1
    with pytest.raises(CheckpointError, match="within"):
        Checkpoint.parse('{"v":1,"partitions":{"p":{"window_scn":99999999999999999999}}}')
