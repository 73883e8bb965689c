"""Guards for the namespace-package layout and the console command."""

from __future__ import annotations

import argparse
import configparser
import importlib
import inspect
import pkgutil
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SLICES = ("schemas", "cluster", "fetchers", "relay", "bootstrap", "client")


@pytest.mark.parametrize("slice_name", SLICES)
def test_slice_is_a_namespace_portion(slice_name: str) -> None:
    root = ROOT / slice_name
    # the source root holds only the shared namespace folder
    entries = {p.name for p in root.iterdir() if not p.name.startswith((".", "__pycache__"))}
    assert entries == {"changebus"}, f"{root} must contain only changebus/, has {entries}"
    assert not (root / "changebus" / "__init__.py").exists(), "changebus/ must stay a namespace"
    assert (root / "changebus" / slice_name / "__init__.py").is_file()
    assert (root / "changebus" / slice_name / "py.typed").is_file()


def _all_modules() -> list[str]:
    names: list[str] = []
    for slice_name in SLICES:
        pkg_dir = ROOT / slice_name / "changebus" / slice_name
        names.append(f"changebus.{slice_name}")
        for info in pkgutil.walk_packages([str(pkg_dir)], prefix=f"changebus.{slice_name}."):
            if not info.name.endswith("__main__"):
                names.append(info.name)
    return names


@pytest.mark.parametrize("module", _all_modules())
def test_every_module_imports(module: str) -> None:
    mod = importlib.import_module(module)
    assert mod.__file__ is not None
    # imported from this checkout, not from some other installed copy
    assert Path(mod.__file__).resolve().is_relative_to(ROOT)


def test_public_names_exist_and_are_documented() -> None:
    for slice_name in SLICES:
        mod = importlib.import_module(f"changebus.{slice_name}")
        for name in getattr(mod, "__all__", []):
            obj = getattr(mod, name)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                assert obj.__doc__, f"changebus.{slice_name}.{name} has no docstring"


def _run_cli(*args: str) -> str:
    env_path = ":".join(str(ROOT / s) for s in SLICES)
    return subprocess.run(
        [sys.executable, "-m", "changebus.schemas", *args],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
        check=True,
        timeout=60,
    ).stdout


def test_cli_version_and_help() -> None:
    from changebus.schemas import __version__

    assert _run_cli("--version").strip() == f"changebus {__version__}"
    help_text = _run_cli("--help")
    assert "usage: changebus" in help_text
    assert "COMMAND" in help_text
    listed = re.findall(r"^    ([\w-]+)", help_text, flags=re.MULTILINE)
    assert sorted(listed) == sorted(COMMANDS)


#: every ``changebus`` subcommand, and the provider (changebus.commands entry) that adds it
COMMANDS = {
    "relay": "relay",
    "bootstrap": "bootstrap",
    "tail": "client",
    "replicate": "client",
    "demo": "client",
    "group": "client",
    "status": "client",
    "spark": "client",
    "cluster": "cluster",
    "token": "token",
    "check-source": "fetchers",
}


def _entry_points(group: str) -> dict[str, str]:
    with (ROOT / "pyproject.toml").open("rb") as fh:
        table: dict[str, str] = tomllib.load(fh)["project"]["entry-points"][group]
    return table


def test_every_declared_command_provider_registers_its_subcommands() -> None:
    from changebus.schemas._cli import GROUP, providers

    declared = _entry_points(GROUP)
    assert {p.name: p.target for p in providers()} == declared
    assert set(declared) == set(COMMANDS.values())
    for plugin in providers():
        parser = argparse.ArgumentParser()
        sub = parser.add_subparsers()
        plugin.load()(sub)
        added = set(sub.choices)
        assert added == {c for c, p in COMMANDS.items() if p == plugin.name}, plugin
        for command in added:  # each one runs something
            assert callable(sub.choices[command].get_default("func")), command


def test_importing_the_cli_imports_no_upper_slice() -> None:
    code = (
        "import sys, changebus.schemas._cli; "
        "print(sorted({m.split('.')[1] for m in sys.modules if m.startswith('changebus.')}))"
    )
    env_path = ":".join(str(ROOT / s) for s in SLICES)
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
        check=True,
        timeout=60,
    ).stdout
    assert out.strip() == "['schemas']"


def test_wheel_contains_only_the_namespace(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "build",
            "--wheel",
            "--no-isolation",
            "--outdir",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("changebus-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    # the one exception: PySpark discovers data sources only in top-level modules named
    # pyspark_*, so the Spark source's discovery shim (discovery/) sits outside the namespace
    outside = [
        n for n in names if not n.startswith(("changebus/", "changebus-", "pyspark_changebus/"))
    ]
    assert outside == []
    assert "pyspark_changebus/__init__.py" in names
    assert "changebus/__init__.py" not in names
    for slice_name in SLICES:
        assert f"changebus/{slice_name}/__init__.py" in names
        assert f"changebus/{slice_name}/py.typed" in names
    # an installed changebus declares the same plugins as this checkout's pyproject.toml
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    parser = configparser.ConfigParser(delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(zipfile.ZipFile(wheel).read(entry_points).decode())
    for group in ("changebus.fetchers", "changebus.commands"):
        assert dict(parser[group]) == _entry_points(group)


def test_version_matches_pyproject() -> None:
    from changebus.schemas import __version__

    with (ROOT / "pyproject.toml").open("rb") as fh:
        assert tomllib.load(fh)["project"]["version"] == __version__
