"""Prometheus metrics of the relay (``GET /metrics``).

Buffer and fetcher figures are read from the live objects when scraped (a
custom collector), so the hot paths only bump plain counters. The collector
joins the relay app's own ``CollectorRegistry`` (made by the server frame,
:func:`changebus.schemas.server.server_app`, which also counts the HTTP
requests): nothing global, several relays can live in one process (tests do
that). Event loop only: the handlers bump the counters and a scrape reads
them on the loop.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    SummaryMetricFamily,
)

from ._lagmetrics import lag_families

if TYPE_CHECKING:
    from changebus.schemas.server import CopyBudget

    from ._config import MetricsConfig
    from ._host import PartitionHost

__all__ = ["RelayMetrics"]

_GAUGES = (
    ("min_scn", "Oldest window SCN in the buffer (-1: empty)"),
    ("max_scn", "Newest window SCN in the buffer"),
    ("prev_scn", "Newest evicted window SCN: consumers at or after it missed nothing"),
    ("bytes_used", "Bytes of events held"),
    ("capacity_bytes", "Buffer capacity in bytes"),
    ("events", "Events held"),
    ("windows", "Windows (transactions) held"),
)
_COUNTERS = (
    ("windows_appended", "Windows appended"),
    ("events_appended", "Events appended"),
    ("bytes_appended", "Bytes appended"),
    ("windows_evicted", "Windows evicted to make room"),
    ("windows_refused", "Windows refused as too large"),
    ("windows_data_loss", "Windows replaced by a data-loss marker"),
    ("pins_overrun", "Responses overrun by the writer (slow readers)"),
    ("fetcher_restarts", "Fetcher restarts after errors"),
)


class RelayMetrics:
    """Counters updated by handlers plus a collector over the partitions.

    ``hosts`` is the relay's live partition map (filled at start-up): a
    scrape reports the partitions open at that moment. ``ready`` answers
    what ``/readyz`` would (``changebus_relay_ready``); ``config`` bounds the
    consumer series (:mod:`._lagmetrics`).
    """

    def __init__(
        self,
        hosts: dict[str, PartitionHost],
        config: MetricsConfig,
        ready: Callable[[], bool],
        copies: CopyBudget,
    ) -> None:
        self._hosts = hosts
        self._copies = copies
        self._config = config
        self._ready = ready
        self._fell_off: Counter[str] = Counter()
        self._streamed_bytes: Counter[str] = Counter()
        self._streamed_events: Counter[str] = Counter()
        self._overruns: Counter[str] = Counter()
        self._aborted: Counter[str] = Counter()

    def streamed(self, partition: str, nbytes: int, events: int) -> None:
        self._streamed_bytes[partition] += nbytes
        self._streamed_events[partition] += events

    def overrun(self, partition: str) -> None:
        self._overruns[partition] += 1

    def aborted(self, partition: str) -> None:
        """A response cut off because its client read nothing for the send timeout."""
        self._aborted[partition] += 1

    def fell_off(self, partition: str) -> None:
        """A pull answered 410: its checkpoint is older than the buffer keeps."""
        self._fell_off[partition] += 1

    def collect(self) -> Iterator[Any]:
        gauges = {
            n: GaugeMetricFamily(f"changebus_relay_buffer_{n}", h, labels=["partition"])
            for n, h in _GAUGES
        }
        counters = {
            n: CounterMetricFamily(f"changebus_relay_{n}", h, labels=["partition"])
            for n, h in _COUNTERS
        }
        ready = GaugeMetricFamily(
            "changebus_relay_partition_ready",
            "1 when the partition's fetcher streams",
            labels=["partition", "state"],
        )
        consumers = GaugeMetricFamily(
            "changebus_relay_consumers",
            "Consumers seen in the last 5 minutes",
            labels=["partition"],
        )
        fetcher = GaugeMetricFamily(
            "changebus_relay_fetcher", "Fetcher-specific figures", labels=["partition", "figure"]
        )
        leader = GaugeMetricFamily(
            "changebus_relay_partition_leader",
            "1 while this relay leads the partition in its cluster (reads the source)",
            labels=["partition", "role"],
        )
        epoch = GaugeMetricFamily(
            "changebus_relay_partition_epoch",
            "The leadership epoch the partition serves under (led or followed)",
            labels=["partition"],
        )
        syncs = CounterMetricFamily(
            "changebus_relay_syncs",
            "Grouped syncs of the buffer to disk (durability = fsync)",
            labels=["partition"],
        )
        sync_seconds = SummaryMetricFamily(
            "changebus_relay_sync_seconds",
            "Time the grouped syncs took (durability = fsync)",
            labels=["partition"],
        )
        synced_scn = GaugeMetricFamily(
            "changebus_relay_synced_scn",
            "Newest SCN on disk: the source is acknowledged no further (durability = fsync)",
            labels=["partition"],
        )
        for host in self._hosts.values():
            syncer = host.syncer
            if syncer is not None:
                syncs.add_metric([host.name], float(syncer.syncs))
                sync_seconds.add_metric([host.name], syncer.syncs, syncer.sync_seconds_total)
                synced_scn.add_metric([host.name], float(syncer.synced_scn))
            if host.role:
                leader.add_metric([host.name, host.role], 1.0 if host.role == "leader" else 0.0)
            if host.epoch is not None:
                epoch.add_metric([host.name], float(host.epoch))
            st = host.status(consumers=False)
            for n in gauges:
                gauges[n].add_metric([host.name], float(st[n]))
            for n in counters:
                counters[n].add_metric([host.name], float(st["stats"].get(n, 0)))
            ready.add_metric([host.name, host.state], 1.0 if host.ready else 0.0)
            consumers.add_metric([host.name], float(st["consumer_count"]))
            for key, value in st.get("fetcher", {}).items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    fetcher.add_metric([host.name, key], float(value))
        streamed_b = CounterMetricFamily(
            "changebus_relay_streamed_bytes", "Event bytes sent to consumers", labels=["partition"]
        )
        streamed_e = CounterMetricFamily(
            "changebus_relay_streamed_events", "Events sent to consumers", labels=["partition"]
        )
        forgotten = CounterMetricFamily(
            "changebus_relay_consumers_forgotten",
            "Consumers dropped from the status table for want of room (more distinct "
            "client ids than http.max_connections, at least 1,000)",
            labels=["partition"],
        )
        aborted = CounterMetricFamily(
            "changebus_relay_responses_aborted",
            "Responses cut off because the client read nothing for http.send_timeout_s",
            labels=["partition"],
        )
        for name in self._hosts:
            streamed_b.add_metric([name], float(self._streamed_bytes[name]))
            streamed_e.add_metric([name], float(self._streamed_events[name]))
            aborted.add_metric([name], float(self._aborted[name]))
            forgotten.add_metric([name], float(self._hosts[name].consumers_forgotten))
        yield from gauges.values()
        yield from counters.values()
        yield from (ready, consumers, fetcher, streamed_b, streamed_e, aborted, forgotten)
        yield from (leader, epoch)
        yield from (syncs, sync_seconds, synced_scn)
        yield from self._copy_families()
        yield from lag_families(self._hosts, self._config, self._ready, self._fell_off)

    def _copy_families(self) -> Iterator[Any]:
        c = self._copies
        for name, value, text in (
            ("copy_bytes", c.held, "Bytes of response copies held for clients now"),
            ("copy_peak_bytes", c.peak, "Most bytes of response copies held at once"),
            ("copy_limit_bytes", c.limit, "http.max_copy_bytes"),
        ):
            gauge = GaugeMetricFamily(f"changebus_relay_{name}", text)
            gauge.add_metric([], float(value))
            yield gauge
        cut = CounterMetricFamily(
            "changebus_relay_copy_grants_cut",
            "Follow pushes and ndjson answers made smaller because the copy budget was busy",
        )
        cut.add_metric([], float(c.cut))
        yield cut
