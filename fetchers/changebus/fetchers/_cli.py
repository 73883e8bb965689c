"""The ``changebus check-source`` subcommand: a preflight of a Postgres or MariaDB/MySQL source.

Two ways to name the source:

* ``--dsn DSN`` (or ``$CHANGEBUS_SOURCE_DSN``, which keeps the password off
  the command line): a libpq DSN or ``postgresql://`` URL, or a
  ``mysql://user:password@host:port[/db,...]`` URL; ``--kind`` when the
  form does not tell; ``--slot``, ``--publication`` and ``--tables`` as the
  fetcher would be configured.
* ``--config relay.toml [--partition NAME]``: every ``postgres`` / ``mysql``
  partition of a relay config, checked with its own fetcher options (slot,
  publication, tables, databases...); ``$CHANGEBUS_SOURCE_DSN`` fills a
  partition's missing ``dsn`` (Postgres).

Prints the checklist (:func:`~._check.render_text`) or, with ``--json``,
one JSON object (a list of them with ``--config``; ``{"ok": false,
"exit_status": 2, "error": ...}`` when the check could not run). Exit status: 0 when
nothing blocks (warnings allowed), 1 when something does, 2 when the check
could not run (bad arguments, a source that cannot be reached). Nothing
printed holds a password (messages are scrubbed of the DSNs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from changebus.schemas import ChangebusError, ConfigError
from changebus.schemas.config import read_toml, scrub

from ._check import KINDS, CheckReport, check_source, render_text

__all__ = ["register"]

#: the environment variable a DSN may come from
DSN_ENV = "CHANGEBUS_SOURCE_DSN"


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``check-source`` subcommand."""
    p = sub.add_parser(
        "check-source",
        help="check that a Postgres or MariaDB/MySQL source is ready for changebus",
        description="Check that a Postgres or MariaDB/MySQL source is ready for changebus: "
        "a checklist with the exact fix for each problem. Exit status 0: ready (warnings "
        "allowed); 1: something blocks; 2: the check could not run.",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--dsn",
        help=f"libpq DSN / postgresql:// URL, or mysql://user:password@host:port[/db,...] "
        f"(default: ${DSN_ENV})",
    )
    p.add_argument("--kind", choices=KINDS, help="source kind (default: from the DSN's form)")
    p.add_argument("--slot", help="Postgres replication slot (default: the fetcher's, changebus)")
    p.add_argument("--publication", help="Postgres publication (default: changebus)")
    p.add_argument(
        "--tables",
        help="comma-separated schema.table (MySQL: database.table) names to check; "
        "default: what the publication covers, or every table",
    )
    where.add_argument(
        "--config", type=Path, help="relay TOML: check its postgres/mysql partitions"
    )
    p.add_argument("--partition", help="with --config: only this partition")
    p.add_argument("--json", action="store_true", help="print JSON instead of the checklist")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    dsn = args.dsn or os.environ.get(DSN_ENV, "")
    secrets = [dsn]
    try:
        if args.config is not None:
            jobs = _partitions(args.config, args.partition, os.environ.get(DSN_ENV, ""))
            secrets += [str(opts.get("dsn", "")) for _, _, opts in jobs]
            secrets += [str(opts.get("password", "")) for _, _, opts in jobs]
        elif dsn:
            jobs = [("", args.kind, {})]
        else:
            raise ConfigError(f"name the source: --dsn, ${DSN_ENV} or --config")
        tables = tuple(t.strip() for t in (args.tables or "").split(",") if t.strip())
        reports: list[tuple[str, CheckReport]] = []
        for name, kind, opts in jobs:
            report = asyncio.run(
                check_source(
                    "" if args.config is not None else dsn,
                    kind=kind,
                    options=opts,
                    slot=args.slot,
                    publication=args.publication,
                    tables=tables,
                )
            )
            reports.append((name, report))
    except ChangebusError as exc:
        message = scrub(exc.message, secrets)
        if args.json:
            print(json.dumps({"ok": False, "exit_status": 2, "error": message}))
        else:
            print(f"changebus check-source: {message}")
        return 2
    if args.json:
        body: Any = (
            [dict(r.to_json(), partition=n) for n, r in reports]
            if args.config
            else (reports[0][1].to_json())
        )
        print(scrub(json.dumps(body, indent=2), secrets))
    else:
        texts = [render_text(r, title=f"partition {n}" if n else "") for n, r in reports]
        print(scrub("\n\n".join(texts), secrets))
    return max(r.exit_status for _, r in reports)


def _partitions(
    path: Path, only: str | None, env_dsn: str
) -> list[tuple[str, str, dict[str, Any]]]:
    """``(partition, kind, fetcher options)`` of a relay config's checkable partitions."""
    tree = read_toml(path)
    jobs = []
    names = []
    for part in tree.get("partitions", ()):
        if not isinstance(part, Mapping):
            continue
        name = str(part.get("name", ""))
        names.append(name)
        fetcher = part.get("fetcher", {})
        kind = str(fetcher.get("kind", "")) if isinstance(fetcher, Mapping) else ""
        if kind not in KINDS or (only and name != only):
            continue
        options = dict(fetcher.get("options", {}))
        if kind == "postgres" and not options.get("dsn") and env_dsn:
            options["dsn"] = env_dsn
        jobs.append((name, kind, options))
    if only and only not in names:
        raise ConfigError(f"{path} has no partition {only!r} (it has {', '.join(names) or 'none'})")
    if not jobs:
        raise ConfigError(f"{path} has no postgres or mysql partition to check")
    return jobs
