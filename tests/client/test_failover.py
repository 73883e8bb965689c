"""The failover's verdicts when some relays say the position is gone and others do not answer.

Found by review: relay A answered 410 (the consumer fell off it) while relay B
did not answer at all (down, or decommissioned but still listed). With the
default ``max_attempts = 0`` the consumer alternated between them for ever and
never bootstrapped. Now a relay that failed ``UNREACHABLE_ROUNDS`` attempts in a
row counts as unable to serve the position, and the fell-off error is raised.
"""

from __future__ import annotations

import pytest

from changebus.client._backoff import Backoff
from changebus.client._errors import FellOffRelayError
from changebus.client._failover import UNREACHABLE_ROUNDS, Failover
from changebus.schemas import TransportError


def _gone(relay: str) -> FellOffRelayError:
    return FellOffRelayError(
        "410", partition="p", requested_scn=5, oldest_scn=9, prev_scn=8, relay=relay
    )


async def _a_gone_b_down(f: Failover, attempts: int) -> int:
    """Relay a says 410, relay b does not answer; b's failures until one raises."""
    failures = 0
    for _ in range(attempts):
        if f.url == "http://a":
            await f.failed(_gone("a"))
        else:
            failures += 1
            await f.failed(TransportError("connection refused"))
    return failures


async def test_a_relay_that_never_answers_does_not_keep_a_fallen_off_consumer_waiting() -> None:
    f = Failover(("http://a", "http://b"), Backoff(0.001, 0.001), max_attempts=0)
    with pytest.raises(FellOffRelayError) as raised:
        await _a_gone_b_down(f, 1000)
    assert raised.value.oldest_scn == 9
    assert f._unreachable["http://b"] == UNREACHABLE_ROUNDS


async def test_a_relay_that_answers_again_is_asked_and_a_success_starts_afresh() -> None:
    f = Failover(("http://a", "http://b"), Backoff(0.001, 0.001), max_attempts=0)
    for _ in range(UNREACHABLE_ROUNDS - 1):  # b fails, but not yet long enough
        assert f.url == "http://a"
        await f.failed(_gone("a"))
        assert f.url == "http://b"
        await f.failed(TransportError("connection refused"))
    f.succeeded()  # b answered: nothing is gone everywhere
    for _ in range(UNREACHABLE_ROUNDS - 1):
        if f.url == "http://a":
            await f.failed(_gone("a"))
        await f.failed(TransportError("connection refused"))
    # a lone relay that says 410 still raises at once
    lone = Failover(("http://a",), Backoff(0.001, 0.001))
    with pytest.raises(FellOffRelayError):
        await lone.failed(_gone("a"))
