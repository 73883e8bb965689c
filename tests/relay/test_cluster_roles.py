"""A partition role's bookkeeping, driven directly with stand-ins for the election, the
member and the host (the ZooKeeper and relay tests cover the whole; these pin cases
found by review that a cluster only meets after ZooKeeper lost its data or with a
member that cannot build its fetcher)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from changebus.relay._cluster import PartitionRole


def _role(**host: Any) -> Any:
    role: Any = object.__new__(PartitionRole)
    meta = SimpleNamespace(min_scn=5, last_scn=50)
    role.host = SimpleNamespace(buffer=SimpleNamespace(meta=meta), syncer=None, **host)
    role.plan = ("none", 0, "")
    role.min_epoch = 0
    role.name = "p"
    role.member_id = "m"
    role.step_down_reason = ""
    role._unread_since = 0.0
    role._failing = (0, 0.0)
    role._kick = SimpleNamespace(set=lambda: None)
    return role


def test_a_member_that_stepped_down_registers_the_newest_epoch_it_saw() -> None:
    """Stepped down (epoch None), a member registered epoch 0: after ZooKeeper lost its
    data, a leader of a smaller epoch never learned of the newer one this member refuses
    to follow, and neither ever moved (review)."""
    role = _role(epoch=None)
    role.min_epoch = 10
    state = role.state()
    assert state.role == "follower" and state.epoch == 10
    role.host.epoch = 12  # following (or leading) a newer one: that one
    assert role.state().epoch == 12


def test_a_term_whose_role_change_keeps_failing_is_given_up() -> None:
    """A member elected whose fetcher cannot be built (options it lacks) failed its role
    change every half second and kept the term for good: nobody else could lead."""
    requeued: list[str] = []
    term = SimpleNamespace(epoch=7, lost=False)
    role = _role(epoch=None)
    role.election = SimpleNamespace(leadership=term, requeue=requeued.append)
    role.member = SimpleNamespace(config=SimpleNamespace(source_give_up_s=0.2))
    role._give_up_if_failing()  # the first failure starts the clock
    assert requeued == []
    time.sleep(0.25)
    role._give_up_if_failing()
    assert len(requeued) == 1 and "could not take up its term" in requeued[0]
    term.epoch = 8  # a new term: its own clock
    role._give_up_if_failing()
    assert len(requeued) == 1
