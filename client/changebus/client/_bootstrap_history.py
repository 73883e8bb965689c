"""Which bootstrap server may go on with rows a consumer holds from an earlier snapshot.

A consumer that holds part of a bootstrap's rows (a restart, a failover to
another server, a snapshot restarted after its catch-up was pruned) must
take the rest from a server whose history reaches back to that snapshot:
its tombstones cover the deletes after its ``base_scn`` only, and it knows
nothing of the SCNs it never received (its lost ranges).
:func:`check_history` refuses a server that cannot tell which of those rows
were deleted since; :class:`Held` is what a
:class:`~._bootstrap.Bootstrapper` remembers of such a snapshot once a
restart forgot its checkpoint (:func:`held_after_restart` updates it).

Pure functions of plain data: no state, no I/O, no thread-safety concerns.
"""

from __future__ import annotations

from typing import NamedTuple

from changebus.schemas import BootstrapFailedError, BootstrapProgress

from ._http import safe_url
from ._info import BootstrapStatus

__all__ = ["Held", "check_history", "held_after_restart"]


class Held(NamedTuple):
    """(start, since) of the oldest snapshot the consumer holds rows of, once a restart
    forgot its checkpoint; ``own``: the server (safe URL) all those rows came from when
    its own catch-up was pruned (else ""). Its lost ranges do not matter there: what the
    consumer holds is that store's (SCNs it had), which its re-seed and sweep repair;
    they refused it for good, though the server accepts the new snapshot (review)."""

    start: int
    since: int
    own: str = ""


def held_after_restart(
    held: Held | None, prior: BootstrapProgress | None, url: str, pruned: bool
) -> Held | None:
    """``held`` once the bootstrap ``prior`` (its progress on ``url``; None: none) is
    restarted, its checkpoint forgotten; ``pruned``: its catch-up's log was pruned
    (:class:`~._http.CatchupPruned`), not its snapshot restarted."""
    if prior is None or prior.start_scn < 0:
        return held
    # (a pruned catch-up on the server it ran on: its store's rows only)
    own = safe_url(url) if pruned and prior.server in (url, safe_url(url)) else ""
    if held is None or prior.start_scn < held.start:
        mine = own if held is None or held.own == own else ""
        return Held(prior.start_scn, prior.since_scn, mine)
    if held.own != own:
        return held._replace(own="")
    return held


def check_history(
    status: BootstrapStatus,
    url: str,
    held: int,
    since: int,
    upto: int | None,
    *,
    lost: bool = True,
) -> None:
    """Refuse the server at ``url`` (its ``status``) when its history starts after
    ``held``, the start of the snapshot whose rows the consumer holds (part of them,
    from another server or from this URL before its store was rebuilt).

    Its tombstones cover the deletes after its ``base_scn`` only: a row the
    consumer holds that was deleted between ``held`` and that base (before
    the server was seeded) would stay for good. The same holds for rows of
    SCNs it never received (its lost ranges) that the consumer may hold: any
    range after ``since`` and before ``upto``, the newest change the consumer
    holds (its catch-up's window; None in a snapshot, whose pages carry rows
    at their latest version: any newer range then). ``lost=False``: the rows are
    this server's own (:class:`Held`), only its history's start is checked.
    """
    base = status.base_scn
    ranges = [
        (after, end)
        for after, end in (status.lost_ranges if lost else ())
        if end > since and (upto is None or after < upto)
    ]
    if ranges:
        after, end = ranges[0]
        raise BootstrapFailedError(
            f"{safe_url(url)}: it never received SCNs {after} < SCN < {end}, and this "
            f"consumer holds rows of another server's bootstrap from SCN {held} that may "
            "come from there: it cannot tell which of them were deleted since. Use another "
            "bootstrap server, or reset the consumer's state (its rows and checkpoint) and "
            "bootstrap from nothing"
        )
    if base > held:
        raise BootstrapFailedError(
            f"{safe_url(url)}: its history starts at SCN {base}, after SCN {held}, where "
            "the snapshot this consumer holds rows of started: it cannot tell which of "
            "those rows were deleted since. Use a bootstrap server whose history starts "
            f"at or before SCN {held}, or reset the consumer's state (its rows and "
            "checkpoint) and bootstrap from nothing"
        )
