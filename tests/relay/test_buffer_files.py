"""Opening a buffer's files (review): damage is said, a size change is never silent, a
failed open leaves nothing open.

* ``meta.dat`` with no intact slot: the buffer starts empty and says so (an error);
* capacity or event slots changed (or a typo): the start is refused with the old and
  new sizes, nothing is touched; with ``resize`` (``--resize-buffers``) the old files
  are moved aside, never truncated;
* a constructor that fails (a full disk, a failed recovery, a failed registry) closes
  the mappings and prefaulter threads it opened at once.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path

import pytest
from test_recovery_damage import CAP, CFG, fill, flip, make_window, read_all, window_scns

from changebus.relay import BufferConfig, EventBuffer
from changebus.relay._config import PartitionConfig, RelayConfig
from changebus.relay._host import PartitionHost
from changebus.schemas import HEADER_SIZE, ConfigError
from changebus.schemas.config import load_config

FILES = ("meta.dat", "ring.dat", "events.dat", "index.dat")


def mapped(directory: Path) -> list[str]:
    """This process's mappings and open descriptors of files under ``directory``."""
    text = Path("/proc/self/maps").read_text()
    maps = [line for line in text.splitlines() if str(directory) in line]
    fds = []
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith(str(directory)) and not target.endswith(".lock"):
            fds.append(target)
    return maps + fds


def prefaulters() -> int:
    return sum(t.name == "relay-prefault" for t in threading.enumerate())


def snapshot(directory: Path) -> dict[str, bytes]:
    return {f: (directory / f).read_bytes() for f in FILES}


