"""The assembler's event-by-event path for small responses equals its vectorised path.

Same windows (bodies, offsets, headers) and the same first error, for valid
streams cut anywhere and for streams with a flipped byte, a window's events
out of order, or a window left open.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from changebus.client import _assembler
from changebus.client._assembler import EventSplitter, WindowAssembler
from changebus.schemas import (
    CorruptEventError,
    EndOfWindow,
    Op,
    encode_control,
    encode_event,
    key_hash,
)


def window(scn: int, sizes: list[int], *, close: bool = True) -> list[bytes]:
    events = []
    for i, size in enumerate(sizes):
        key = f"k{scn}-{i}".encode()
        events.append(
            encode_event(
                Op.UPDATE, scn, i, scn * 10, key, bytes([i % 251]) * size, key_hash=key_hash(key)
            )
        )
    if close:
        events.append(encode_control(EndOfWindow(len(sizes), f"p{scn}"), scn, len(sizes), scn))
    return events


def run(chunks: list[bytes], small: int, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    monkeypatch.setattr(_assembler, "SMALL_EVENTS", small)
    splitter, assembler = EventSplitter(), WindowAssembler()
    out: list[Any] = []
    try:
        for chunk in chunks:
            complete, offsets = splitter.split(chunk)
            for raw in assembler.feed(complete, offsets):
                out.append(
                    (
                        raw.scn,
                        raw.timestamp_ns,
                        raw.body,
                        raw.offsets.tolist(),
                        raw.headers.tobytes(),
                    )
                )
        out.append(("pending", assembler.in_window, assembler.last_scn))
    except CorruptEventError as exc:
        out.append(("error", exc.message, exc.retriable))
    return out


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(st.lists(st.integers(0, 300), max_size=6), min_size=1, max_size=12),
    st.sampled_from(["none", "flip", "swap", "open", "repeat"]),
    st.data(),
)
def test_small_and_vectorised_paths_agree(monkeypatch, spec, damage, data) -> None:
    events: list[bytes] = []
    for i, sizes in enumerate(spec):
        events += window((i + 1) * 5, sizes, close=not (damage == "open" and i == 0))
    if damage == "swap" and len(events) > 2:
        j = data.draw(st.integers(0, len(events) - 2))
        events[j], events[j + 1] = events[j + 1], events[j]
    if damage == "repeat":
        events += window(5, [3])  # an SCN that does not increase
    stream = bytearray(b"".join(events))
    if damage == "flip":
        at = data.draw(st.integers(0, len(stream) - 1))
        stream[at] ^= 1 << data.draw(st.integers(0, 7))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=5)))
    chunks = [bytes(stream[a:b]) for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    small = run(chunks, 64, monkeypatch)
    assert small == run(chunks, 0, monkeypatch)
    if damage == "none":
        assert small[-1] == ("pending", False, len(spec) * 5)
