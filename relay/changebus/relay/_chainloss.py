"""Where a follower's loss ends when its upstream relays evicted what follows its position.

:func:`loss_end` asks every upstream relay of a chained partition (``GET
/v1/status``) before the follower records a DATA_LOSS window, and finds the
smallest ``prev_scn`` past the follower's position: each upstream evicts at
its own pace, so the one whose 410 ended the stream may have lost more than
another still holds.

Not thread-safe: runs on the relay's event loop (the module's clock table
:data:`_FELL_OFF_AT` is shared by the fetchers of one process).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from changebus.client import FellOffRelayError, RelayQueries, safe_url
from changebus.schemas import ChangebusError, SourceError

__all__ = ["loss_end"]

log = logging.getLogger("changebus.relay.chain")

#: how long a follower that fell off one upstream waits for a silent one to say whether
#: it holds the windows, before it records them lost (seconds)
_CONFIRM_S = 60.0
#: (partition, upstream URLs, position) -> monotonic time of the first fall-off there.
#: Kept across fetchers (the relay makes a new one at each retry); keyed by position
#: too, so that two relays of one process following the same partition from
#: different positions keep their own clocks (one key by partition alone was reset
#: by each in turn, and neither ever stopped waiting). Entries older than
#: :data:`_FORGET_S` are dropped when one is added.
_FELL_OFF_AT: dict[tuple[str, tuple[str, ...], int], float] = {}
_FORGET_S = 600.0


async def loss_end(
    queries: RelayQueries,
    name: str,
    upstream_partition: str,
    upstream: Sequence[str],
    position: int,
    exc: FellOffRelayError,
) -> tuple[int, str, str]:
    """Unless every upstream answers and lacks what follows our position: a retriable
    :class:`SourceError` (read again later), never a DATA_LOSS window or an emptied buffer.

    Returns where the loss ends: (SCN, source position, upstream), the smallest
    ``prev_scn`` past our position among the upstreams that answered (the one
    that said 410 included). Upstreams evict at their own pace: the first
    refusal's ``prev_scn`` lost what another one still holds (review).

    The stream gives up once one upstream refused the position (410) and the
    others failed to answer a few times in a row: right for a consumer, which
    may bootstrap after. A relay cannot take back a DATA_LOSS window or its
    emptied buffer, and an upstream that was down for a moment (a rolling
    restart) may hold every window (found by review). An upstream that answers
    with a non-retriable error (it lacks the partition) holds nothing, nor one
    whose buffer does not reach past our position (empty, or behind). One that
    stays silent is waited for :data:`_CONFIRM_S` from the first fall-off at this
    position, then the loss is recorded (a dead URL in the list must not keep the
    partition from ever passing the gap: review).
    """
    now = time.monotonic()
    key = (name, tuple(upstream), position)
    since = _FELL_OFF_AT.get(key)
    if since is None:
        for old in [k for k, t in _FELL_OFF_AT.items() if now - t > _FORGET_S]:
            del _FELL_OFF_AT[old]
        _FELL_OFF_AT[key] = since = now
    patient = now - since < _CONFIRM_S
    end = (exc.prev_scn, exc.prev_position, safe_url(exc.relay))
    for url in queries.urls:
        if url == exc.relay:
            continue
        info = queries.info(url)
        try:
            found = (await info.status()).get(upstream_partition)
        except Exception as failed:  # noqa: BLE001 - transport errors included
            if isinstance(failed, ChangebusError) and not failed.retriable:
                continue
            if not patient:
                log.warning(
                    "partition %s: %s did not answer for %.0f s whether it holds SCN %d;"
                    " recording the loss",
                    name,
                    safe_url(url),
                    _CONFIRM_S,
                    position + 1,
                )
                continue
            raise SourceError(
                f"partition {name}: {safe_url(exc.relay)} no longer holds SCN"
                f" {position + 1}, and {safe_url(url)} did not answer whether it"
                " does; reading again before recording anything"
            ) from None
        if found is None or found.max_scn <= position:
            continue  # (holds nothing past our position)
        if found.prev_scn <= position:
            raise SourceError(
                f"partition {name}: {safe_url(exc.relay)} no longer holds SCN"
                f" {position + 1}, {safe_url(url)} does; reading again"
            )
        if found.prev_scn < end[0]:
            end = (found.prev_scn, str(found.raw.get("prev_position") or ""), safe_url(url))
    return end
