"""The sticky assignment of a consumer group: even quotas, the fewest moves, deterministic."""

from __future__ import annotations

import itertools
import random
from collections.abc import Mapping, Sequence

import pytest

from changebus.cluster import assign
from changebus.cluster._assign import moved_units
from changebus.schemas import Unit

UNITS64 = Unit.all_of(["orders"], 64)


def member(seq: int) -> str:
    return f"m-{seq:010d}"


def check_even(result: Mapping[str, Sequence[Unit]], units: Sequence[Unit]) -> None:
    """Every unit exactly once, every member floor or ceil of U/M."""
    flat = [u for mine in result.values() for u in mine]
    assert sorted(flat) == sorted(set(units))
    assert len(flat) == len(set(flat))
    if result:
        sizes = {len(mine) for mine in result.values()}
        base = len(set(units)) // len(result)
        assert sizes <= {base, base + 1}
    for mine in result.values():
        assert list(mine) == sorted(mine)


def minimum_moves(
    units: Sequence[Unit], members: Sequence[str], previous: Mapping[str, Sequence[Unit]]
) -> int:
    """Brute force: the fewest units that change owner over every choice of the ceil quotas."""
    valid = set(units)
    taken: set[Unit] = set()
    kept = []
    for m in sorted(members):
        mine = {u for u in previous.get(m, ()) if u in valid and u not in taken}
        taken |= mine
        kept.append(len(mine))
    base, extra = divmod(len(valid), len(members))
    best = 0
    for ceil in itertools.combinations(range(len(members)), extra):
        stay = sum(min(k, base + (1 if i in ceil else 0)) for i, k in enumerate(kept))
        best = max(best, stay)
    return len(valid) - best


def step(
    units: Sequence[Unit], members: Sequence[str], previous: Mapping[str, Sequence[Unit]]
) -> dict[str, tuple[Unit, ...]]:
    result = assign(units, members, previous)
    assert set(result) == set(members)
    check_even(result, units)
    assert len(moved_units(previous, result)) == minimum_moves(units, members, previous)
    # deterministic, whatever the order of the inputs
    shuffled = list(members)
    random.Random(7).shuffle(shuffled)
    again = assign(list(reversed(units)), shuffled, {m: list(v)[::-1] for m, v in previous.items()})
    assert again == result
    return result


def test_one_member_gets_everything() -> None:
    result = step(UNITS64, [member(1)], {})
    assert result == {member(1): UNITS64}


def test_no_members_and_no_units() -> None:
    assert assign(UNITS64, [], {}) == {}
    assert assign(UNITS64, [], {member(1): UNITS64[:3]}) == {}
    assert assign([], [member(1), member(2)], {member(1): UNITS64[:3]}) == {
        member(1): (),
        member(2): (),
    }


def test_scale_1_to_4_to_2_moves_the_minimum() -> None:
    a, b, c, d = (member(i) for i in (3, 5, 8, 13))
    one = step(UNITS64, [a], {})
    four = step(UNITS64, [a, b, c, d], one)
    assert len(moved_units(one, four)) == 48  # only the units the newcomers must take
    assert len(four[a]) == 16 and set(four[a]) <= set(one[a])
    two = step(UNITS64, [a, b], four)
    assert len(moved_units(four, two)) == 32  # only the units of the two that left
    assert set(four[a]) <= set(two[a]) and set(four[b]) <= set(two[b])
    assert len(two[a]) == len(two[b]) == 32


def test_joins_one_at_a_time_keep_the_others() -> None:
    members: list[str] = []
    current: dict[str, tuple[Unit, ...]] = {}
    for seq in range(1, 8):
        members.append(member(seq))
        nxt = step(UNITS64, members, current)
        moved = moved_units(current, nxt)
        # every moved unit goes to the newcomer (the rest stay where they were)
        assert moved == set(nxt[member(seq)])
        current = nxt


def test_a_leave_moves_only_the_units_of_the_one_that_left() -> None:
    ms = [member(i) for i in range(1, 5)]
    four = step(UNITS64, ms, {})
    gone = ms[1]
    three = step(UNITS64, [m for m in ms if m != gone], four)
    assert moved_units(four, three) == set(four[gone])
    for m in three:
        assert set(four[m]) <= set(three[m])


def test_the_members_keeping_most_get_the_larger_quotas() -> None:
    units = Unit.all_of(["p"], 10)
    a, b, c = member(1), member(2), member(3)
    previous = {a: units[:2], b: units[2:7], c: units[7:]}  # 2, 5, 3 kept
    result = step(units, [a, b, c], previous)
    assert len(result[b]) == 4  # 10 = 4 + 3 + 3: b keeps the most, so b gets the ceil quota
    assert set(result[b]) <= set(previous[b])
    assert set(result[c]) == set(previous[c])


def test_previous_names_departed_members_and_unknown_units() -> None:
    units = Unit.all_of(["orders", "users"], 4)
    a, b = member(1), member(2)
    previous = {
        a: [Unit("orders", 0), Unit("orders", 1), Unit("gone", 3), Unit("orders", 63)],
        member(99): [Unit("users", 0), Unit("users", 1)],
        b: [Unit("orders", 1), Unit("users", 2)],  # orders.1 twice: a (first) keeps it
    }
    result = step(units, [a, b], previous)
    assert {Unit("orders", 0), Unit("orders", 1)} <= set(result[a])
    assert Unit("users", 2) in result[b]
    assert all(u in units for mine in result.values() for u in mine)


@pytest.mark.parametrize("seed", range(40))
def test_random_histories_stay_even_and_minimal(seed: int) -> None:
    rng = random.Random(seed)
    units = Unit.all_of(["a", "b"], rng.choice([1, 3, 8, 32]))
    pool = [member(i) for i in range(1, 9)]
    current: dict[str, tuple[Unit, ...]] = {}
    for _ in range(8):
        members = rng.sample(pool, rng.randint(1, 6))
        current = step(units, members, current)
