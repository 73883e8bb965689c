"""``changebus bootstrap snapshot URL --table T``: snapshot a table again, and follow it.

Sends ``POST /v1/snapshot`` (:mod:`._http_admin`) to the bootstrap server at
``URL`` -- the whole table, the rows ``--where`` selects, or ``--keys`` (a
JSON list, or ``@FILE`` holding one) -- then polls ``GET /v1/status`` every
``--interval`` seconds and shows a progress bar per table (tqdm, on stderr:
rows done of the table's estimated rows, the server's rows/s, chunks, and
the chunks a resumed snapshot did not read again) until the run ends.
Without a terminal on stderr it prints one progress line per interval
instead. ``--no-wait`` prints the server's answer and returns at once.

Exit status: 0 the snapshot is done; 1 it failed or was stopped (its error
is printed), or the server could not be asked (connection, authorization,
server errors); 2 a usage error (bad flags, or the server refused the
request as given: 400). Ctrl-C stops following (status 130); the snapshot
goes on in the server.

Authentication as the other client commands: ``--ca-file`` (and
``--cert-file``/``--key-file`` for mTLS) and ``--token-file``, or the token
in ``$CHANGEBUS_TOKEN``; the token is never taken from a flag and never
printed, and URLs are shown without their user info.

Blocking command-line code: it runs its own event loop (``asyncio.run``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import aiohttp
from tqdm import tqdm

from changebus.client import open_session, safe_url
from changebus.schemas import ChangebusError, ConfigError
from changebus.schemas.config import scrub_exception
from changebus.schemas.security import ClientAuth

from ._seedtypes import table_name_problem

__all__ = ["register_snapshot"]

#: the environment variable holding the bearer token (the client commands' too)
TOKEN_ENV = "CHANGEBUS_TOKEN"
#: how long the server may stay unreachable while a snapshot is followed (a restart)
_UNREACHABLE_S = 120.0
#: how long the partition may show no seed run while a snapshot is followed (a restart
#: that did not resume it: a finished job's, a key list's)
_IDLE_S = 30.0
_PROG = "changebus bootstrap snapshot"


class _Refused(Exception):
    """The server answered an error: ``status``, and its message (already safe to print)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def register_snapshot(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``snapshot`` to the ``changebus bootstrap`` sub-commands (module docstring)."""
    p = sub.add_parser(
        "snapshot",
        help="snapshot a table (or some of its rows) again, with a progress bar",
        description="Ask a running bootstrap server to snapshot one table again from the "
        "source, in chunks, while the system runs (POST /v1/snapshot; needs an admin token "
        "when the server has [security]), then show its progress until it ends. Exit status: "
        "0 done, 1 failed or stopped, 2 usage error.",
    )
    p.add_argument("url", metavar="URL", help="the bootstrap server's base URL")
    p.add_argument("--table", required=True, metavar="SCHEMA.TABLE", help="the table")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--where", metavar="SQL", help="only the rows this SQL condition selects")
    which.add_argument(
        "--keys",
        metavar="JSON|@FILE",
        help='only these keys: a JSON list ([[1, "a"], ...], or [1, 2, ...] for a one-column '
        "key), or @FILE holding one",
    )
    p.add_argument("--partition", help="the partition (needed when the server has several)")
    p.add_argument(
        "--no-wait", action="store_true", help="print the server's answer and return at once"
    )
    p.add_argument(
        "--interval", type=float, default=1.0, metavar="S", help="poll /v1/status every S seconds"
    )
    p.add_argument(
        "--timeout", type=float, default=30.0, metavar="S", help="each HTTP request's time limit"
    )
    tls = p.add_argument_group("TLS and authentication")
    tls.add_argument("--ca-file", type=Path, metavar="PEM", help="CA certificates for https://")
    tls.add_argument("--cert-file", type=Path, metavar="PEM", help="client certificate (mTLS)")
    tls.add_argument("--key-file", type=Path, metavar="PEM", help="the client certificate's key")
    tls.add_argument(
        "--token-file",
        type=Path,
        metavar="FILE",
        help=f"file holding the bearer token (or set ${TOKEN_ENV}; never on the command line)",
    )
    p.set_defaults(func=_main, daemon=False)  # a client command: a hangup ends it


def _main(args: argparse.Namespace) -> int:
    try:
        body = _body(args)
        auth = _auth(args)
        if not args.url.startswith(("http://", "https://")):
            raise ConfigError(f"{safe_url(args.url)!r} is not an http:// or https:// URL")
        if not (args.interval > 0 and args.timeout > 0):
            raise ConfigError("--interval and --timeout need a positive number of seconds")
    except ChangebusError as exc:
        print(f"{_PROG}: {exc.message}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_run(args, body, auth))
    except KeyboardInterrupt:
        print(f"\n{_PROG}: stopped following; the snapshot goes on in the server", file=sys.stderr)
        return 130


def _auth(args: argparse.Namespace) -> ClientAuth:
    token = "" if args.token_file is not None else os.environ.get(TOKEN_ENV, "").strip()
    return ClientAuth(
        ca_file=args.ca_file,
        cert_file=args.cert_file,
        key_file=args.key_file,
        token=token,
        token_file=args.token_file,
    )


def _body(args: argparse.Namespace) -> dict[str, Any]:
    """The ``POST /v1/snapshot`` body of the flags (ConfigError: a usage error)."""
    problem = table_name_problem(args.table)
    if problem is not None:
        raise ConfigError(f"--table: {problem}")
    body: dict[str, Any] = {"table": args.table}
    if args.partition:
        body["partition"] = args.partition
    if args.where is not None:
        if not args.where.strip():
            raise ConfigError("--where: give an SQL condition")
        body["where"] = args.where
    if args.keys is not None:
        text = args.keys
        if text.startswith("@"):
            try:
                text = Path(text[1:]).read_text()
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(f"--keys: cannot read {text[1:]!r}: {exc}") from None
        try:
            keys = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"--keys: not JSON ({exc})") from None
        if not isinstance(keys, list) or not keys:
            raise ConfigError("--keys: give a non-empty JSON list of keys")
        body["keys"] = keys
    return body


async def _run(args: argparse.Namespace, body: dict[str, Any], auth: ClientAuth) -> int:
    base = args.url.rstrip("/")
    where = safe_url(base)
    try:
        session = await open_session(auth, timeout=aiohttp.ClientTimeout(total=args.timeout))
    except ChangebusError as exc:
        print(f"{_PROG}: {exc.message}", file=sys.stderr)
        return 2
    async with session:
        try:
            answer = await _request(session, "POST", f"{base}/v1/snapshot", body)
        except _Refused as exc:
            print(f"{_PROG}: {where} refused: {exc.message}", file=sys.stderr)
            return 2 if exc.status == 400 else 1
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
            print(f"{_PROG}: cannot reach {where}: {_reason(exc)}", file=sys.stderr)
            return 1
        if args.no_wait:
            print(json.dumps(answer), flush=True)
            return 0
        return await _follow(session, base, str(answer["partition"]), args.interval)


async def _request(
    session: aiohttp.ClientSession, method: str, url: str, body: Any = None
) -> dict[str, Any]:
    async with session.request(method, url, json=body) as resp:
        raw = await resp.read()
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = None
        if resp.status >= 400 or not isinstance(doc, dict):
            message = doc.get("message") if isinstance(doc, dict) else None
            text = str(message) if message else f"HTTP {resp.status} {resp.reason or ''}".strip()
            raise _Refused(resp.status, text[:2000])
        return doc


def _reason(exc: BaseException) -> str:
    # (scrubbed: aiohttp's invalid-URL error quotes the URL, password and all: review)
    return scrub_exception(exc)


async def _follow(session: aiohttp.ClientSession, base: str, part: str, interval: float) -> int:
    """Poll ``/v1/status`` until the partition's seed run ends; show its progress."""
    where = safe_url(base)
    view = _Progress(sys.stderr)
    failing_since = idle_since = 0.0
    try:
        while True:
            await asyncio.sleep(interval)
            try:
                doc = await _request(session, "GET", f"{base}/v1/status")
            except (_Refused, aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
                # the server restarting (it resumes the snapshot by itself): keep asking a while
                if isinstance(exc, _Refused) and exc.status in (401, 403):
                    print(f"{_PROG}: {where} refused: {exc.message}", file=sys.stderr)
                    return 1
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since > _UNREACHABLE_S:
                    text = exc.message if isinstance(exc, _Refused) else _reason(exc)
                    print(
                        f"{_PROG}: {where} did not answer for {_UNREACHABLE_S:g}s: {text}",
                        file=sys.stderr,
                    )
                    return 1
                view.note(f"{where} does not answer ({_reason(exc)}); asking again")
                continue
            failing_since = 0.0
            seed = _seed_of(doc, part)
            if seed is None:
                print(f"{_PROG}: {where} shows no partition {part!r}", file=sys.stderr)
                return 1
            view.show(seed)
            state = seed.get("state")
            if state == "idle":
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since > _IDLE_S:
                    view.close()
                    print(
                        f"{_PROG}: {where} runs no snapshot of {part!r} any more (it "
                        "restarted without resuming this one?): run the snapshot again",
                        file=sys.stderr,
                    )
                    return 1
                continue
            idle_since = 0.0
            if state == "done":
                view.close()
                print(_summary(seed), flush=True)
                return 0
            if state in ("failed", "stopped"):
                view.close()
                print(
                    f"{_PROG}: the snapshot {state}: {seed.get('error') or '(no reason given)'}",
                    file=sys.stderr,
                )
                return 1
    finally:
        view.close()


def _seed_of(doc: dict[str, Any], part: str) -> dict[str, Any] | None:
    for p in doc.get("partitions") or ():
        if isinstance(p, dict) and p.get("partition") == part and isinstance(p.get("seed"), dict):
            seed: dict[str, Any] = p["seed"]
            return seed
    return None


def _summary(seed: dict[str, Any]) -> str:
    resumed = int(seed.get("chunks_resumed") or 0)
    return (
        f"snapshot done: {int(seed.get('rows') or 0):,} rows read in "
        f"{int(seed.get('chunks') or 0):,} chunks"
        + (f" ({resumed:,} chunks resumed, not read again)" if resumed else "")
        + f", {int(seed.get('tables_done') or 0)}/{int(seed.get('tables_total') or 0)} tables, "
        f"at SCN {seed.get('scn')}"
    )


class _Progress:
    """One tqdm bar per table on ``out`` (a terminal), or a line per poll (not a terminal)."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._tty = out.isatty()
        self._bar: Any = None
        self._table = ""
        self._started = time.monotonic()
        self._initial = 0

    def note(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=self._out)
        else:
            print(text, file=self._out, flush=True)

    def show(self, seed: dict[str, Any]) -> None:
        table = str(seed.get("table") or "")
        if not table:
            return  # starting, or between tables / at the end
        done = int(seed.get("table_rows") or 0)
        estimate = int(seed.get("table_estimate", -1))
        total = max(estimate, done) if estimate >= 0 else None
        postfix = {
            "rows/s": f"{float(seed.get('rows_per_s') or 0):,.0f}",
            "chunks": int(seed.get("chunks") or 0),
        }
        resumed = int(seed.get("chunks_resumed") or 0)
        if resumed:
            postfix["resumed"] = resumed
        if table != self._table:
            self.close()
            self._table, self._started, self._initial = table, time.monotonic(), done
            if self._tty:
                self._bar = tqdm(
                    desc=table,
                    total=total,
                    initial=done,
                    unit="rows",
                    unit_scale=True,
                    file=self._out,
                    dynamic_ncols=True,
                )
            elif resumed:
                print(f"{table}: resumed after chunk {resumed}", file=self._out, flush=True)
        if self._bar is not None:
            self._bar.total = total
            self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(done - self._bar.n)
            return
        line = tqdm.format_meter(
            done,
            total,
            time.monotonic() - self._started,
            prefix=table,
            unit="rows",
            unit_scale=True,
            postfix=", ".join(f"{k}={v}" for k, v in postfix.items()),
            initial=self._initial,
        )
        print(line, file=self._out, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
