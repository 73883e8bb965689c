"""Sticky assignment of a consumer group's units to its members (a pure function).

:func:`assign` spreads ``units`` evenly over ``members`` while moving as few
units as possible away from the member that had them in ``previous``:

* Quotas: with ``U`` units and ``M`` members every member gets
  ``floor(U/M)`` or ``ceil(U/M)`` units; the ``U mod M`` larger quotas go to
  the members that already hold the most (still valid) units, ties broken
  by member order. Giving a larger quota to a member with more kept units
  never keeps fewer units than giving it to one with less, so this choice
  maximises the units that stay.
* A member keeps its previous units (the lowest ones, sorted, when it has
  more than its quota); everything else -- units of departed members, a
  member's surplus, units nobody had -- is handed out in sorted order, each
  to the member under quota with the lowest load (ties by member order).

So the number of units whose owner changes is the minimum any assignment
with these quotas can reach: ``U - sum(min(kept_i, quota_i))``.

Robustness: ``previous`` may name members that are gone, units that are not
(or no longer) in ``units``, the same unit twice or for two members (the
first member in order keeps it); all of that is ignored. The result is
deterministic: it depends only on the sets given, not on their order.
Members are ordered by their names (the member ids ``m-<10-digit seq>``
sort by sequence number).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

from changebus.schemas import Unit

__all__ = ["assign", "moved_units"]


def assign(
    units: Sequence[Unit],
    members: Sequence[str],
    previous: Mapping[str, Sequence[Unit]],
) -> dict[str, tuple[Unit, ...]]:
    """The new assignment ``{member: sorted units}`` (see the module docstring).

    Every member of ``members`` appears in the result (with ``()`` when there
    is nothing for it); no members means an empty result.
    """
    order = sorted(set(members))
    if not order:
        return {}
    all_units = sorted(set(units))
    valid = set(all_units)
    taken: set[Unit] = set()
    kept: dict[str, list[Unit]] = {}
    for member in order:
        mine = []
        for unit in sorted(set(previous.get(member, ()))):
            if unit in valid and unit not in taken:
                taken.add(unit)
                mine.append(unit)
        kept[member] = mine

    base, extra = divmod(len(all_units), len(order))
    rank = sorted(range(len(order)), key=lambda i: (-len(kept[order[i]]), i))
    quota = {order[i]: base + (1 if r < extra else 0) for r, i in enumerate(rank)}

    result: dict[str, list[Unit]] = {}
    for member in order:
        result[member] = kept[member][: quota[member]]
    placed = {unit for mine in result.values() for unit in mine}
    pool = [unit for unit in all_units if unit not in placed]

    heap = [(len(result[m]), i) for i, m in enumerate(order) if len(result[m]) < quota[m]]
    heapq.heapify(heap)
    for unit in pool:
        load, i = heapq.heappop(heap)
        member = order[i]
        result[member].append(unit)
        if load + 1 < quota[member]:
            heapq.heappush(heap, (load + 1, i))
    return {member: tuple(sorted(mine)) for member, mine in result.items()}


def moved_units(
    previous: Mapping[str, Sequence[Unit]], current: Mapping[str, Sequence[Unit]]
) -> frozenset[Unit]:
    """The units of ``current`` whose member is not the one ``previous`` named (or had none)."""
    owner: dict[Unit, str] = {}
    for member in sorted(previous):
        for unit in previous[member]:
            owner.setdefault(unit, member)
    return frozenset(
        unit for member, mine in current.items() for unit in mine if owner.get(unit) != member
    )
