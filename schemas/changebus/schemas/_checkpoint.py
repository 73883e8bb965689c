"""The consumer checkpoint: where a consumer is, per physical partition.

Relays and bootstrap servers keep no state per consumer; every request carries
the consumer's checkpoint. A :class:`Checkpoint` maps each physical partition
the consumer follows (by name) to a :class:`PartitionCheckpoint`:

* ``mode`` -- ``online`` (reading a relay), ``bootstrap-snapshot`` or
  ``bootstrap-catchup`` (reading a bootstrap server; ``bootstrap`` then holds
  the progress).
* ``window_scn`` / ``window_offset`` -- the position: the SCN of the current
  window and how many of its events were consumed, ``-1`` meaning all of them.
  Windows are the unit of work; an offset >= 0 lets a consumer continue inside
  a large window **on the same relay** (the relay cut it there).
* ``prev_scn`` -- the last *fully* consumed window: where a consumer safely
  regresses when it switches to another relay in the middle of a window
  (after telling its application to roll back the partial window).
* ``timestamp_ns`` -- commit time of the last consumed window (for lag).

Delivery is at-least-once: a consumer persists its checkpoint after it has
processed a window; after a crash it replays at most the unfinished window.

Forms: compact JSON (``to_json``), a URL-safe token (``to_token``: ``cb1.``
+ base64url of the JSON, or ``cb1z.`` + base64url of its zlib compression when
that is shorter), and a dict of JSON primitives (``to_dict``, used as a Spark
offset). Parsing rejects anything else with :class:`CheckpointError`.

All classes are immutable and safe to share between threads.
"""

from __future__ import annotations

import base64
import binascii
import enum
import json
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any, Final

from ._scn import MAX_SCN
from ._server_query import MAX_DIGITS
from .errors import CheckpointError

__all__ = ["BootstrapProgress", "Checkpoint", "Mode", "PartitionCheckpoint"]

FORMAT_VERSION: Final = 1
MAX_TEXT: Final = 64 * 1024
_NAME_RE: Final = re.compile(r"[A-Za-z0-9_.-]{1,128}")


class Mode(enum.Enum):
    """Where a partition's events come from."""

    ONLINE = "online"
    SNAPSHOT = "bootstrap-snapshot"
    CATCHUP = "bootstrap-catchup"


def _short(value: object) -> str:
    """``repr(value)`` cut to a length fit for an error message (values come from requests)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:40]}... ({len(text)} characters)"


def _json_int(text: str) -> int:
    """``json.loads``'s integer hook: at most MAX_DIGITS digits, checked before converting."""
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise CheckpointError(
            f"checkpoint holds a {len(text.lstrip('-'))}-digit number; "
            f"numbers have at most {MAX_DIGITS} digits"
        )
    return int(text)


def _json_float(text: str) -> float:
    """``json.loads``'s hook for numbers with a fraction or exponent: never valid here."""
    raise CheckpointError(f"checkpoint numbers are integers, got {_short(text)}")


def _int(name: str, value: object, lo: int = -1, hi: int = MAX_SCN) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise CheckpointError(f"checkpoint field {name} must be an integer, got {_short(value)}")
    if not lo <= value <= hi:
        raise CheckpointError(f"checkpoint field {name} must be within {lo}..{hi}, got {value}")
    return value


