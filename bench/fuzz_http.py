"""HTTP fuzzing: randomised and malformed requests against a running relay and bootstrap server.

Starts a relay process (synthetic fetcher: one partition written all along,
one pre-filled) and a bootstrap server process (SQLite store) following it,
then sends ``--requests`` seeded cases (structured requests over every
endpoint, parameter, header and body, plus raw malformed HTTP: see
``bench/_fuzz_gen.py``) while a probe asks each daemon's ``/healthz`` every
10 ms and a sampler reads each daemon's memory (see ``bench/_fuzz.py`` for
what every figure means).

Goals: ``server_errors`` 0, ``hung`` 0, ``logged_tracebacks`` 0,
``max_loop_block_ms`` <= 50. Failures and log incidents are listed grouped by
cause; ``--report FILE`` writes every one of them (with the requests) as
JSON. The last line of output is one JSON object.

Usage: ``python bench/fuzz_http.py [--requests N] [--seed S] [--relay-only |
--bootstrap-only] [--concurrency C] [--report FILE]``
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from _fuzz import FuzzOptions, run_fuzz, summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--concurrency", type=int, default=8)
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--relay-only", action="store_true", help="fuzz only the relay")
    only.add_argument(
        "--bootstrap-only",
        action="store_true",
        help="fuzz only the bootstrap server (the relay still runs: it feeds it)",
    )
    ap.add_argument("--workdir", type=Path, help="keep data and daemon logs here")
    ap.add_argument("--report", type=Path, help="write the whole result (failures too) here")
    args = ap.parse_args()
    daemons = ("relay",) if args.relay_only else ("bootstrap",) if args.bootstrap_only else None
    opts = FuzzOptions(
        requests=args.requests,
        seed=args.seed,
        daemons=daemons or ("relay", "bootstrap"),
        concurrency=args.concurrency,
        workdir=args.workdir,
        verbose=True,
    )
    result = run_fuzz(opts)
    for line in summary(result):
        print(line)
    if args.report:
        args.report.write_text(json.dumps(result, indent=1))
    for key in ("failures", "incidents", "blocks"):
        result.pop(key)
    print(
        f"{result['requests']:,} cases at {result['requests_per_s']}/s: "
        f"{result['server_errors']} server errors, {result['hung']} hung, "
        f"{result['logged_tracebacks']} logged tracebacks, loop block up to "
        f"{result['max_loop_block_ms']} ms ({result['max_loop_block_alone_ms']} ms in one daemon "
        "alone), private memory growth up to "
        f"{result['max_rss_growth_mb']} MB"
    )
    print(json.dumps(result, separators=(",", ":")))


if __name__ == "__main__":
    main()
