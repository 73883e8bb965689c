"""``changebus demo`` (interim synthetic pipeline) prints live changes and a summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_demo_prints_changes_and_summary() -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            str(ROOT / s) for s in ("schemas", "fetchers", "relay", "bootstrap", "client")
        ),
    }
    out = subprocess.run(
        [sys.executable, "-m", "changebus.schemas", "demo", "--seconds", "1.5", "--rate", "20"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.splitlines()
    changes = [json.loads(line) for line in out if line.startswith("{")]
    assert len(changes) >= 10
    assert {c["op"] for c in changes} <= {"insert", "update", "delete"}
    assert all(c["source"].startswith("synthetic.t") for c in changes)
    scns = [c["scn"] for c in changes]
    assert scns == sorted(scns)
    assert out[-1].startswith("# ") and "changes in" in out[-1]
