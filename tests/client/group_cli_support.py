"""What the ``changebus group`` / grouped ``tail`` CLI tests share.

``changebus ARGS`` run as a subprocess to its end (with extra environment
variables, or not), a fresh group name, the relay's head of partition ``syn``,
and ``changebus group status --json`` read as a dict. Used by
test_group_cli.py and test_group_cli_consumers.py.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import aiohttp
from test_client_cli import ENV

from changebus.client import PartitionStatus, RelayInfo
from changebus.relay import Relay

MakeRelay = Callable[..., AbstractAsyncContextManager[Relay]]


async def changebus(*args: str, wait_s: float = 60) -> tuple[int, str, str]:
    """Run ``changebus ARGS`` to the end: (exit status, stdout, stderr)."""
    return await changebus_env({}, *args, wait_s=wait_s)


async def changebus_env(
    env: dict[str, str], *args: str, wait_s: float = 60
) -> tuple[int, str, str]:
    """``changebus ARGS`` with ``env`` added to the environment."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "changebus.schemas",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**ENV, **env},
    )
    out, err = await asyncio.wait_for(proc.communicate(), wait_s)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def group_name() -> str:
    return f"g{uuid.uuid4().hex[:10]}"


async def relay_head(url: str) -> PartitionStatus:
    async with aiohttp.ClientSession() as http:
        return (await RelayInfo(http, url).status())["syn"]


async def status_json(*args: str) -> dict[str, Any]:
    code, out, err = await changebus("group", "status", *args, "--json")
    assert code == 0, err
    doc: dict[str, Any] = json.loads(out)
    return doc
