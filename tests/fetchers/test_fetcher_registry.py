"""The fetcher registry: kinds declared as entry points, loaded when a config names them."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import textwrap
import tomllib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from changebus.fetchers import (
    Fetcher,
    ResumePoint,
    Window,
    create_fetcher,
    fetcher_kinds,
    register_fetcher,
)
from changebus.schemas import ConfigError, plugins as plugins_module
from changebus.schemas.plugins import declared_plugins, source_tree_pyproject

ROOT = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = ("schemas", "cluster", "fetchers", "relay", "bootstrap", "client", "discovery")
BUILTIN = {"synthetic", "postgres", "mysql", "relay"}
GROUP = "changebus.fetchers"


def _pyproject_entries(group: str) -> dict[str, str]:
    with (ROOT / "pyproject.toml").open("rb") as fh:
        table: dict[str, str] = tomllib.load(fh)["project"]["entry-points"][group]
    return table


@pytest.fixture(autouse=True)
def fresh_discovery() -> Iterator[None]:
    """Each test reads the entry points afresh (and leaves no patched table behind)."""
    declared_plugins.cache_clear()
    yield
    declared_plugins.cache_clear()


def _dist_info(site: Path, name: str, entry_points: dict[str, dict[str, str]]) -> None:
    """A real installed-distribution record (``*.dist-info``) under ``site``."""
    info = site / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    lines = []
    for group, entries in entry_points.items():
        lines.append(f"[{group}]")
        lines += [f"{k} = {v}" for k, v in entries.items()]
        lines.append("")
    (info / "entry_points.txt").write_text("\n".join(lines))


def test_builtin_kinds_are_declared_in_pyproject() -> None:
    entries = _pyproject_entries(GROUP)
    assert set(entries) == BUILTIN
    assert set(fetcher_kinds()) >= BUILTIN
    for kind in BUILTIN:
        (plugin,) = [p for p in declared_plugins(GROUP) if p.name == kind]
        assert plugin.target == entries[kind]
        assert callable(plugin.load()), kind


def test_a_checkout_reads_its_own_pyproject() -> None:
    assert source_tree_pyproject() == ROOT / "pyproject.toml"
    assert {p.origin for p in declared_plugins(GROUP) if p.name in BUILTIN} == {
        str(ROOT / "pyproject.toml")
    }


def test_without_distribution_metadata_the_checkout_still_has_its_kinds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Plain ``pytest`` from the repository root: no installed metadata at all."""
    monkeypatch.setattr(
        importlib.metadata, "entry_points", lambda **_: importlib.metadata.EntryPoints(())
    )
    assert set(fetcher_kinds()) >= BUILTIN
    fetcher = create_fetcher("synthetic", "syn", 1, {"max_windows": 1})
    assert isinstance(fetcher, Fetcher)
    assert fetcher.name == "syn"


def test_installed_metadata_and_third_party_kinds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An installed changebus (no checkout around it) and a plugin distribution beside it."""
    builtin = _pyproject_entries(GROUP)
    _dist_info(tmp_path, "changebus", {GROUP: builtin})
    _dist_info(
        tmp_path,
        "acme-fetchers",
        {
            GROUP: {
                # a new kind, and an attempt to replace a built-in one
                "acme": "changebus.fetchers._synthetic:fetcher_factory",
                "postgres": "acme_fetchers:replaced",
            }
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(plugins_module, "source_tree_pyproject", lambda: None)
    declared = {p.name: p for p in declared_plugins(GROUP)}
    assert set(declared) >= BUILTIN | {"acme"}
    assert declared["postgres"].target == builtin["postgres"]  # a plugin cannot replace it
    assert declared["postgres"].origin == "changebus"
    assert declared["acme"].origin == "acme-fetchers"
    # changebus's own entries first, then the plugins'
    names = [p.name for p in declared_plugins(GROUP)]
    assert names.index("acme") > max(names.index(k) for k in BUILTIN)
    fetcher = create_fetcher("acme", "third", 3, {"max_windows": 1})
    assert fetcher.name == "third"
    assert "acme" in fetcher_kinds()


def test_a_checkout_ignores_metadata_of_another_changebus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The declarations describe the code imported: an installed copy's table is not used."""
    _dist_info(tmp_path, "changebus", {GROUP: {"stale": "changebus.fetchers.gone:factory"}})
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "stale" not in fetcher_kinds()
    assert set(fetcher_kinds()) >= BUILTIN


