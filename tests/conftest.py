"""Shared test fixtures: throwaway servers live in fix_*.py plugins."""

import signal

pytest_plugins = ["fix_pg", "fix_mysql", "fix_spark", "fix_blocking", "fix_zk", "fix_tls"]

# A test run started in the background of a shell (``make test &``, nohup, some CI
# runners) inherits SIGINT ignored, and so would every process the tests start:
# the tests that press Ctrl-C on a CLI (SIGINT) would wait for ever. Ignored
# dispositions survive exec, handlers do not: with a handler here, children
# start with Python's default (KeyboardInterrupt), as from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
