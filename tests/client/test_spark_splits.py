"""The Spark source's planning of ``splitBy=scn``: sub-ranges from the relay's split points.

Driver-side only (no Spark session): the planner's calls against a real relay.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from spark_source_support import relay_config, wait_finished

from changebus.client.spark._options import SourceOptions
from changebus.client.spark._plan import _range_partitions, _split_points
from fix_spark import RelayThread

pytestmark = [pytest.mark.spark, pytest.mark.timeout(120)]


def test_scn_split_is_the_default_and_takes_the_relays_cut_points(tmp_path: Path) -> None:
    synthetic = {
        "windows_per_s": 0,
        "max_windows": 400,
        "events_per_window": 3,
        "row_bytes": 40,
        "tables": 2,
    }
    with RelayThread(relay_config(tmp_path, "synthetic", synthetic)) as relay:
        wait_finished(relay)
        m = relay.meta("syn")
        opts = SourceOptions.parse({"relays": relay.url, "numPartitions": "4"}, mode="batch")
        assert opts.split_by == "scn"
        start, end = {"syn": m.prev_scn}, {"syn": m.last_scn}
        cuts = _split_points(opts, start, end)
        buffer = relay.relay.hosts["syn"].buffer
        assert cuts == {"syn": buffer.split_points(m.prev_scn, m.last_scn, 4)}
        assert len(cuts["syn"]) == 3
        parts = _range_partitions(opts, start, end, cuts=cuts)
        ranges = [(p.spec.since, p.spec.until) for p in parts]
        # contiguous, covering the whole range, a quarter of the 400 windows each
        assert ranges[0][0] == m.prev_scn and ranges[-1][1] == m.last_scn
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
        assert all(abs((b - a) - 100) <= 1 for a, b in ranges), ranges
        assert {p.spec.key_filter for p in parts} == {None}
        # with sources, only their events count (the relay's registry names the ids)
        t0 = SourceOptions.parse(
            {"relays": relay.url, "numPartitions": "4", "sources": "synthetic.t0"}, mode="batch"
        )
        t0_id = relay.relay.hosts["syn"].registry.source_id("synthetic.t0")
        assert _split_points(t0, start, end) == {
            "syn": buffer.split_points(m.prev_scn, m.last_scn, 4, frozenset({t0_id}))
        }
        # from earliest (-1) the relay cuts too (the even SCN cut could not: one task)
        early = _split_points(opts, {"syn": -1}, end)
        assert len(early["syn"]) == 3
        assert len(_range_partitions(opts, {"syn": -1}, end, cuts=early)) == 4
        assert len(_range_partitions(opts, {"syn": -1}, end, cuts={})) == 1
        # a relay that cannot answer (here: no such partition, a 404) leaves the even SCN cut
        assert _split_points(opts, {"nope": 0}, {"nope": 100}) == {}
        even = _range_partitions(opts, {"x": 0}, {"x": 100}, cuts={})
        assert [(p.spec.since, p.spec.until) for p in even] == [
            (0, 25),
            (25, 50),
            (50, 75),
            (75, 100),
        ]
        # key-hash slices ask the relay nothing: numPartitions slices of the whole range
        key = SourceOptions.parse(
            {"relays": relay.url, "numPartitions": "4", "splitBy": "key"}, mode="batch"
        )
        assert _split_points(key, start, end) == {}
        sliced = _range_partitions(key, start, end)
        assert len({p.spec.key_filter for p in sliced}) == 4
        assert {(p.spec.since, p.spec.until) for p in sliced} == {(m.prev_scn, m.last_scn)}
