"""The relay buffer's configuration: its sizes, waits and durability mode.

:class:`BufferConfig` is frozen and checked when made (a bad value is a
:class:`~changebus.schemas.ConfigError` naming it); sizes are bytes and
durations seconds. The buffer (:mod:`._buffer`) derives its event table
slots, index block size and largest window from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final, Literal, get_args

from changebus.schemas.errors import ConfigError

__all__ = ["DURABILITY_MODES", "BufferConfig", "Durability", "check_durability"]


#: when a window counts as held (see :mod:`._syncer`)
Durability = Literal["page_cache", "fsync"]
DURABILITY_MODES: Final = get_args(Durability)


def check_durability(value: object, where: str) -> None:
    """Raise a :class:`ConfigError` naming the valid modes unless ``value`` is one."""
    if value not in DURABILITY_MODES:
        raise ConfigError(
            f"{where}: durability {value!r} is not one of {', '.join(DURABILITY_MODES)}"
        )


@dataclass(frozen=True)
class BufferConfig:
    """Sizes of one buffer. Bytes for sizes, seconds for durations."""

    capacity_bytes: int = 64 << 20
    #: event table slots; 0 = capacity_bytes // 128 (average event >= 128 B)
    event_slots: int = 0
    #: bytes per SCN index block; 0 = chosen so the index has ~capacity/4 KiB entries
    block_bytes: int = 0
    #: largest window accepted (0 = the capacity)
    max_window_bytes: int = 0
    #: how long the writer waits for a slow reader before overrunning its pin
    pin_timeout_s: float = 2.0
    #: a reader whose pace says it needs longer than this to finish is not waited for
    slow_reader_s: float = 0.25
    #: "fsync": recovery drops damaged windows without a DATA_LOSS window, because
    #: the source was acknowledged only for synced ones and replays the rest
    #: (see :mod:`._recovery`); "page_cache": they are recorded as data loss
    durability: Durability = "page_cache"

    def __post_init__(self) -> None:
        check_durability(self.durability, "buffer")
        if self.capacity_bytes < 64 * 1024:
            raise ConfigError(f"buffer capacity_bytes must be >= 64 KiB, got {self.capacity_bytes}")
        if self.event_slots < 0 or self.block_bytes < 0 or self.max_window_bytes < 0:
            raise ConfigError("buffer sizes must not be negative")
        if self.max_window_bytes > self.capacity_bytes:
            raise ConfigError("max_window_bytes cannot exceed capacity_bytes")
        if not 0 < self.pin_timeout_s < math.inf:
            raise ConfigError("pin_timeout_s must be a positive number of seconds")
        if not 0 <= self.slow_reader_s < math.inf:
            raise ConfigError("slow_reader_s must be a number of seconds, 0 or more")

    @property
    def slots(self) -> int:
        return self.event_slots or max(1024, self.capacity_bytes // 128)

    @property
    def block(self) -> int:
        return self.block_bytes or max(
            256, self.capacity_bytes // max(1, self.capacity_bytes // 4096)
        )

    @property
    def window_limit(self) -> int:
        return self.max_window_bytes or self.capacity_bytes
