"""``changebus cluster status``: print a cluster's routing table."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from changebus.schemas import ChangebusError
from changebus.schemas.cli import command_group

from ._config import ClusterConfig
from ._errors import CoordinationError
from ._routing import RoutingSnapshot, RoutingTable
from ._session import ZkSession

__all__ = ["register", "render_table"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cmds = command_group(
        sub,
        "cluster",
        help="inspect a relay cluster in ZooKeeper",
        description="Inspect a changebus cluster coordinated through ZooKeeper.",
    )
    status = cmds.add_parser(
        "status",
        help="print the routing table: members, roles, epochs, SCN ranges, lag",
        description="Print the cluster's routing table (members, kinds, URLs, roles, "
        "epochs, SCN ranges, lag = leader max_scn - member max_scn).",
    )
    status.add_argument("--zookeeper", required=True, help="connect string host:port[,...]")
    status.add_argument("--cluster", required=True, help="the cluster name")
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.add_argument(
        "--timeout", type=float, default=10.0, help="seconds to wait for ZooKeeper (10)"
    )
    status.set_defaults(func=_status)


async def _read(args: argparse.Namespace) -> RoutingSnapshot:
    config = ClusterConfig(
        zookeeper=args.zookeeper, name=args.cluster, connect_timeout_s=args.timeout
    )
    session = ZkSession(config)
    await session.start()
    try:
        table = RoutingTable(session, create_paths=False)  # a status read writes nothing
        await table.start()
        await table.stop()
        return table.snapshot()
    finally:
        await session.stop()


def _status(args: argparse.Namespace) -> int:
    try:
        snapshot = asyncio.run(_read(args))
    except CoordinationError as exc:
        print(f"changebus cluster status: {exc}", file=sys.stderr)
        return 1
    except ChangebusError as exc:  # (a bad --cluster or --timeout: a traceback; review)
        print(f"changebus cluster status: {exc.message}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"cluster": args.cluster, **snapshot.to_json()}, indent=2))
    else:
        print(render_table(args.cluster, snapshot))
    return 0


def _cell(value: Any) -> str:
    return "-" if value is None or value == "" else str(value)


def render_table(cluster: str, snapshot: RoutingSnapshot) -> str:
    """The routing table as aligned text: one line per member and partition."""
    head = ("MEMBER", "KIND", "URL", "PARTITION", "ROLE", "EPOCH", "MIN_SCN", "MAX_SCN", "LAG")
    rows: list[tuple[str, ...]] = []
    for member_id, m in sorted(snapshot.members.items()):
        if not m.partitions:
            rows.append((member_id, m.kind, _cell(m.url), "-", "-", "-", "-", "-", "-"))
        for p, s in sorted(m.partitions.items()):
            leader = snapshot.leaders.get(p)
            role: str = s.role
            if role == "leader" and (leader is None or leader.member_id != member_id):
                role = "leader?"  # claims a leadership ZooKeeper no longer shows
            rows.append(
                (
                    member_id,
                    m.kind,
                    _cell(m.url),
                    p,
                    role,
                    str(s.epoch),
                    str(s.min_scn),
                    str(s.max_scn),
                    _cell(snapshot.lag(member_id, p)),
                )
            )
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = [f"cluster {cluster}: {len(snapshot.members)} member(s)"]
    lines += [
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in [head, *rows]
    ]
    lines.append("")
    lines.append("PARTITION  LEADER  EPOCH  URL")
    for p in snapshot.partitions:
        leader = snapshot.leaders.get(p)
        if leader is None:
            lines.append(f"{p}  -  -  - (no leader)")
        else:
            lines.append(f"{p}  {leader.member_id}  {leader.epoch}  {_cell(leader.url)}")
    return "\n".join(lines)
