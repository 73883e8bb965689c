"""``changebus demo``: a private Postgres, a relay, consumers; live changes and a checked summary."""

from __future__ import annotations

import glob
import json
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from test_client_cli import ENV

pytestmark = pytest.mark.pg

DEMO = [sys.executable, "-m", "changebus.schemas", "demo"]


def leftovers() -> set[str]:
    return set(glob.glob(f"{tempfile.gettempdir()}/changebus-demo-*"))


def test_demo_prints_live_changes_and_a_checked_summary() -> None:
    before = leftovers()
    done = subprocess.run(
        [*DEMO, "--seconds", "3", "--rate", "25", "--json"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    changes = [json.loads(line) for line in lines if line.startswith("{")]
    assert len(changes) >= 20
    assert {c["table"] for c in changes} == {"shop.customers", "shop.orders"}
    assert {"insert", "update"} <= {c["op"] for c in changes}
    ids = [(c["scn"], c["seq"]) for c in changes]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    summary = [line for line in lines if line.startswith("# ")]
    assert any(f"# summary: {len(changes)} changes" in line for line in summary), summary
    replica = next(line for line in summary if line.startswith("# SQLite replica vs source"))
    assert replica.count(" equal") == 2 and "DIFFERENT" not in replica
    # the consumer that joined late caught up through the bootstrap server
    late = next(line for line in summary if line.startswith("# late consumer:"))
    assert int(late.split()[3]) > 0, late  # rows from the bootstrap snapshot
    late_check = next(line for line in summary if "late consumer's replica" in line)
    assert late_check.count(" equal") == 2 and "DIFFERENT" not in late_check
    assert leftovers() <= before  # the private server's directory is gone


def test_demo_stops_cleanly_on_ctrl_c() -> None:
    proc = subprocess.Popen(
        [*DEMO, "--seconds", "120", "--rate", "20"],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    started = time.monotonic()
    for line in proc.stdout:  # wait for the first transaction
        if line.startswith("SCN "):
            break
        assert time.monotonic() - started < 120
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    assert "# summary:" in out and "DIFFERENT" not in out
    assert time.monotonic() - started < 100
