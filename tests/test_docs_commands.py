"""The ``changebus`` command lines the documentation shows: real subcommands, no password.

Commands are taken from inline code (`` `changebus ...` ``) and from the lines of
``sh`` / ``console`` code blocks (a leading ``$ `` and an install path such as
``/opt/changebus/.venv/bin/`` are allowed). Each must name a subcommand the real
argument parser has (``changebus snapshot`` did not exist: review), and none may put a
password on its command line (``--dsn 'mysql://user:password@...'``: ``ps`` and the
shell's history show it; the docs point to ``$CHANGEBUS_SOURCE_DSN`` or a config file).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from changebus.schemas._cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md", ROOT / "deploy" / "README.md"]

_FENCE = re.compile(r"\s*```(\w*)")
_INLINE = re.compile(r"`((?:\S*/)?changebus [^`]*)`")
_COMMAND = re.compile(r"(?:\S*/)?changebus (.*)")
#: a URL's ``user:password@`` or a libpq ``password=``
_PASSWORD = re.compile(r"""://[^/\s:@'"]+:[^@\s'"]+@|\bpassword=""")


def _subcommands() -> set[str]:
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return set(action.choices)
    raise AssertionError("the changebus parser has no subcommands")


def _commands(text: str) -> Iterator[tuple[int, str]]:
    """``(line number, command)`` for each ``changebus`` command line of a Markdown text."""
    block: str | None = None
    for number, line in enumerate(text.splitlines(), 1):
        fence = _FENCE.match(line)
        if fence:
            block = fence.group(1) if block is None else None
            continue
        if block is None:
            for inline in _INLINE.finditer(line):
                yield number, inline.group(1)
        elif block in ("sh", "bash", "shell", "console"):
            stripped = line.strip().removeprefix("$ ")
            for part in re.split(r"&&|\|\||;", stripped):
                command = _COMMAND.match(part.strip())
                if command:
                    yield number, f"changebus {command.group(1)}"


COMMANDS = [
    (f"{path.relative_to(ROOT)}:{number}", command)
    for path in DOCS
    for number, command in _commands(path.read_text())
]


def test_commands_were_found() -> None:
    assert len(COMMANDS) > 50
    assert any(c.startswith("changebus check-source") for _, c in COMMANDS)


@pytest.mark.parametrize(("where", "command"), COMMANDS, ids=[w for w, _ in COMMANDS])
def test_a_documented_command_is_real_and_holds_no_password(where: str, command: str) -> None:
    words = command.split()
    if len(words) > 1 and not words[1].startswith("-"):
        # `changebus relay|bootstrap ...` names two
        for name in words[1].split("|"):
            assert name in _subcommands(), f"{where}: {command}: no subcommand {name!r}"
    assert not _PASSWORD.search(command), f"{where}: {command}: a password on the command line"
