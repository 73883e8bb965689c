"""``private_dir`` on a directory the daemon's user does not own.

A Kubernetes volume's root stays root's (``fsGroup`` changes its group
only), and the relay and bootstrap daemons narrowed their ``data_dir`` to
mode 0700 with a chmod that raised PermissionError there: the pod
crash-looped on a fresh volume (review). The directory is used as it is,
with a warning.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOBODY = 65534


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_a_data_dir_owned_by_root_and_shared_by_group_is_used_as_it_is() -> None:
    # (pytest's tmp_path is under a directory only root may enter)
    base = Path(tempfile.mkdtemp(prefix="changebus-private-"))
    try:
        os.chmod(base, 0o755)
        volume = base / "volume"
        volume.mkdir()
        os.chown(volume, 0, NOBODY)
        os.chmod(volume, 0o2775)  # (what fsGroup makes of a volume's root)
        # the module and the one module of the package it imports (._libc), as a package
        # of their own, run by a Python any user may start (the virtualenv's links into
        # root's home)
        package = base / "alone"
        package.mkdir()
        os.chmod(package, 0o755)
        (package / "__init__.py").write_bytes(b"")
        for name in ("files.py", "_libc.py"):
            (package / name).write_bytes((ROOT / "schemas/changebus/schemas" / name).read_bytes())
        for module in package.iterdir():
            os.chmod(module, 0o644)
        code = (
            "import logging, sys; logging.basicConfig(level=logging.WARNING)\n"
            "from pathlib import Path\n"
            "sys.path.insert(0, sys.argv[2])\n"
            "from alone.files import private_dir\n"
            "private_dir(Path(sys.argv[1]))\n"
            "private_dir(Path(sys.argv[1]) / 'buffers')\n"
            "print('ok')\n"
        )
        python = shutil.which("python3", path="/usr/local/bin:/usr/bin") or sys.executable
        done = subprocess.run(
            [python, "-I", "-c", code, str(volume), str(base)],
            env={"PATH": "/usr/bin:/bin"},
            cwd=base,
            user=NOBODY,
            group=NOBODY,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
        assert "not narrowed to mode 0700" in done.stderr
        assert (volume / "buffers").stat().st_mode & 0o777 == 0o700
    finally:
        shutil.rmtree(base, ignore_errors=True)
