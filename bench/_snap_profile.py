"""Runs ``changebus <args>`` with every thread under its own cProfile (bench/snapshot.py --profile).

``python bench/_snap_profile.py DIR changebus-args...``: each thread that
ends (and the main thread, at exit) writes ``DIR/<thread name>-<n>.prof``;
read them with :mod:`pstats` (``python -m pstats FILE``). The profiler's
overhead slows Python code about 2x: use the files for shares, not rates.
"""

from __future__ import annotations

import cProfile
import itertools
import sys
import threading
from pathlib import Path

_count = itertools.count()


def _dump(out: Path, name: str, prof: cProfile.Profile) -> None:
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in name)
    prof.dump_stats(out / f"{safe}-{next(_count)}.prof")


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    run = threading.Thread.run

    def profiled(self: threading.Thread) -> None:
        prof = cProfile.Profile()
        prof.enable()
        try:
            run(self)
        finally:
            prof.disable()
            _dump(out, self.name, prof)

    threading.Thread.run = profiled  # type: ignore[method-assign]
    sys.argv = ["changebus", *sys.argv[2:]]
    from changebus.schemas._cli import main as cli

    prof = cProfile.Profile()
    prof.enable()
    try:
        return int(cli() or 0)
    finally:
        prof.disable()
        _dump(out, "main", prof)


if __name__ == "__main__":
    sys.exit(main())
