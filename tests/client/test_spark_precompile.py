"""``changebus spark precompile``: bytecode in Spark's zips, imports that use it, nothing lost."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from changebus.client._sparkzip import precompile, spark_zips
from changebus.schemas import ConfigError

MODULES = {
    "pkg/__init__.py": b"VALUE = 41\n",
    "pkg/mod.py": b"def answer():\n    return 42\n",
    "pkg/broken.py": b"def (:\n",  # not Python at all: stays a source member
    "pkg/data.txt": b"not code",
}


def make_zip(path: Path, members: dict[str, bytes]) -> None:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)


def run_from(zip_path: Path, code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": str(zip_path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return out.stdout.strip()


def test_precompile_adds_bytecode_that_imports_use_and_keeps_every_member(tmp_path: Path) -> None:
    z = tmp_path / "pyspark.zip"
    make_zip(z, {**MODULES, "pkg/stale.py": b"X = 1\n", "pkg/stale.pyc": b"\0\0\0\0junk"})
    report = precompile(z)
    assert (report.compiled, report.failed, report.current) == (3, 1, 0)
    assert report.rewritten  # the stale bytecode is replaced: the zip is written whole
    with zipfile.ZipFile(z) as zf:
        names = set(zf.namelist())
        for name, data in MODULES.items():
            assert zf.read(name) == data  # the sources and other files are all still there
        assert {"pkg/__init__.pyc", "pkg/mod.pyc", "pkg/stale.pyc"} <= names
        assert "pkg/broken.pyc" not in names
        assert zf.getinfo("pkg/mod.pyc").compress_type == zipfile.ZIP_STORED
        assert zf.read("pkg/stale.pyc")[:4] != b"\0\0\0\0"  # replaced, for this Python
    # a fresh interpreter imports the bytecode, and it runs
    got = run_from(
        z, "import pkg.mod, pkg.stale as s; print(pkg.mod.__file__, pkg.mod.answer(), s.X)"
    )
    assert got == f"{z}/pkg/mod.pyc 42 1"
    # a second run changes nothing
    mtime = z.stat().st_mtime_ns
    again = precompile(z)
    assert (again.compiled, again.current) == (0, 3)
    assert z.stat().st_mtime_ns == mtime


def test_a_process_that_imported_from_the_zip_keeps_importing_after_it_changes(
    tmp_path: Path,
) -> None:
    """Python remembers a zip's table of contents: the old members must keep their offsets."""
    target = tmp_path / "real.zip"
    make_zip(target, {**MODULES, "pkg/other.py": b"Y = 7\n"})
    link = tmp_path / "pyspark.zip"
    link.symlink_to(target)
    code = (
        "import sys; from pathlib import Path\n"
        "from changebus.client._sparkzip import precompile\n"
        "import pkg.mod\n"  # the table of contents is read now
        f"r = precompile(Path({str(link)!r}))\n"
        "import pkg.other\n"  # read through the remembered offsets, from the new file
        "print(r.compiled, r.rewritten, pkg.mod.answer(), pkg.other.Y)\n"
    )
    paths = [str(link), *sys.path]
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": ":".join(paths), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["3", "False", "42", "7"]
    assert link.is_symlink() and zipfile.is_zipfile(target)  # the link's target was changed
    with zipfile.ZipFile(target) as zf:
        assert "pkg/other.pyc" in zf.namelist()


def test_cli_reports_and_refuses_what_is_not_a_zip(tmp_path: Path) -> None:
    z = tmp_path / "a.zip"
    make_zip(z, MODULES)
    cmd = [sys.executable, "-m", "changebus.schemas", "spark", "precompile", "--zip", str(z)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "2 modules compiled" in out.stdout and "1 left as source" in out.stdout
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "already compiled (2 modules, 1 left as source" in out.stdout
    bad = tmp_path / "b.zip"
    bad.write_bytes(b"not a zip")
    cmd[-1] = str(bad)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "precompile" in out.stderr and "Traceback" not in out.stderr
    assert bad.read_bytes() == b"not a zip"


def test_spark_zips_are_found_in_the_spark_home(tmp_path: Path) -> None:
    found = spark_zips()  # the installed pyspark's (read only here)
    assert any(p.name == "pyspark.zip" for p in found)
    assert all(p.parent.name == "lib" for p in found)
    with pytest.raises(ConfigError, match="Spark home"):
        spark_zips(tmp_path)
