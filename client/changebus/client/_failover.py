"""One failover mechanism over a list of servers (relays or bootstrap servers).

:class:`Failover` is the bookkeeping of a retry loop; the loop itself stays
with the caller::

    failover = Failover(urls, backoff, max_attempts=cfg.max_attempts)
    while True:
        try:
            result = await attempt(failover.url)
        except Exception as exc:
            await failover.failed(exc)   # raises when retrying cannot help
            continue
        failover.succeeded()

Rules, decided by data (the exception's ``retriable`` attribute, which
:mod:`._http` sets from the server's answer and for transport failures):

* a :class:`~._errors.FellOffRelayError` (or a bootstrap server's
  :class:`~changebus.schemas.BootstrapFailedError`: its history starts after
  the position) moves to the next server without counting an attempt; when
  every server said so, the first one's error is raised (the position is
  gone everywhere), and so it is when the others failed in
  :data:`UNREACHABLE_ROUNDS` attempts each in a row (a relay left down, or
  decommissioned but still listed, kept a consumer that had fallen off the
  others waiting for ever instead of bootstrapping: found by review).
  That second way applies to relays only (``unreachable_rounds``): for
  bootstrap servers the way out is a consumer starting from nothing (a
  replica with ``on_unservable=reset`` wipes its tables), so one that is
  re-seeding after a gap (503 ``not_yet``, minutes), busy or restarting is
  retried, bounded by ``max_attempts``; it took one server's refusal as final
  after a few seconds of another's 503s (found by review);
* a retriable error counts one attempt and moves to the next server at once;
  after a whole round of failures it sleeps (:class:`~._backoff.Backoff`,
  exponential with jitter); ``max_attempts`` consecutive failures (0: no
  limit) raise :class:`~._errors.RelayUnavailableError` (quoting a refusal
  of another server, if any);
* anything else (not a :class:`~changebus.schemas.ChangebusError`, or one
  that is not retriable: a bad request, an unknown source) is raised as it is.

:meth:`succeeded` resets the attempts, the round and the backoff.

The list may change while the loop runs (:meth:`set_urls`, e.g. from a
cluster's routing table): the server in use stays when it is still listed,
otherwise the first of the new list is next; a backoff sleep in progress is
cut short so the new list is tried at once. The attempts are not reset (a
list that keeps changing cannot stretch ``max_attempts``). The caller's
position is not the failover's business, so nothing of it is lost.

Not thread-safe: one task owns each instance (:meth:`set_urls` runs on the
same event loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from changebus.schemas import BootstrapFailedError, ChangebusError, SchemaChangedError

from ._backoff import Backoff
from ._errors import FellOffRelayError, RelayUnavailableError
from ._http import safe_url

__all__ = ["UNREACHABLE_ROUNDS", "Failover", "is_retriable"]

log = logging.getLogger(__name__)

#: consecutive failed attempts after which a server counts as unable to serve a
#: position every server that answered said is gone
UNREACHABLE_ROUNDS = 5


def is_retriable(exc: BaseException) -> bool:
    """Whether another attempt may cure ``exc`` (its ``retriable`` attribute)."""
    return isinstance(exc, ChangebusError) and exc.retriable


class Failover:
    """Which server to ask next, and when to give up (module docstring)."""

    def __init__(
        self,
        urls: tuple[str, ...],
        backoff: Backoff,
        *,
        max_attempts: int = 0,
        what: str = "relay",
        unreachable_rounds: int = UNREACHABLE_ROUNDS,
    ) -> None:
        if not urls:
            raise ValueError("Failover needs at least one URL")
        self.urls = urls
        self.index = 0
        #: how many times the server in use changed
        self.switches = 0
        #: consecutive failed attempts
        self.attempts = 0
        self._backoff = backoff
        self._max_attempts = max_attempts
        self._what = what
        #: a server failing this many attempts in a row counts as unable to serve a
        #: position the others said is gone (0: never; module docstring)
        self._unreachable_rounds = unreachable_rounds
        self._failed_in_round = 0
        self._fell_off: dict[str, FellOffRelayError | BootstrapFailedError] = {}
        #: consecutive failed attempts per server since the last success
        self._unreachable: dict[str, int] = {}
        #: set by :meth:`set_urls`: ends a backoff sleep early
        self._changed = asyncio.Event()

    @property
    def url(self) -> str:
        """The server to ask now."""
        return self.urls[self.index]

    def set_urls(self, urls: tuple[str, ...]) -> bool:
        """Use ``urls`` from now on; True when the server in use is no longer listed.

        An empty or unchanged list changes nothing.
        """
        urls = tuple(urls)
        if not urls or urls == self.urls:
            return False
        current = self.url
        self.urls = urls
        moved = current not in urls
        self.index = 0 if moved else urls.index(current)
        if moved:
            self.switches += 1
        self._failed_in_round = 0
        self._fell_off = {u: e for u, e in self._fell_off.items() if u in urls}
        self._unreachable = {u: n for u, n in self._unreachable.items() if u in urls}
        self._changed.set()
        return moved

    def succeeded(self) -> None:
        """The last attempt worked: start counting afresh."""
        self.attempts = 0
        self._failed_in_round = 0
        self._fell_off.clear()
        self._unreachable.clear()
        self._backoff.reset()

    async def failed(self, exc: BaseException) -> None:
        """Account for ``exc``: return to retry (on :attr:`url`), or raise."""
        if isinstance(exc, SchemaChangedError):
            # retriable for the application (start again with the new schema), but no
            # server answers otherwise: it was taken for a server's failure and the same
            # window fetched again for ever, or until "no relay answered" (review)
            raise exc
        if isinstance(exc, FellOffRelayError | BootstrapFailedError):
            # this server cannot serve the position (a relay evicted it, a bootstrap
            # server's history starts after it): another may; raise when none can
            self._fell_off[self.url] = exc
            self._unreachable.pop(self.url, None)
            self._raise_if_gone_everywhere(exc)
            log.warning("%s; trying the next %s", exc.message, self._what)
            self._switch()
            return
        if not is_retriable(exc):
            raise exc
        assert isinstance(exc, ChangebusError)
        self.attempts += 1
        self._unreachable[self.url] = self._unreachable.get(self.url, 0) + 1
        if self._fell_off and self._unreachable_rounds:
            self._raise_if_gone_everywhere(None)
        if self._max_attempts and self.attempts >= self._max_attempts:
            refused = next(iter(self._fell_off.values()), None)
            also = f"; before that: {refused.message}" if refused is not None else ""
            raise RelayUnavailableError(
                f"no {self._what} of {len(self.urls)} answered in {self.attempts} attempts;"
                f" last: {exc.message}{also}"
            ) from exc
        log.warning("%s %s failed: %s", self._what, safe_url(self.url), exc.message)
        self._switch()
        self._failed_in_round += 1
        if self._failed_in_round >= len(self.urls):
            self._failed_in_round = 0
            delay = self._backoff.next_delay()
            log.info("every %s failed; retrying in %.2fs", self._what, delay)
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._changed.wait()  # a new list of servers: try it now

    def _raise_if_gone_everywhere(self, exc: BaseException | None) -> None:
        """Raise the first server's fell-off error when every server either said the
        position is gone or failed :data:`UNREACHABLE_ROUNDS` times in a row."""
        rounds = self._unreachable_rounds
        down = [
            u
            for u in set(self.urls)
            if u not in self._fell_off and rounds and self._unreachable.get(u, 0) >= rounds
        ]
        if len(self._fell_off) + len(down) < len(set(self.urls)):
            return
        if down:
            log.warning(
                "the position is gone from every %s that answered; %s did not answer in "
                "%d attempts each",
                self._what,
                ", ".join(safe_url(u) for u in sorted(down)),
                rounds,
            )
        first = self._fell_off.get(self.urls[0]) or exc or next(iter(self._fell_off.values()))
        raise first from None

    def _switch(self) -> None:
        if len(self.urls) > 1:
            self.index = (self.index + 1) % len(self.urls)
            self.switches += 1
