"""The three ways the buffer checks appended windows (event by event for small
groups, in bulk for large ones, from the event sizes for trusted ones) apply
the same rules and refuse a broken group with the same error."""

from __future__ import annotations

from pathlib import Path

import pytest

from changebus.relay import BufferConfig, EventBuffer
from changebus.schemas import (
    BadRequestError,
    ChangebusError,
    EndOfWindow,
    EventTooLargeError,
    Op,
    encode_control,
    encode_event,
    parse_stream,
)

CAP = 1 << 20


def events(scn: int, payload: int, *, seqs: list[int] | None = None, scns: list[int] | None = None):
    """Three data events and an END_OF_WINDOW, as a list of encoded events."""
    seqs = seqs if seqs is not None else [0, 1, 2, 3]
    scns = scns if scns is not None else [scn] * 4
    out = [
        encode_event(Op.INSERT, scns[i], seqs[i], 1, b"k%d" % i, b"x" * payload) for i in range(3)
    ]
    out.append(encode_control(EndOfWindow(3, ""), scns[3], seqs[3], 1))
    return out


BROKEN = {
    "seq": lambda scn, p: [events(scn, p, seqs=[0, 2, 3, 4])],
    "mixed scn": lambda scn, p: [events(scn, p, scns=[scn, scn + 1, scn, scn])],
    "scn order": lambda scn, p: [events(scn, p), events(scn, p)],
    "no end": lambda scn, p: [events(scn, p)[:-1]],
    # two good windows, split in the wrong place: the first closes too early
    "end inside": lambda scn, p: [events(scn, p) + events(scn + 1, p)[:1], events(scn + 1, p)[1:]],
}


def refusal(tmp_path: Path, name: str, payload: int, trusted: bool) -> tuple[type, str]:
    buf = EventBuffer(tmp_path / f"{name}-{payload}-{trusted}".replace(" ", "_"), BufferConfig(CAP))
    try:
        windows = BROKEN[name](10, payload)
        data = [b"".join(w) for w in windows]
        sizes = [[len(e) for e in w] for w in windows] if trusted else None
        with pytest.raises(ChangebusError) as info:
            buf.append_windows(data, sizes=sizes)
        assert buf.meta.windows == 0
        return type(info.value), str(info.value)
    finally:
        buf.close()


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_every_path_refuses_alike(tmp_path: Path, name: str) -> None:
    small = refusal(tmp_path, name, 10, trusted=False)
    assert small[0] is BadRequestError
    assert refusal(tmp_path, name, 10, trusted=True) == small
    # over 32 KiB: checked in bulk, from a scan or from the sizes
    assert refusal(tmp_path, name, 20_000, trusted=False) == small
    assert refusal(tmp_path, name, 20_000, trusted=True) == small


@pytest.mark.parametrize("payload", [10, 20_000])
@pytest.mark.parametrize("trusted", [False, True])
def test_too_many_events_is_refused_and_counted(
    tmp_path: Path, payload: int, trusted: bool
) -> None:
    buf = EventBuffer(tmp_path, BufferConfig(CAP, event_slots=3))
    w = events(10, payload)
    with pytest.raises(EventTooLargeError, match="more events than the event table"):
        buf.append_windows([b"".join(w)], sizes=[[len(e) for e in w]] if trusted else None)
    assert buf.stats["windows_refused"] == 1 and buf.meta.windows == 0
    buf.close()


@pytest.mark.parametrize("trusted", [False, True])
def test_a_group_with_more_events_than_the_table_is_appended_in_parts(
    tmp_path: Path, trusted: bool
) -> None:
    """Groups are cut by bytes: a burst of small windows made one group with more events
    than the event table holds; checked per window only, it overran the table after its
    eviction had emptied the buffer, and the ingest failed on it for good (review)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_buffer import drain, make_window

    buf = EventBuffer(tmp_path, BufferConfig(CAP, event_slots=1024))
    try:
        for scn in range(1, 300):
            buf.append_windows([make_window(scn, [20])])
        group = [make_window(300 + i, [40] * 20) for i in range(70)]  # 21 events each
        sizes = (
            [[int(n) for n in parse_stream(w)[1]["total_length"]] for w in group]
            if trusted
            else None
        )
        assert buf.append_windows(group, sizes=sizes) == 369
        m = buf.meta
        assert m.last_scn == 369 and m.tail_event - m.head_event <= 1024
        assert buf.stats["windows_refused"] == 0
        # what is kept reads back whole: the newest windows, event by event
        got, _end = drain(buf, 359, -1, 1 << 20)
        assert got == [(scn, seq) for scn in range(360, 370) for seq in range(21)]
    finally:
        buf.close()
