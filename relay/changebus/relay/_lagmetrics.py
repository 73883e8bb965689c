"""The relay's operator metrics: readiness, fetcher state, source lag, consumer lag, data loss.

One job: turn the live state of the partitions into the metric families an
operator alerts on (docs/metrics.md lists them with their labels and
bounds). Everything is computed when ``/metrics`` is scraped, from state the
relay keeps anyway (the buffer's published :class:`~._meta.BufferMeta`, the
host's consumer table, the fetcher's figures); the hot paths add nothing per
event (the ingest notes one wall-clock time per group commit).

Families are always emitted, with or without samples, so that dashboards
and alert rules can name them before the first sample exists.

Label cardinality: ``partition`` is bounded by the configuration, ``state``
by :data:`~._host.STATES`, ``cause`` by the causes below, ``consumer`` by
``metrics.max_consumer_series`` per partition (the most lagging consumers;
the others are folded into ``consumer="_other"``, which carries their
largest lag).

Data-loss causes (``changebus_relay_data_loss_events_total{cause}``), each a
DATA_LOSS window the relay appended instead of data:

* ``window_too_large``: a window over the partition's ``max_window_bytes``;
* ``window_too_many_events``: a window with more events than the event table holds;
* ``recovery``: windows a crash cut off, found by recovery at start-up;
* ``slot_lost``: (Postgres) the slot no longer holds the relay's position;
* ``binlog_purged``: (MariaDB/MySQL) the binlog the relay needs was purged;
* ``divergent_server``: (MariaDB/MySQL) the source server changed (failover)
  and its binlog does not continue the relay's;
* ``transaction_too_large``: a source transaction over ``max_transaction_bytes``
  (``on_oversized_transaction = "skip"``);
* ``xa_prepared_before_start``: (MariaDB/MySQL) the XA COMMIT of a transaction
  prepared before the fetcher's first start (its rows were never read);
* ``fell_off_upstream``: (a relay following a relay) the upstream evicted
  what this relay had not read yet.

DATA_LOSS windows a follower copies from its upstream are counted where
they were made (the upstream), not again on every follower.

Event loop only (a scrape runs on the loop; the buffer lookups take the
buffer's lock briefly).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ._host import STATES
from ._hoststatus import CONSUMER_TTL_S, consumer_lag_seconds, source_lag_seconds

if TYPE_CHECKING:
    from ._config import MetricsConfig
    from ._host import PartitionHost

__all__ = ["OTHER_CONSUMERS", "lag_families"]

#: the consumer label of the consumers beyond ``metrics.max_consumer_series``
OTHER_CONSUMERS = "_other"
#: the consumer label of those that sent no ``client=`` id (the relay names them by
#: their address in its admin-only status; ``/metrics`` is often open: no addresses)
UNNAMED_CONSUMERS = "_unnamed"


def lag_families(
    hosts: dict[str, PartitionHost],
    config: MetricsConfig,
    ready: Callable[[], bool],
    fell_off: Counter[str],
) -> Iterator[Any]:
    """The operator families of ``hosts`` (see the module docstring)."""
    ready_g = GaugeMetricFamily(
        "changebus_relay_ready", "1 when /readyz answers 200 (every partition ready), else 0"
    )
    ready_g.add_metric([], 1.0 if ready() else 0.0)
    state = GaugeMetricFamily(
        "changebus_relay_fetcher_state",
        "Ingest state of the partition: 1 for the current state, 0 for the others",
        labels=["partition", "state"],
    )
    lag = GaugeMetricFamily(
        "changebus_relay_source_lag_seconds",
        "When the newest window was appended minus its source commit time",
        labels=["partition"],
    )
    idle = GaugeMetricFamily(
        "changebus_relay_source_idle_seconds",
        "Seconds since the last window was appended (or since start when none was)",
        labels=["partition"],
    )
    wal = GaugeMetricFamily(
        "changebus_relay_source_retained_wal_bytes",
        "WAL the replication slot holds back on the Postgres source",
        labels=["partition"],
    )
    binlog = GaugeMetricFamily(
        "changebus_relay_source_binlog_distance_bytes",
        "Binlog bytes between the MariaDB/MySQL source's newest position and the relay's",
        labels=["partition"],
    )
    lag_scn = GaugeMetricFamily(
        "changebus_relay_consumer_lag_scn",
        "SCNs between the newest window and a consumer's checkpoint",
        labels=["partition", "consumer"],
    )
    lag_s = GaugeMetricFamily(
        "changebus_relay_consumer_lag_seconds",
        "Source commit time of the newest window minus that of the first window a consumer "
        "has not read (0: caught up)",
        labels=["partition", "consumer"],
    )
    loss = CounterMetricFamily(
        "changebus_relay_data_loss_events",
        "DATA_LOSS windows appended instead of data, by cause",
        labels=["partition", "cause"],
    )
    fell = CounterMetricFamily(
        "changebus_relay_consumers_fell_off",
        "Pulls answered 410: the checkpoint is older than the buffer keeps",
        labels=["partition"],
    )
    now = time.time()
    for host in hosts.values():
        name = host.name
        for s in STATES:
            state.add_metric([name, s], 1.0 if host.state == s else 0.0)
        if host.config.fetcher.kind != "none":
            source_lag = source_lag_seconds(host)
            if source_lag is not None:
                lag.add_metric([name], source_lag)
            idle.add_metric([name], max(now - (host.appended_at or host.started_at), 0.0))
        if host.fetcher is not None:
            figures = host.fetcher.status()
            _figure(wal, name, figures.get("retained_wal_bytes"))
            _figure(binlog, name, figures.get("binlog_distance_bytes"))
        _consumers(host, config.max_consumer_series, lag_scn, lag_s)
        for cause, n in sorted(host.data_loss_events().items()):
            loss.add_metric([name, cause], float(n))
        fell.add_metric([name], float(fell_off[name]))
    yield from (ready_g, state, lag, idle, wal, binlog, lag_scn, lag_s, loss, fell)


def _figure(family: GaugeMetricFamily, partition: str, value: object) -> None:
    """A fetcher figure when it is known (the fetchers say -1 or nothing when not)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
        family.add_metric([partition], float(value))


