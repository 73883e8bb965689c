"""A short run of the HTTP fuzzing benchmark (``bench/fuzz_http.py``) against real daemons.

1,000 seeded cases (structured requests over every endpoint, parameter,
header and body of the relay and the bootstrap server, plus raw malformed
HTTP) against a relay process and a bootstrap server process: no answer may
be a server error (5xx other than a documented retriable 503), no case may
hang, neither daemon may log a traceback or the seed DSN's password, and no
request may block a daemon's event loop for a second.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from _fuzz import FuzzOptions, run_fuzz, summary
from _fuzz_gen import Generator, Target

TARGET = Target(
    partitions=("fill", "fz"),
    sources=("synthetic.t0", "synthetic.t1", "synthetic.t2"),
    scns={"fz": (1000, 2000), "fill": (1000, 2999)},
    boot={"fz": (999, 1990, 2000), "fill": (999, 2999, 2999)},
    ports={"relay": 1, "bootstrap": 2},
)


def test_the_generator_is_seeded_and_reaches_every_endpoint() -> None:
    both = ("relay", "bootstrap")
    gen, again, other = (
        Generator(7, TARGET, both),
        Generator(7, TARGET, both),
        Generator(8, TARGET, both),
    )
    cases = [gen.next() for _ in range(1500)]
    assert [c.data for c in cases] == [again.next().data for _ in range(1500)]
    assert [c.data for c in cases[:20]] != [other.next().data for _ in range(20)]
    seen = {f"{c.daemon} {c.endpoint}" for c in cases}
    routes = ("/v1/stream", "/v1/sources", "/v1/status", "/v1/splits", "/healthz", "/readyz")
    for route in (*routes, "/metrics"):
        assert f"relay GET {route}" in seen, route
    for route in ("start", "status", "snapshot", "catchup"):
        assert f"bootstrap GET /v1/bootstrap/{route}" in seen, route
    assert {"relay GET /v1/schemas/{source}", "bootstrap POST /v1/seed"} <= seen
    assert {"bootstrap GET /v1/sources", "bootstrap GET /v1/status"} <= seen
    raw = {e.split(":", 1)[1] for e in seen if " raw:" in e}
    assert raw >= {"garbage", "truncated", "slowloris", "pipelined", "abrupt_close", "header"}


@pytest.mark.slow
def test_a_thousand_fuzzed_requests_get_no_server_error_hang_or_traceback(
    tmp_path: Path,
) -> None:
    result = run_fuzz(FuzzOptions(requests=1000, seed=17, workdir=tmp_path))
    report = "\n".join(summary(result))
    assert result["requests"] == 1000
    assert result["daemon_exits"] == {}, report
    assert result["server_errors"] == 0, report
    assert result["hung"] == 0, report
    assert result["logged_tracebacks"] == 0, report
    assert result["secret_leaks"] == 0, report
    # the benchmark's goal is 50 ms; a loaded test machine gets a wide margin, still far
    # below what a request that blocks the event loop costs (seconds), and the stalls of
    # both daemons at once (the machine's, not a request's) are left out
    assert result["max_loop_block_alone_ms"] < 1000, report