def _names(names: list[str]) -> str:
    """A list of unknown field names for an error message (bounded)."""
    shown = ", ".join(_short(n).strip("'") for n in names[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _opt_str(name: str, value: object, limit: int = 4096) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > limit:
        raise CheckpointError(
            f"checkpoint field {name} must be a string of at most {limit} characters"
        )
    return value


@dataclass(frozen=True)
class BootstrapProgress:
    """How far a consumer got through a bootstrap (snapshot, then catch-up).

    ``since_scn`` is the SCN the consumer had when it started bootstrapping
    (-1: from nothing); ``start_scn`` the snapshot's SCN and ``target_scn``
    the catch-up target (both given by the bootstrap server; -1 unset);
    ``source``/``source_index`` the logical source in progress;
    ``snapshot_position`` an opaque resume token from the server; ``server``
    the URL whose progress this is.
    """

    since_scn: int = -1
    start_scn: int = -1
    target_scn: int = -1
    source: str = ""
    source_index: int = 0
    snapshot_position: str | None = None
    server: str | None = None

    def __post_init__(self) -> None:
        for name in ("since_scn", "start_scn", "target_scn"):
            _int(name, getattr(self, name))
        _int("source_index", self.source_index, 0, 1 << 20)
        if self.source is None:  # (a str: null passed as no source, then broke a reader)
            raise CheckpointError("checkpoint field source must be a string")
        _opt_str("source", self.source, 512)
        _opt_str("snapshot_position", self.snapshot_position)
        _opt_str("server", self.server, 1024)
        if self.snapshot_position is not None and self.start_scn < 0:
            raise CheckpointError("a snapshot position needs the snapshot's start_scn")
        if self.target_scn >= 0 and self.start_scn > self.target_scn:
            raise CheckpointError(
                f"start_scn {self.start_scn} is after target_scn {self.target_scn}"
            )


@dataclass(frozen=True)
class PartitionCheckpoint:
    """The position in one physical partition (see the module docstring)."""

    mode: Mode = Mode.ONLINE
    window_scn: int = -1
    window_offset: int = -1
    prev_scn: int = -1
    timestamp_ns: int = 0
    bootstrap: BootstrapProgress | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.mode, Mode):
            raise CheckpointError(f"checkpoint mode must be a Mode, got {self.mode!r}")
        _int("window_scn", self.window_scn)
        _int("window_offset", self.window_offset, -1, 2**31)
        _int("prev_scn", self.prev_scn)
        _int("timestamp_ns", self.timestamp_ns, -(2**63), 2**63 - 1)
        if self.window_scn < 0 and self.window_offset >= 0:
            raise CheckpointError("window_offset needs a window_scn")
        if self.prev_scn >= 0 and self.window_scn >= 0 and self.prev_scn > self.window_scn:
            raise CheckpointError(f"prev_scn {self.prev_scn} is after window_scn {self.window_scn}")
        if self.mode is Mode.ONLINE and self.bootstrap is not None:
            raise CheckpointError("an online checkpoint carries no bootstrap progress")
        if self.mode is not Mode.ONLINE:
            if self.bootstrap is None:
                raise CheckpointError(f"a {self.mode.value} checkpoint needs bootstrap progress")
            if self.mode is Mode.CATCHUP and (
                self.bootstrap.start_scn < 0 or self.bootstrap.target_scn < 0
            ):
                raise CheckpointError("a catch-up checkpoint needs start_scn and target_scn")

    @property
    def has_position(self) -> bool:
        return self.window_scn >= 0

    @property
    def is_window_complete(self) -> bool:
        return self.window_offset < 0

    def on_event(self, scn: int) -> PartitionCheckpoint:
        """After consuming one (non END_OF_WINDOW) event of window ``scn``."""
        if scn == self.window_scn and self.window_offset >= 0:
            return replace(self, window_offset=self.window_offset + 1)
        if scn < self.window_scn or (scn == self.window_scn and self.window_offset < 0):
            raise CheckpointError(f"event SCN {scn} goes back before checkpoint {self.window_scn}")
        return replace(self, window_scn=scn, window_offset=1)

    def on_end_of_window(self, scn: int, timestamp_ns: int) -> PartitionCheckpoint:
        """After consuming the END_OF_WINDOW of window ``scn``."""
        if scn < self.window_scn:
            raise CheckpointError(f"window SCN {scn} goes back before checkpoint {self.window_scn}")
        return replace(
            self, window_scn=scn, window_offset=-1, prev_scn=scn, timestamp_ns=timestamp_ns
        )

    def rollback(self) -> PartitionCheckpoint:
        """Back to the last complete window (drop a partly consumed one)."""
        if self.window_offset < 0:
            return self
        return replace(self, window_scn=self.prev_scn, window_offset=-1)

    # ---- dict form ----------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.mode is not Mode.ONLINE:
            out["mode"] = self.mode.value
        for name in ("window_scn", "window_offset", "prev_scn"):
            if getattr(self, name) != -1:
                out[name] = getattr(self, name)
        if self.timestamp_ns:
            out["timestamp_ns"] = self.timestamp_ns
        if self.bootstrap is not None:
            default = BootstrapProgress()
            out["bootstrap"] = {
                f.name: getattr(self.bootstrap, f.name)
                for f in fields(BootstrapProgress)
                if getattr(self.bootstrap, f.name) != getattr(default, f.name)
            }
        return out

    @classmethod
    def from_dict(cls, data: object, where: str = "") -> PartitionCheckpoint:
        if not isinstance(data, Mapping):
            raise CheckpointError(f"checkpoint entry {where} must be an object")
        known = {"mode", "window_scn", "window_offset", "prev_scn", "timestamp_ns", "bootstrap"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise CheckpointError(f"unknown checkpoint field(s) {_names(unknown)} in {where}")
        mode_text = data.get("mode", "online")
        try:
            mode = Mode(mode_text)
        except ValueError:
            raise CheckpointError(
                f"unknown checkpoint mode {_short(mode_text)}; "
                f"expected one of {[m.value for m in Mode]}"
            ) from None
        bootstrap = None
        if "bootstrap" in data:
            b = data["bootstrap"]
            if not isinstance(b, Mapping):
                raise CheckpointError(f"bootstrap progress in {where} must be an object")
            names = {f.name for f in fields(BootstrapProgress)}
            bad = sorted(set(b) - names)
            if bad:
                raise CheckpointError(f"unknown bootstrap field(s) {_names(bad)} in {where}")
            try:
                bootstrap = BootstrapProgress(**b)
            except TypeError as exc:
                raise CheckpointError(f"bad bootstrap progress in {where}: {exc}") from None
        return cls(
            mode=mode,
            window_scn=data.get("window_scn", -1),
            window_offset=data.get("window_offset", -1),
            prev_scn=data.get("prev_scn", -1),
            timestamp_ns=data.get("timestamp_ns", 0),
            bootstrap=bootstrap,
        )


@dataclass(frozen=True)
class Checkpoint:
    """A consumer's positions, one per physical partition name."""

    partitions: Mapping[str, PartitionCheckpoint] = field(default_factory=dict)

    def __post_init__(self) -> None:
        copied = dict(self.partitions)
        entries: list[tuple[object, object]] = list(copied.items())
        for name, pc in entries:
            if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
                raise CheckpointError(
                    f"bad partition name {_short(name)}: use 1-128 of [A-Za-z0-9_.-]"
                )
            if not isinstance(pc, PartitionCheckpoint):
                raise CheckpointError(f"partition {name}: not a PartitionCheckpoint")
        object.__setattr__(self, "partitions", MappingProxyType(copied))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Checkpoint) and dict(self.partitions) == dict(other.partitions)

    def __hash__(self) -> int:
        return hash(tuple(sorted((k, repr(v)) for k, v in self.partitions.items())))

    def __repr__(self) -> str:
        return f"Checkpoint({dict(self.partitions)!r})"

    def get(self, name: str) -> PartitionCheckpoint:
        """The partition's checkpoint (a fresh one, with no position, when absent)."""
        return self.partitions.get(name) or PartitionCheckpoint()

    def with_partition(self, name: str, pc: PartitionCheckpoint) -> Checkpoint:
        return Checkpoint({**self.partitions, name: pc})

    # ---- forms --------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Lossless dict of JSON primitives."""
        return {
            "v": FORMAT_VERSION,
            "partitions": {k: v.to_dict() for k, v in sorted(self.partitions.items())},
        }

    @classmethod
    def from_dict(cls, data: object) -> Checkpoint:
        if not isinstance(data, Mapping):
            raise CheckpointError("a checkpoint must be a JSON object")
        version = data.get("v")
        if type(version) is not int or version != FORMAT_VERSION:  # (true == 1 in Python)
            raise CheckpointError(
                f"unsupported checkpoint format version {_short(data.get('v'))}; expected 1"
            )
        unknown = sorted(set(data) - {"v", "partitions"})
        if unknown:
            raise CheckpointError(f"unknown checkpoint field(s): {_names(unknown)}")
        parts = data.get("partitions", {})
        if not isinstance(parts, Mapping):
            raise CheckpointError("checkpoint 'partitions' must be an object")
        return cls(
            {
                name: PartitionCheckpoint.from_dict(pc, f"partition {_short(name)}")
                for name, pc in parts.items()
            }
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Checkpoint:
        if len(text) > MAX_TEXT:
            raise CheckpointError(f"checkpoint text is longer than {MAX_TEXT} characters")
        try:
            data = json.loads(text, parse_int=_json_int, parse_float=_json_float)
        except CheckpointError:
            raise
        except (ValueError, RecursionError):
            raise CheckpointError("checkpoint is not valid JSON (nor a cb1. token)") from None
        return cls.from_dict(data)

    def to_token(self) -> str:
        raw = self.to_json().encode()
        packed = zlib.compress(raw, 9)
        if len(packed) < len(raw):
            return "cb1z." + base64.urlsafe_b64encode(packed).decode().rstrip("=")
        return "cb1." + base64.urlsafe_b64encode(raw).decode().rstrip("=")

    @classmethod
    def from_token(cls, token: str) -> Checkpoint:
        if len(token) > MAX_TEXT:
            raise CheckpointError(f"checkpoint token is longer than {MAX_TEXT} characters")
        prefix, sep, body = token.partition(".")
        if not sep or prefix not in ("cb1", "cb1z"):
            raise CheckpointError("checkpoint token must start with 'cb1.' or 'cb1z.'")
        try:
            raw = base64.b64decode(body + "=" * (-len(body) % 4), altchars=b"-_", validate=True)
            if prefix == "cb1z":
                d = zlib.decompressobj()
                raw = d.decompress(raw, MAX_TEXT + 1)
                if len(raw) > MAX_TEXT or d.unconsumed_tail:
                    raise CheckpointError("checkpoint token expands beyond the size limit")
            text = raw.decode()
        except (binascii.Error, zlib.error, UnicodeDecodeError, ValueError):
            raise CheckpointError("checkpoint token is not valid base64url/zlib data") from None
        return cls.from_json(text)

    @classmethod
    def parse(cls, text: str) -> Checkpoint:
        """A checkpoint from its JSON or token form."""
        t = text.strip()
        if t.startswith(("{", "[")):
            return cls.from_json(t)
        return cls.from_token(t)
