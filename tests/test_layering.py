"""The slices depend on each other in one direction only, through public names.

Static checks over every source module (module-level imports and imports
inside functions alike, read from the syntax tree), plus a subprocess check
that the fetcher registry imports none of its plugins. Each failure lists
every violation with its file and line.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: the source roots and the changebus slice each one holds (discovery/ holds the
#: top-level ``pyspark_changebus`` shim that Spark finds data sources by)
SLICES = ("schemas", "cluster", "fetchers", "relay", "bootstrap", "client", "discovery")

#: which slices each slice may import (besides itself). schemas < cluster (ZooKeeper
#: coordination); schemas < fetchers < relay; schemas < client < bootstrap; the relay
#: follows other relays through the client's stream reader; bootstrap also uses the
#: fetchers' public seeding helpers (snapshots, Postgres building blocks); relay, client
#: and bootstrap use the cluster's elections, registry and routing table; discovery only
#: re-exports the client.
ALLOWED: dict[str, frozenset[str]] = {
    "schemas": frozenset(),
    "cluster": frozenset({"schemas"}),
    "fetchers": frozenset({"schemas"}),
    "relay": frozenset({"schemas", "fetchers", "client", "cluster"}),
    "client": frozenset({"schemas", "cluster"}),
    "bootstrap": frozenset({"schemas", "client", "fetchers", "cluster"}),
    "discovery": frozenset({"client"}),
}

#: modules that compose the whole system and so may import any slice's public names:
#: ``changebus demo`` runs a private Postgres, a relay and a bootstrap server in one process
COMPOSERS: dict[str, frozenset[str]] = {
    "changebus.client._demo": frozenset(SLICES),
}


@dataclass(frozen=True)
class Import:
    """One imported name: ``target`` is the full dotted path (module or module.name)."""

    module: str  # the importing module
    slice: str  # the importing module's slice
    path: Path
    line: int
    target: str

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _module_name(slice_root: Path, path: Path) -> str:
    parts = list(path.relative_to(slice_root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _from_source(node: ast.ImportFrom, package: str) -> str:
    """The absolute module of ``from <source> import ...`` inside ``package``."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    base = parts[: len(parts) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def _imports() -> list[Import]:
    found: list[Import] = []
    for slice_name in SLICES:
        slice_root = ROOT / slice_name
        for path in sorted(slice_root.rglob("*.py")):
            module = _module_name(slice_root, path)
            package = module if path.name == "__init__.py" else module.rpartition(".")[0]
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    targets = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom):
                    source = _from_source(node, package)
                    targets = [f"{source}.{alias.name}" for alias in node.names]
                else:
                    continue
                found += [Import(module, slice_name, path, node.lineno, t) for t in targets]
    return found


IMPORTS = _imports()


def _slice_of(target: str) -> str | None:
    """The slice a dotted import path belongs to, None outside changebus."""
    parts = target.split(".")
    if parts[0] == "pyspark_changebus":
        return "discovery"
    if parts[0] == "changebus" and len(parts) > 1 and parts[1] in SLICES:
        return parts[1]
    return None


def _report(violations: list[str]) -> str:
    return f"{len(violations)} violation(s):\n" + "\n".join(violations)


def test_the_import_scan_sees_every_kind_of_import() -> None:
    """The scan reads function-level and relative imports (guards the checks below)."""
    seen = {(i.module, i.target) for i in IMPORTS}
    # a relative import at module level
    assert ("changebus.fetchers", "changebus.fetchers._base.Fetcher") in seen
    # imports inside functions
    assert ("changebus.client._demo", "changebus.relay.Relay") in seen
    assert (
        "changebus.bootstrap._seed_mysql_conn",
        "changebus.fetchers.mysql.MySQLConfig",
    ) in seen


def test_schemas_imports_no_other_slice() -> None:
    """The base slice names no module above it, not even as a string to import later."""
    violations = [
        f"{i.where()}: {i.module} imports {i.target}"
        for i in IMPORTS
        if i.slice == "schemas" and _slice_of(i.target) not in (None, "schemas")
    ]
    upper = "|".join(s for s in SLICES if s != "schemas")
    named = re.compile(rf"^changebus\.({upper})(\.\w+)*(:\w+)?$")
    for path in sorted((ROOT / "schemas").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and named.match(node.value)
            ):
                violations.append(
                    f"{path.relative_to(ROOT)}:{node.lineno}: names module {node.value!r}"
                )
    assert not violations, _report(violations)


def test_slices_import_only_the_slices_below_them() -> None:
    violations = []
    for i in IMPORTS:
        target = _slice_of(i.target)
        if target is None or target == i.slice:
            continue
        allowed = ALLOWED[i.slice] | COMPOSERS.get(i.module, frozenset())
        if target not in allowed:
            violations.append(f"{i.where()}: {i.slice} slice imports {i.target}")
    assert not violations, _report(violations)


def test_no_module_imports_another_slices_private_names() -> None:
    """Across slices only public modules and names: ``changebus.x._y`` stays inside ``x``."""
    violations = []
    for i in IMPORTS:
        target = _slice_of(i.target)
        if target is None or target == i.slice:
            continue
        private = [p for p in i.target.split(".") if p.startswith("_") and not p.startswith("__")]
        if private:
            violations.append(f"{i.where()}: {i.module} imports private {i.target}")
    assert not violations, _report(violations)


def test_the_fetcher_registry_imports_none_of_its_plugins() -> None:
    base = [i for i in IMPORTS if i.module == "changebus.fetchers._base"]
    assert base, "changebus.fetchers._base not found"
    inside = [
        f"{i.where()}: imports {i.target}"
        for i in base
        if i.target.startswith("changebus.fetchers.")
        and not i.target.startswith("changebus.fetchers._base.")
    ]
    assert not inside, _report(inside)


@pytest.mark.parametrize("module", ["changebus.fetchers._base", "changebus.fetchers"])
def test_importing_the_registry_loads_no_fetcher(module: str) -> None:
    code = textwrap.dedent(
        f"""
        import sys
        import {module}
        print(sorted(m for m in sys.modules if m.startswith("changebus.fetchers.")))
        """
    )
    out = _python(code)
    assert out.strip() == str(["changebus.fetchers._base"])


def test_importing_the_spark_source_does_not_import_pandas() -> None:
    """Spark's planning process imports the source: pandas (half a second) must not come along.

    pyarrow imports pandas on the first ``pa.array`` call, so nothing in the
    source may build an array when it is imported.
    """
    code = "import sys, changebus.client.spark; print('pandas' in sys.modules)"
    out = _python(code)
    assert out.strip() == "False"


def _python(code: str) -> str:
    """The stdout of ``code`` run by a fresh interpreter with only the slices on its path."""
    env_path = ":".join(str(ROOT / s) for s in SLICES)
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
        check=True,
        timeout=60,
    ).stdout