def test_a_damaged_meta_file_is_an_error_and_the_buffer_starts_empty(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fill(tmp_path, 1, 50).close()
    (tmp_path / "meta.dat").write_bytes(b"\x5a" * (tmp_path / "meta.dat").stat().st_size)
    with caplog.at_level(logging.WARNING, logger="changebus.relay.buffer"):
        buf = EventBuffer(tmp_path, CFG)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("no intact state" in e and "starting empty" in e for e in errors), errors
    assert buf.meta.head_event == buf.meta.tail_event
    buf.close()


def test_a_new_buffer_logs_no_error(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="changebus.relay.buffer"):
        EventBuffer(tmp_path / "new", CFG).close()
    assert not caplog.records


@pytest.mark.parametrize(
    "other",
    [
        BufferConfig(capacity_bytes=2 * CAP, event_slots=4096),
        BufferConfig(capacity_bytes=CAP, event_slots=8192),
        BufferConfig(capacity_bytes=CAP, event_slots=4096, block_bytes=256),
    ],
)
def test_a_changed_size_is_refused_and_touches_nothing(tmp_path: Path, other: BufferConfig) -> None:
    buf = fill(tmp_path, 1, 300)
    before = read_all(buf)
    meta = buf.meta
    buf.close()
    files = snapshot(tmp_path)
    with pytest.raises(ConfigError) as err:
        EventBuffer(tmp_path, other, name="orders")
    text = err.value.message
    assert f"capacity_bytes={CAP}, event_slots=4096" in text
    assert f"capacity_bytes={other.capacity_bytes}, event_slots={other.slots}" in text
    assert "--resize-buffers" in text and "'orders'" in text
    assert snapshot(tmp_path) == files, "nothing truncated"
    assert not mapped(tmp_path)
    again = EventBuffer(tmp_path, CFG)  # the old sizes back: every window is there
    assert again.meta == meta
    assert read_all(again) == before
    again.close()


def test_a_resize_moves_the_old_files_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fill(tmp_path, 1, 300).close()
    files = snapshot(tmp_path)
    bigger = BufferConfig(capacity_bytes=2 * CAP, event_slots=4096)
    with caplog.at_level(logging.WARNING, logger="changebus.relay.buffer"):
        buf = EventBuffer(tmp_path, bigger, resize=True)
    assert buf.meta.head_event == buf.meta.tail_event == 0
    assert buf.capacity == 2 * CAP and (tmp_path / "ring.dat").stat().st_size == 2 * CAP
    buf.append_window(make_window(301))
    buf.close()
    (aside,) = tmp_path.glob("resized-*")
    assert snapshot(aside) == files, "the old files are kept, whole"
    assert any(str(aside) in r.getMessage() for r in caplog.records)
    reopened = EventBuffer(tmp_path, bigger)  # the new sizes are the buffer's now
    assert window_scns(read_all(reopened)) == [301]
    reopened.close()


def test_resize_buffers_is_a_relay_option() -> None:
    cfg = load_config(RelayConfig, None, env_prefix="X_", overrides=["resize_buffers=true"])
    assert cfg.resize_buffers is True
    assert RelayConfig().resize_buffers is False


def test_a_full_disk_at_open_leaves_nothing_mapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(path: Path, size: int) -> bool:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr("changebus.relay._buffer.reserve_file", full)
    with pytest.raises(OSError) as failed:
        EventBuffer(tmp_path, CFG)
    assert failed.value.errno == errno.ENOSPC
    assert not mapped(tmp_path)  # (the traceback still refers to the half-made buffer)


def test_a_failed_recovery_leaves_nothing_mapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fill(tmp_path, 1, 50).close()

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("recovery failed")

    monkeypatch.setattr("changebus.relay._buffer.recover", broken)
    fsync = BufferConfig(capacity_bytes=CAP, event_slots=4096, durability="fsync")
    with pytest.raises(RuntimeError):
        EventBuffer(tmp_path, fsync)  # (the synced watermark's file is open by then too)
    assert not mapped(tmp_path)


def test_a_failed_data_loss_append_stops_the_prefaulters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    buf = fill(tmp_path, 1, 100)
    newest = int(buf._events.at(buf.meta.tail_event - 2)["pos"])
    buf.close()
    flip(tmp_path / "ring.dat", newest % CAP + HEADER_SIZE + 2, 7)  # a DATA_LOSS owed
    running = prefaulters()

    def killed(self: EventBuffer, window: object) -> int:
        raise RuntimeError("failed to append the DATA_LOSS window")

    monkeypatch.setattr(EventBuffer, "append_window", killed)
    with pytest.raises(RuntimeError):
        EventBuffer(tmp_path, CFG)
    assert not mapped(tmp_path)
    assert prefaulters() == running


def test_a_partition_whose_registry_fails_closes_its_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(path: Path) -> None:
        raise ValueError("schemas.jsonl is damaged")

    monkeypatch.setattr("changebus.relay._host.SchemaRegistry", broken)
    part = PartitionConfig("p", 1, capacity_bytes=CAP)
    with pytest.raises(ValueError):
        PartitionHost(part, tmp_path)
    assert not mapped(tmp_path / "p")
    monkeypatch.undo()
    host = PartitionHost(part, tmp_path)  # the directory's lock was released
    host.buffer.close()
    host._dir_lock.release()


def test_a_resize_interrupted_half_way_leaves_the_old_buffer_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash after the first rename of a resize: ``meta.dat`` went first, and the next
    start created a new buffer over the old ring, event table and index (review). It is
    moved last now: a start without ``--resize-buffers`` is refused and touches nothing,
    one with it finishes the move into the same directory."""
    fill(tmp_path, 1, 300).close()
    files = snapshot(tmp_path)
    bigger = BufferConfig(capacity_bytes=2 * CAP, event_slots=4096)
    renamed: list[Path] = []
    rename = os.rename

    def killed_after_one(src: Path, dst: Path) -> None:
        if renamed:
            raise KeyboardInterrupt("killed during the resize")
        renamed.append(src)
        rename(src, dst)

    monkeypatch.setattr(os, "rename", killed_after_one)
    with pytest.raises(KeyboardInterrupt):
        EventBuffer(tmp_path, bigger, resize=True)
    monkeypatch.undo()
    (aside,) = tmp_path.glob("resized-*")
    for cfg in (bigger, CFG):
        with pytest.raises(ConfigError, match="interrupted"):
            EventBuffer(tmp_path, cfg)
    assert {f: (tmp_path / f).read_bytes() for f in FILES if (tmp_path / f).exists()} == {
        f: files[f] for f in FILES if not (aside / f).exists()
    }, "nothing truncated"
    buf = EventBuffer(tmp_path, bigger, resize=True)
    assert buf.meta.head_event == buf.meta.tail_event == 0
    buf.close()
    assert [p.name for p in tmp_path.glob("resized-*")] == [aside.name]
    assert snapshot(aside) == files, "the old files are kept, whole"


def test_a_start_that_failed_before_its_first_state_is_no_damage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A resize (or a first start) on a disk too small failed before the new buffer's
    state was published: ``meta.dat`` all zeros. The next start logged an error that the
    buffer was damaged and its windows lost (review): it is a new buffer. The full disk's
    error names the old files moved aside, which hold the space."""
    fill(tmp_path, 1, 300).close()
    bigger = BufferConfig(capacity_bytes=2 * CAP, event_slots=4096)

    def full(path: Path, size: int) -> bool:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr("changebus.relay._buffer.reserve_file", full)
    with pytest.raises(OSError) as failed:
        EventBuffer(tmp_path, bigger, resize=True)
    assert failed.value.errno == errno.ENOSPC
    (aside,) = tmp_path.glob("resized-*")
    assert str(aside) in str(failed.value) and "--resize-buffers" in str(failed.value)
    assert not mapped(tmp_path)
    monkeypatch.undo()
    assert not (tmp_path / "meta.dat").read_bytes().strip(b"\0")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="changebus.relay.buffer"):
        buf = EventBuffer(tmp_path, bigger)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert buf.meta.head_event == buf.meta.tail_event == 0
    buf.append_window(make_window(301))
    buf.close()
    again = EventBuffer(tmp_path, bigger)
    assert window_scns(read_all(again)) == [301]
    again.close()
