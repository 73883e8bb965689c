"""Prometheus metrics of the bootstrap server (``GET /metrics``).

Producer and applier figures are read from the live partition workers when
scraped (a custom collector); the handlers only bump plain counters of what
they served. The seed and chunked snapshot figures
(``changebus_bootstrap_snapshot_*``, labelled by partition only) come from each
partition's seed progress: the row and chunk counters add up every seed run
of this process. The collector joins the app's own ``CollectorRegistry`` (made by
the server frame, :func:`changebus.schemas.server.server_app`, which also
counts the HTTP requests as ``changebus_bootstrap_http_requests_total``):
nothing global. Event loop only: the handlers bump the counters and a
scrape reads them on the loop.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from ._service import BootstrapService
    from ._worker import PartitionWorker

__all__ = ["BootstrapMetrics"]

_GAUGES = {
    "producer_scn": "Newest window SCN in the log",
    "applier_scn": "Newest window SCN folded into the snapshot",
    "applier_lag_events": "Log events not yet folded into the snapshot",
    "applier_lag_scn": "producer_scn - applier_scn",
    "queued_bytes": "Bytes of windows read from the relay and not yet stored in the log "
    "(at most 2 x producer.batch_bytes, or one bigger window)",
    "log_min_scn": "Windows after this SCN are all in the log",
    "tomb_scn": "The newest purged tombstone: positions before it are refused (-1: none purged)",
    "gap_before_scn": "A gap in the log not repaired yet: positions before this SCN are "
    "refused, the snapshot misses what was lost (-1: none)",
}
_COUNTERS = {
    "windows_appended": "Windows appended to the log",
    "events_appended": "Events appended to the log",
    "events_applied": "Log events folded into the snapshot",
    "tombstones_purged": "Tombstones (deleted rows) older than applier.tombstone_keep_s purged",
    "producer_fell_off": "Times the producer fell off the relay",
    "data_loss": "DATA_LOSS windows (SCNs the relay reported lost) received from the relay",
}

#: seed / chunked snapshot figures (``changebus_bootstrap_snapshot_<name>``), per partition:
#: the current (or last) seed run's :class:`~._seedtypes.SeedProgress`
_SNAPSHOT_GAUGES = {
    "chunks_resumed": "Chunks of the current table a resumed snapshot did not read again",
    "tables_done": "Tables the current (or last) seed run has finished",
    "tables_total": "Tables the current (or last) seed run copies",
    "table_rows": "Rows of the current table done (resumed ones included)",
    "table_rows_estimate": "Rows the current table holds, about (-1: unknown)",
    "rows_per_second": "Rows a second the running seed reads (0: none running)",
    "eta_seconds": "Seconds until the current table is done, about (-1: unknown)",
    "running": "1 while a seed or snapshot runs",
    "source_txn_max_seconds": "The current (or last) seed run's longest chunk source "
    "transaction, measured around BEGIN/COMMIT (-1: not measured)",
}
_SNAPSHOT_COUNTERS = {
    "rows": "Rows seeds and snapshots read from the source",
    "chunks": "Chunks seeds and snapshots stored",
}
#: ``changebus_bootstrap_data_loss_events_total`` causes, from the worker's counters
_LOSS_CAUSES = {
    # DATA_LOSS windows the relay sent (SCNs the relay lost: its cause is on the relay)
    "relay_data_loss": "data_loss",
    # the producer fell off the relay: a gap in the log until a seed repairs it
    "producer_fell_off": "fell_off",
}
#: states of a seed run that is under way
_RUNNING = frozenset({"starting", "running", "copied"})


def _snapshot_figures(w: PartitionWorker) -> dict[str, float]:
    """The ``changebus_bootstrap_snapshot_*`` values of ``w`` (its seed progress)."""
    p = w.seed
    running = p.state in _RUNNING
    eta = p.eta_s if running else None
    return {
        "rows": float(w.seed_rows_before + p.rows),
        "chunks": w.seed_chunks_before + p.chunks,
        "chunks_resumed": p.chunks_resumed,
        "tables_done": p.tables_done,
        "tables_total": p.tables_total,
        "table_rows": p.table_rows,
        "table_rows_estimate": p.table_estimate,
        "rows_per_second": p.rate_rows_s if running else 0.0,
        "eta_seconds": -1.0 if eta is None else eta,
        "running": 1.0 if running else 0.0,
        "source_txn_max_seconds": p.txn_max_s,
    }


class BootstrapMetrics:
    """What the handlers served, by partition, plus a collector over the partition workers.

    ``rows_served``, ``catchup_events`` and ``bytes_served`` count snapshot
    rows, catch-up events and page bytes sent, keyed by partition name.
    """

    def __init__(self, service: BootstrapService) -> None:
        self._service = service
        self.rows_served: Counter[str] = Counter()
        self.catchup_events: Counter[str] = Counter()
        self.bytes_served: Counter[str] = Counter()

    def collect(self) -> Iterator[Any]:
        fams = {
            n: GaugeMetricFamily(f"changebus_bootstrap_{n}", h, labels=["partition"])
            for n, h in _GAUGES.items()
        }
        cfams = {
            n: CounterMetricFamily(f"changebus_bootstrap_{n}", h, labels=["partition"])
            for n, h in _COUNTERS.items()
        }
        ready = GaugeMetricFamily(
            "changebus_bootstrap_partition_ready",
            "1 when the partition's producer streams from the relay",
            labels=["partition", "state"],
        )
        for w in self._service.workers.values():
            st = w.status()
            st["applier_lag_scn"] = max(w.producer_scn - w.applier_scn, 0)
            st["gap_before_scn"] = w.gap.before_scn if w.gap is not None else -1
            for n in _GAUGES:
                fams[n].add_metric([w.name], float(st[n]))
            st["producer_fell_off"] = w.fell_off
            for n in _COUNTERS:
                cfams[n].add_metric([w.name], float(st[n]))
            state = w.current_state()
            ready.add_metric([w.name, state], 1.0 if state == "streaming" else 0.0)
        served = CounterMetricFamily(
            "changebus_bootstrap_served",
            "Snapshot rows, catch-up events and bytes sent",
            labels=["partition", "what"],
        )
        yield from self._operator()
        for name in self._service.workers:
            served.add_metric([name, "snapshot_rows"], float(self.rows_served[name]))
            served.add_metric([name, "catchup_events"], float(self.catchup_events[name]))
            served.add_metric([name, "bytes"], float(self.bytes_served[name]))
        yield from fams.values()
        yield from cfams.values()
        yield from (ready, served)
        yield from self._snapshot()

    def _operator(self) -> Iterator[Any]:
        """Readiness and data loss by cause (the names operators alert on: docs/metrics.md)."""
        ready = GaugeMetricFamily(
            "changebus_bootstrap_ready", "1 when /readyz answers 200 (every partition streams)"
        )
        ready.add_metric([], 1.0 if self._service.ready else 0.0)
        loss = CounterMetricFamily(
            "changebus_bootstrap_data_loss_events",
            "Data lost to the log, by cause: DATA_LOSS windows from the relay, falls off it",
            labels=["partition", "cause"],
        )
        for w in self._service.workers.values():
            for cause, attr in _LOSS_CAUSES.items():
                loss.add_metric([w.name, cause], float(getattr(w, attr)))
        yield from (ready, loss)

    def _snapshot(self) -> Iterator[Any]:
        gauges = {
            n: GaugeMetricFamily(f"changebus_bootstrap_snapshot_{n}", h, labels=["partition"])
            for n, h in _SNAPSHOT_GAUGES.items()
        }
        counters = {
            n: CounterMetricFamily(f"changebus_bootstrap_snapshot_{n}", h, labels=["partition"])
            for n, h in _SNAPSHOT_COUNTERS.items()
        }
        for w in self._service.workers.values():
            figures = _snapshot_figures(w)
            for n, gauge in gauges.items():
                gauge.add_metric([w.name], figures[n])
            for n, counter in counters.items():
                counter.add_metric([w.name], figures[n])
        yield from gauges.values()
        yield from counters.values()