def _consumers(
    host: PartitionHost, cap: int, lag_scn: GaugeMetricFamily, lag_s: GaugeMetricFamily
) -> None:
    """The consumer lag series of one partition: the ``cap`` most lagging, then ``_other``.

    Lag order is checkpoint order (an older checkpoint lags more, in SCNs and
    in seconds), so the consumers are sorted by checkpoint and only the
    series emitted cost a buffer lookup.
    """
    m = host.buffer.meta
    if m.last_scn < 0:
        return
    floor = time.monotonic() - CONSUMER_TTL_S
    # a consumer reading "from the oldest" (-1) lags by everything held
    oldest = m.min_scn - 1 if m.min_scn >= 0 else m.last_scn
    ordered = sorted(
        (c.scn if c.scn >= 0 else oldest, UNNAMED_CONSUMERS if client == c.peer else client)
        for client, c in list(host.consumers.items())
        if c.last_seen >= floor
    )
    # the unnamed ones: one series, the most lagging of them (the first in order)
    unnamed = [x for x in ordered if x[1] == UNNAMED_CONSUMERS][:1]
    seen = sorted([x for x in ordered if x[1] != UNNAMED_CONSUMERS] + unnamed)
    shown = seen[:cap]
    if len(seen) > cap:
        shown.append((seen[cap][0], OTHER_CONSUMERS))  # the most lagging of the rest
    lags: dict[int, float] = {}  # by position: followers at the tail share one lookup
    for scn, client in shown:
        lag_scn.add_metric([host.name, client], float(max(m.last_scn - scn, 0)))
        found = lags.get(scn)
        if found is None:
            found = lags[scn] = consumer_lag_seconds(host, scn)
        lag_s.add_metric([host.name, client], found)
