"""Run ``changebus`` under cProfile timed by the main thread's CPU clock.

``python bench/_profile_relay.py OUT relay --config FILE``: the statistics go
to OUT when the command ends (SIGTERM included). The clock is
:func:`time.thread_time`, so time spent waiting for a CPU on a loaded
machine, and the CPU of other threads (fetcher, writer), is not attributed
to the event loop's functions (``python -m cProfile`` counts wall time).
"""

from __future__ import annotations

import cProfile
import runpy
import sys
import time


def main() -> None:
    out = sys.argv[1]
    sys.argv = ["changebus", *sys.argv[2:]]
    profile = cProfile.Profile(time.thread_time)
    try:
        profile.runcall(runpy.run_module, "changebus.schemas", run_name="__main__")
    except SystemExit:
        pass
    finally:
        profile.dump_stats(out)


if __name__ == "__main__":
    main()
