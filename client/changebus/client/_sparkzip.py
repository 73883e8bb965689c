"""``changebus spark precompile``: compiled bytecode in Spark's ``pyspark.zip``.

Spark puts ``$SPARK_HOME/python/lib/pyspark.zip`` (and py4j's zip) first on
the ``PYTHONPATH`` of every Python process it starts: the Python workers,
and for each streaming query with a Python source (changebus) a runner
process that lives as long as the query. The zip that pyspark's
distribution ships holds source files only, and ``zipimport`` cannot cache
what it compiles, so every such process compiles the pyspark modules it
imports again: about 1 CPU-s each on the project's machines (1.3-1.6 CPU-s
to import the streaming runner, 0.6-0.7 with the bytecode in the zip, 0.5
from site-packages).

:func:`precompile` adds an unchecked hash-based ``.pyc`` (PEP 552) next to
every ``.py`` member, stored uncompressed. ``zipimport`` takes a ``.pyc``
member without reading its source; one of another Python version (its
magic number differs) is ignored and the source compiled as before, so the
zip keeps working everywhere. The sources stay (tracebacks show their
lines).

How the zip is changed, and why it is safe while Spark runs: a Python
process remembers the table of contents of each zip it imported from and
reads members again by their offsets, through the path. So the new members
are appended to a copy of the zip (every old member keeps its bytes and its
offset; only the central directory at the end is written anew) and the copy
is renamed over the original: a running process still finds what it
remembers, and a process starting meanwhile sees one whole zip or the
other. Only a zip holding bytecode of another Python version is rewritten
whole (its stale members replaced), which processes already running from
it do not survive; the report says so. Run it again after pyspark is
upgraded (the upgrade brings a fresh zip); a zip already done is left alone.

Nothing here imports pyspark: the zips are found through the package's
location (``importlib.util.find_spec``) or ``SPARK_HOME``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import py_compile
import shutil
import sys
import tempfile
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path

from changebus.schemas import ConfigError
from changebus.schemas.cli import command_group

__all__ = ["ZipReport", "precompile", "register", "spark_zips"]


@dataclass(frozen=True, slots=True)
class ZipReport:
    """What :func:`precompile` did to one zip: members compiled, already done, refused."""

    path: Path
    compiled: int
    current: int
    failed: int
    size_before: int
    size_after: int
    #: the zip was rewritten whole (stale bytecode replaced): Spark processes that
    #: imported from it before must be restarted
    rewritten: bool = False


def spark_zips(spark_home: Path | None = None, *, package: bool = False) -> list[Path]:
    """The zips Spark puts on its Python processes' path: ``<SPARK_HOME>/python/lib/*.zip``.

    ``spark_home`` defaults to ``$SPARK_HOME``, else the installed pyspark
    package's directory (what pyspark's launcher uses); ``package``: the
    installed package's, whatever ``$SPARK_HOME`` says.
    """
    if spark_home is None:
        env = None if package else os.environ.get("SPARK_HOME")
        if env:
            spark_home = Path(env)
        else:
            spec = importlib.util.find_spec("pyspark")
            if spec is None or spec.origin is None:
                raise ConfigError("pyspark is not installed here; give --spark-home")
            spark_home = Path(spec.origin).parent
    lib = spark_home / "python" / "lib"
    zips = sorted(lib.glob("*.zip"))
    if not zips:
        raise ConfigError(f"no zip in {lib}: is {spark_home} a Spark home?")
    return zips


def _pyc_current(data: bytes) -> bool:
    return data[:4] == importlib.util.MAGIC_NUMBER


def precompile(path: Path) -> ZipReport:
    """Add this Python's bytecode for every source member of the zip at ``path`` (module docstring).

    Only sources without a ``.pyc`` of this Python are compiled; when none
    of them compiles (a zip done before, whose remaining sources are not
    valid for this Python) the zip is not changed. A symbolic link is
    followed (its target is changed).
    """
    path = path.resolve()
    size_before = path.stat().st_size
    with zipfile.ZipFile(path) as zin:
        infos = zin.infolist()
        names = {i.filename for i in infos}
        have = {
            i.filename
            for i in infos
            if i.filename.endswith(".pyc") and _pyc_current(zin.read(i)[:4])
        }
        todo = [i for i in infos if i.filename.endswith(".py") and i.filename + "c" not in have]
        with tempfile.TemporaryDirectory() as work:
            fresh = {
                i.filename + "c": _compile(zin.read(i), f"{path}/{i.filename}", Path(work))
                for i in todo
            }
    made = {name: pyc for name, pyc in fresh.items() if pyc is not None}
    failed = len(fresh) - len(made)
    if not made:
        return ZipReport(path, 0, len(have), failed, size_before, size_before)
    stale = names & made.keys()  # another Python's bytecode, to be replaced
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            if not stale:
                with path.open("rb") as original:
                    shutil.copyfileobj(original, out)
        if stale:
            _rewrite(path, tmp, infos, made)
        else:
            with zipfile.ZipFile(tmp, "a") as zout:  # old members keep their offsets
                for info in infos:
                    pyc = made.get(info.filename + "c")
                    if pyc is not None:
                        zout.writestr(_pyc_member(info), pyc)
        st = path.stat()
        os.chmod(tmp, st.st_mode & 0o7777)
        with contextlib.suppress(PermissionError):  # only root may give a file away
            os.chown(tmp, st.st_uid, st.st_gid)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return ZipReport(
        path, len(made), len(have), failed, size_before, path.stat().st_size, bool(stale)
    )


def _pyc_member(source: zipfile.ZipInfo) -> zipfile.ZipInfo:
    member = zipfile.ZipInfo(source.filename + "c", source.date_time)
    member.compress_type = zipfile.ZIP_STORED  # read at every import: no inflating
    member.external_attr = source.external_attr
    return member


def _rewrite(path: Path, tmp: Path, infos: list[zipfile.ZipInfo], made: dict[str, bytes]) -> None:
    """Write the zip anew into ``tmp``: its members, stale bytecode replaced by ``made``."""
    with zipfile.ZipFile(path) as zin, zipfile.ZipFile(tmp, "w") as zout:
        for info in infos:
            if info.filename in made:
                continue  # another Python's bytecode: this one's follows its source
            zout.writestr(info, zin.read(info))
            pyc = made.get(info.filename + "c")
            if pyc is not None:
                zout.writestr(_pyc_member(info), pyc)


def _compile(source: bytes, filename: str, work: Path) -> bytes | None:
    """Unchecked hash-based bytecode of ``source``; None when this Python cannot compile it."""
    src, pyc = work / "m.py", work / "m.pyc"
    src.write_bytes(source)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. SyntaxWarnings in pyspark's own tests
        try:
            py_compile.compile(
                str(src),
                cfile=str(pyc),
                dfile=filename,  # what tracebacks name: the member inside the zip
                doraise=True,
                invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
            )
        except py_compile.PyCompileError:
            return None
    return pyc.read_bytes()


def _run(args: argparse.Namespace) -> int:
    try:
        zips = [Path(p) for p in args.zip] or spark_zips(
            args.spark_home, package=args.pyspark_package
        )
        for path in zips:
            r = precompile(path)
            left = f", {r.failed} left as source (not valid for this Python)" if r.failed else ""
            if r.compiled:
                print(
                    f"{r.path}: {r.compiled} modules compiled for Python"
                    f" {sys.version_info.major}.{sys.version_info.minor}{left};"
                    f" {r.size_before / 1e6:.1f} -> {r.size_after / 1e6:.1f} MB"
                )
            else:
                print(f"{r.path}: already compiled ({r.current} modules{left})")
            if r.rewritten:
                print(
                    f"{r.path}: rewritten whole to replace another Python's bytecode:"
                    " restart the Spark processes that were running from it",
                    file=sys.stderr,
                )
    except (ConfigError, OSError, zipfile.BadZipFile) as exc:
        print(f"changebus spark precompile: {exc}", file=sys.stderr)
        return 2
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``spark precompile``."""
    spark_sub = command_group(
        sub,
        "spark",
        help="helpers for running the Spark source",
        description="Helpers for the machines that run the Spark source (docs/spark.md).",
    )
    p = spark_sub.add_parser(
        "precompile",
        help="add compiled bytecode to Spark's pyspark.zip (faster Python worker starts)",
        description="Spark starts its Python processes (workers, and a runner per streaming "
        "query) with pyspark imported from $SPARK_HOME/python/lib/pyspark.zip, which holds "
        "sources only, so each process compiles pyspark again (~1 CPU-s). This adds this "
        "Python's bytecode to the zips: appended to a copy renamed over the original, so "
        "Spark processes already running keep working. Run it on every machine that runs "
        "Spark (driver and workers), as the user that owns the installation, again after "
        "an upgrade of pyspark.",
    )
    p.add_argument(
        "--spark-home",
        type=Path,
        help="the Spark home (default: $SPARK_HOME, else the installed pyspark package)",
    )
    p.add_argument(
        "--pyspark-package",
        action="store_true",
        help="the installed pyspark package's zips, whatever $SPARK_HOME says",
    )
    p.add_argument(
        "--zip",
        action="append",
        default=[],
        metavar="PATH",
        help="a zip to compile instead of the Spark home's (repeatable)",
    )
    p.set_defaults(func=_run)