def test_unknown_and_broken_kinds_are_config_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _dist_info(
        tmp_path,
        "broken-plugins",
        {
            GROUP: {
                "ghost": "changebus_no_such_plugin.fetcher:factory",
                "noattr": "changebus.fetchers._synthetic:no_such_factory",
                "notcallable": "changebus.fetchers._synthetic:__all__",
            }
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="unknown fetcher kind 'oracle'") as unknown:
        create_fetcher("oracle", "p", 1, {})
    assert not unknown.value.retriable
    for kind in BUILTIN:
        assert kind in unknown.value.message  # the installed kinds are named
    with pytest.raises(ConfigError, match="changebus_no_such_plugin") as ghost:
        create_fetcher("ghost", "p", 1, {})
    assert "fetcher kind 'ghost'" in ghost.value.message
    assert "broken-plugins" in ghost.value.message
    assert "installed kinds: " in ghost.value.message
    with pytest.raises(ConfigError, match=r"fetcher kind 'noattr'.*no_such_factory"):
        create_fetcher("noattr", "p", 1, {})
    with pytest.raises(ConfigError, match=r"fetcher kind 'notcallable'.*not a fetcher factory"):
        create_fetcher("notcallable", "p", 1, {})
    # options errors of a real kind stay the kind's own
    with pytest.raises(ConfigError, match="max_windows"):
        create_fetcher("synthetic", "p", 1, {"max_windows": "many"})


class _Null:
    """A do-nothing fetcher registered in process."""

    def __init__(self, name: str, partition_id: int, options: object) -> None:
        self.name = name

    async def start(self, resume: ResumePoint) -> int:
        return -1

    async def windows(self) -> AsyncIterator[Window]:
        return
        yield

    async def acknowledge(self, scn: int) -> None:
        return None

    async def close(self) -> None:
        return None

    def status(self) -> dict[str, object]:
        return {"kind": "null"}


def test_register_fetcher_adds_and_overrides_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    from changebus.fetchers import _base

    monkeypatch.setattr(_base, "_REGISTERED", dict(_base._REGISTERED))
    register_fetcher("registry-null", _Null)
    assert "registry-null" in fetcher_kinds()
    assert isinstance(create_fetcher("registry-null", "n", 1, {}), _Null)
    register_fetcher("synthetic", _Null)  # in-process registration wins over a declared kind
    assert isinstance(create_fetcher("synthetic", "n", 1, {}), _Null)


def _run(code: str) -> str:
    env_path = ":".join(str(ROOT / s) for s in SOURCE_ROOTS)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
        check=True,
        timeout=120,
    ).stdout


def test_kinds_load_lazily() -> None:
    """Listing kinds imports no fetcher; building one imports that kind's module only."""
    out = _run(
        """
        import sys
        from changebus.fetchers import create_fetcher, fetcher_kinds

        def loaded():
            return sorted(m for m in sys.modules if m.startswith("changebus.fetchers."))

        print(sorted(fetcher_kinds()))
        print(loaded())
        create_fetcher("synthetic", "syn", 1, {})
        print(loaded())
        """
    )
    kinds, before, after = out.splitlines()
    assert kinds == str(sorted(BUILTIN))
    assert before == str(["changebus.fetchers._base"])
    assert "changebus.fetchers._synthetic" in after
    assert "postgres" not in after and "mysql" not in after
