"""Windows lost to the bootstrap server: the relay's DATA_LOSS signal and what a gap tells.

One job: reading a DATA_LOSS signal out of a raw window from the relay
(:func:`loss_in`), and the words the service and ``/v1/status`` use for a
gap in the log (:class:`Gap`, :func:`loss_reason`, :func:`repair_hint`).
The gap itself -- positions before it refused until every table has been
seeded again -- lives in the store (:mod:`._gaps`); the service records it
(:mod:`._pipeline`, :mod:`._seeding`). Pure functions and an immutable value: thread-safe.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from changebus.client import RawWindow
from changebus.schemas import HEADER_SIZE, DataLoss, Op, decode_control

__all__ = ["DATA_LOSS_OP", "Gap", "loss_in", "loss_reason", "repair_hint"]

#: the op of a DATA_LOSS control event (as the header arrays hold it)
DATA_LOSS_OP = int(Op.DATA_LOSS)

#: the longest reason quoted from the relay (it is the relay's text)
_MAX_REASON = 300


@dataclass(frozen=True)
class Gap:
    """A gap in a partition's log not repaired yet, as ``/v1/status`` shows it.

    ``before_scn``: positions before it are refused (the snapshot lacks what
    was lost); ``reason``: what made it; ``repair``: how it is repaired.
    """

    before_scn: int
    reason: str
    repair: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "before_scn": self.before_scn,
            "snapshot_complete": False,
            "reason": self.reason,
            "repair": self.repair,
        }


def loss_in(raw: RawWindow) -> DataLoss:
    """The DATA_LOSS signal of ``raw`` (which holds one)."""
    i = raw.headers["op"].tolist().index(DATA_LOSS_OP)
    start = int(raw.offsets[i])
    end = start + int(raw.headers["total_length"][i])
    loss = decode_control(Op.DATA_LOSS, raw.body[start + HEADER_SIZE : end])
    assert isinstance(loss, DataLoss)
    return loss


def loss_reason(losses: Sequence[tuple[int, DataLoss]]) -> str:
    """What the relay's DATA_LOSS windows ``(window SCN, signal)`` said (the last three)."""
    said = "; ".join(
        f"SCNs {loss.from_scn}..{loss.to_scn} ({loss.reason[:_MAX_REASON]}, in window {scn})"
        for scn, loss in losses[-3:]
    )
    more = f" (and {len(losses) - 3} more)" if len(losses) > 3 else ""
    return f"the relay reported lost changes: {said}{more}"


def repair_hint(part: str, *, seed_source: bool) -> str:
    """How a gap in ``part``'s log is repaired (``seed_source``: ``seed.dsn`` is set)."""
    if seed_source:
        return (
            "every table is seeded again from the source (seed.dsn), after which the gap "
            f"is forgotten; if that seed fails: POST /v1/seed?partition={part}"
        )
    return (
        "no seed source is configured (seed.dsn): the snapshot stays incomplete and "
        "positions before the gap are refused until an operator sets seed.dsn and seeds "
        f"every table again (POST /v1/seed?partition={part}, or seed.on_start = true)"
    )
