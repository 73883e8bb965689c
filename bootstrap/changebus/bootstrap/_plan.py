"""The plan of ``/v1/bootstrap/start``, and the refusals every bootstrap read shares.

:func:`plan_bootstrap` chooses between a snapshot and a catch-up-only
bootstrap for a consumer at ``since`` (by counting, up to what the choice
needs, the log events and snapshot rows it would get), or refuses it:
positions older than the history or the deletes kept (410), in a lost range
(410 for good),
before an unrepaired gap or past the log (503, retriable), and consumers
from nothing while tables they read are being seeded (503).
:func:`check_position` is the history, lost-range and gap part, also
checked by every snapshot page. Both run in a store thread (they read the store).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from changebus.schemas import NotYetError, ScnNotFoundError

from ._db import PartitionState
from ._store import Store

__all__ = ["PLAN_COUNT_LIMIT", "check_position", "plan_bootstrap"]


def check_position(store: Store, part: str, since: int, seeding: bool) -> PartitionState:
    """The partition's state, after refusing a position older than the history, one in
    a lost range for good, and one before a gap in the log until it is repaired
    (:mod:`._gaps`).

    Such a consumer would get a snapshot that lacks the lost changes, or a
    catch-up across them, with no error: it waits (503, retriable) for the
    re-seed instead. ``seeding``: a seed source is configured (the seed
    repairs the gap by itself); without one the answer says an operator
    must seed.
    """
    st = store.state(part)
    if 0 <= since < st.base_scn:
        raise ScnNotFoundError(
            f"position {since} is older than this bootstrap server's history (it holds every "
            f"change after {st.base_scn}); the consumer must start again from nothing",
            base_scn=st.base_scn,
        )
    purged = store.tomb_scn(part)
    if 0 <= since < purged:
        raise ScnNotFoundError(
            f"position {since} is older than the deletes this bootstrap server keeps (the "
            f"tombstones of deletes up to SCN {purged} were purged: applier.tombstone_keep_s), "
            "so a snapshot can no longer name the rows deleted since; the consumer must start "
            "again from nothing",
            base_scn=purged,
        )
    lost = store.lost_range(part, since)
    if lost is not None:
        raise ScnNotFoundError(
            f"position {since} lies in SCNs this server never received ({lost[0]} < SCN < "
            f"{lost[1]}: its producer fell off the relay, or the relay reported them lost): a "
            "consumer there may hold rows inserted and deleted in that range, which this "
            "server cannot send deletes for. Use another bootstrap server, or reset the "
            "consumer's state (its rows and checkpoint) and bootstrap from nothing",
            lost_after_scn=lost[0],
            lost_upto_scn=lost[1],
        )
    gap = store.gap(part)
    if gap is None or since >= gap:
        return st
    what = (
        f"this server misses changes up to SCN {gap} (its producer fell off the relay, or the "
        "relay reported them lost), so its snapshot is incomplete before it"
    )
    if seeding:
        raise NotYetError(
            f"{what}; its snapshot is being seeded again from the source (progress: "
            "/v1/status); retry soon",
            gap_scn=gap,
        )
    raise NotYetError(
        f"{what}; no seed source is configured: an operator must set seed.dsn and seed every "
        f"table again (POST /v1/seed?partition={part}); retry later",
        gap_scn=gap,
    )


#: table names an answer lists at most (``unseeded``)
_NAMES_SHOWN = 50
#: snapshot rows a plan counts at most (so a plan reads a bounded part of the store)
PLAN_COUNT_LIMIT = 1_000_000


def plan_bootstrap(
    store: Store,
    part: str,
    since: int,
    ratio: float,
    seeding: bool = True,
    seed_running: frozenset[str] | None = None,
    visible: Callable[[str], bool] = lambda _table: True,
    *,
    catchup_only: bool = False,
) -> dict[str, Any]:
    """The plan of ``/v1/bootstrap/start``; ``visible``: the tables the principal may read
    (the others are neither named nor waited for: its pages leave them out).

    ``catchup_only`` (``mode=catchup``): the log's windows after ``since`` as
    they are, never a snapshot (a reader that must see every window once, such
    as a Spark task reading one SCN sub-range), or 410 when the log no longer
    holds them all."""
    st = check_position(store, part, since, seeding)
    if st.producer_scn < 0:
        raise NotYetError("the bootstrap server has no windows yet; retry soon")
    if since > st.producer_scn:
        raise NotYetError(
            f"the bootstrap server's log ends at {st.producer_scn}, before position {since}"
        )
    if catchup_only and since < st.log_min_scn:
        raise ScnNotFoundError(
            f"a catch-up only from position {since} needs log windows this server pruned (it "
            f"keeps those after {st.log_min_scn}); only a snapshot can serve that position",
            log_min_scn=st.log_min_scn,
        )
    snapshot = True
    start = st.applier_scn
    if catchup_only:
        snapshot, start = False, since if since >= 0 else max(store.first_log_scn(part) - 1, 0)
    elif since >= st.log_min_scn:
        # counted up to what the choice needs: past PLAN_COUNT_LIMIT snapshot rows the
        # snapshot may be dearer still, and past ratio x rows log events the catch-up is
        rows = store.snapshot_changed(part, since, st.applier_scn, PLAN_COUNT_LIMIT)
        enough = int(min(ratio * rows, 2.0**62)) + 1  # (a huge ratio: every log event)
        log_events = store.changed_since(part, since, st.producer_scn, enough)
        # (from nothing, rows a seed copied are in the snapshot only, never in the log:
        # a catch-up from the log's start lacked them; also while a table is seeded
        # again, or after a snapshot of keys; review)
        seeded = since < 0 and store.copied(part)
        if (log_events <= ratio * rows or st.applier_scn <= since) and not seeded:
            snapshot, start = False, since
            if start < 0:  # from nothing: just before the log's first window (an SCN >= 0)
                start = max(store.first_log_scn(part) - 1, 0)
    if snapshot and start < since:
        raise NotYetError(f"the snapshot is at {start}, before position {since}; retry soon")
    if snapshot and start < 0:
        # (the applier has folded nothing yet: a snapshot "at -1" broke the client's
        # snapshot position for good, a non-retriable error; review)
        raise NotYetError("the snapshot holds no window yet (its applier starts); retry soon")
    # from nothing, with a history that starts after the source's: tables never seeded
    # lack the rows nobody changed since (docs/bootstrap.md "Seeding: why it is needed")
    unseeded = (
        [t for t in store.never_seeded(part) if visible(t)]
        if since < 0 and st.base_scn >= 0
        else []
    )
    # a seed running copies ``seed_running`` (empty: it does not know yet, say all)
    seeding_them = seed_running is not None and (
        not seed_running or bool(seed_running.intersection(unseeded))
    )
    if unseeded and seeding_them:
        raise NotYetError(
            f"the snapshot lacks rows of {len(unseeded)} table(s) not seeded yet "
            f"({', '.join(unseeded[:5])}{', ...' if len(unseeded) > 5 else ''}); a seed is "
            "running (progress: /v1/status); retry soon",
            unseeded=unseeded[:_NAMES_SHOWN],
        )
    return {
        "partition": part,
        "since_scn": since,
        "start_scn": start,
        "snapshot": snapshot,
        "producer_scn": st.producer_scn,
        "applier_scn": st.applier_scn,
        "log_min_scn": st.log_min_scn,
        "base_scn": st.base_scn,
        "unseeded": unseeded[:_NAMES_SHOWN],
        "unseeded_count": len(unseeded),
    }
