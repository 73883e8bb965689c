"""The command-line frame shared by the daemons (``changebus relay``, ``changebus bootstrap``).

:func:`add_daemon_parser` adds a subcommand with the options every daemon
has (``--config FILE``, ``--set KEY=VALUE``, ``--log-format``,
``--log-level``); :func:`run_daemon` builds the daemon's frozen config from
defaults, the TOML file, ``CHANGEBUS_<NAME>_...`` environment variables and
the overrides, configures logging (this is a program, not library code) and
runs the daemon's coroutine (which serves through
:func:`changebus.schemas.server.serve`).

``--check`` loads and validates the config the same way, runs the offline
checks of a start (:mod:`._daemon_check`: listen address vs security, TLS
files, upstream token and certificates, the daemon's own ``check``, e.g.
the relay's fetcher options), prints ``config OK`` and the effective config
with its secrets masked on stdout, and exits 0; a problem exits 2 with one
error line naming it, logged on stderr (an unknown key names the nearest
valid one). Nothing is opened, bound or connected.

Exit statuses, the same for every daemon: 0 after SIGTERM or SIGINT
(whether the daemon was serving or still starting); 2 for a bad config or
a fatal start-up error (a :class:`ChangebusError`, one error line); anything
else is a bug and ends with its traceback (1). Those errors are log lines of
the daemon's logger on stderr, in the configured ``log_format``
(:mod:`._daemon_log`; before a config has loaded, the format it asked for
as far as it can be read); stdout never holds them. What is printed or
logged is scrubbed of the config's secrets (:func:`~.config.scrub`).

SIGHUP (reload) is ignored from the start of :func:`run_daemon` until
:func:`~._server.serve` installs its handler, and again after it: a reload
sent while the daemon loads its config or starts must not end it (the
default action of SIGHUP). The command's imports before that take about two
seconds; under systemd (``Type=notify``, deploy/systemd) a ``systemctl
reload`` waits for the daemon's ``READY=1`` (:mod:`._sdnotify`) instead.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from ._daemon_check import check_daemon_config, config_summary
from ._daemon_log import early_log_format, log_fatal
from ._logsetup import setup_logging
from .config import load_config, scrub, secret_values
from .errors import ChangebusError

__all__ = ["add_daemon_parser", "run_daemon"]

C = TypeVar("C")


def add_daemon_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    *,
    help: str,
    description: str,
) -> argparse.ArgumentParser:
    """Add subcommand ``name`` with the common daemon options; returns its parser."""
    p = sub.add_parser(name, help=help, description=description)
    p.set_defaults(daemon=True)  # SIGHUP is a reload request, from the start (_cli.main)
    p.add_argument("--config", type=Path, help=f"{name} TOML file (see docs/operations.md)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set http.port=9000 (repeatable)",
    )
    p.add_argument("--log-format", choices=("text", "json"), help="log line format")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    p.add_argument(
        "--check",
        action="store_true",
        help="validate the config (keys, values, TLS and token files, fetcher options) without"
        " starting: print 'config OK' and the effective config (secrets masked), exit 0; a"
        " problem exits 2",
    )
    return p


def run_daemon(
    args: argparse.Namespace,
    name: str,
    config_cls: type[C],
    run: Callable[[C], Coroutine[Any, Any, None]],
    *,
    prepare: Callable[[C], None] | None = None,
    check: Callable[[C], None] | None = None,
) -> int:
    """Load ``config_cls`` (module docstring) and run ``run(config)`` to its end.

    ``check``: the daemon's own offline checks for ``--check`` (raise
    :class:`ConfigError`), after the common ones.
    """
    log = logging.getLogger(f"changebus.{name}")
    if not getattr(args, "check", False):
        # SIGHUP asks a daemon to reload (serve() handles it); until the handler is
        # installed, a reload sent to a daemon that is still starting must not kill it
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    env_prefix = f"CHANGEBUS_{name.upper()}_"
    overrides = list(args.overrides)
    if args.log_format:
        overrides.append(f"log_format={args.log_format}")
    if args.log_level:
        overrides.append(f"log_level={args.log_level}")
    try:
        config = load_config(
            config_cls,
            args.config,
            env_prefix=env_prefix,
            overrides=overrides,
        )
    except ChangebusError as exc:
        fmt = early_log_format(args, env_prefix)
        log_fatal(log, f"changebus {name}: {scrub(exc.message)}", configure=("info", fmt))
        return 2
    secrets = secret_values(config)
    if getattr(args, "check", False):
        return _check(name, args.config, config, check, secrets)
    setup_logging(
        getattr(config, "log_level", "info"), getattr(config, "log_format", "text"), secrets
    )
    if prepare is not None:
        prepare(config)
    try:
        asyncio.run(run(config))
    except ChangebusError as exc:
        log_fatal(log, f"changebus {name}: {scrub(exc.message, secrets)}")
        return 2
    except OSError as exc:
        if exc.errno is None:  # (a TimeoutError that escaped, say: a bug, with its traceback)
            log_fatal(log, f"changebus {name}: unexpected error", exc=exc)
            return 1
        # a port in use, a data_dir the user may not create, a full disk: one line that
        # says what and where, as for a bad config (a traceback and exit 1 before:
        # review); the traceback at debug level
        log.debug("changebus %s", name, exc_info=exc)
        what = exc.strerror or str(exc)
        where = f" ({exc.filename})" if exc.filename else ""
        log_fatal(log, f"changebus {name}: {scrub(what + where, secrets)}")
        return 2
    except Exception as exc:  # noqa: BLE001 - a bug: its traceback (the log scrubs secrets)
        log_fatal(log, f"changebus {name}: unexpected error", exc=exc)
        return 1
    return 0


def _check(
    name: str,
    path: Path | None,
    config: C,
    check: Callable[[C], None] | None,
    secrets: tuple[str, ...],
) -> int:
    """``--check``: the offline checks; ``config OK`` and the summary (0) or the problem (2)."""
    try:
        check_daemon_config(config, check)
    except ChangebusError as exc:
        log_fatal(
            logging.getLogger(f"changebus.{name}"),
            f"changebus {name}: {scrub(exc.message, secrets)}",
            configure=(getattr(config, "log_level", "info"), getattr(config, "log_format", "text")),
            secrets=secrets,
        )
        return 2
    print(f"changebus {name}: config OK ({path if path is not None else 'no file: defaults'})")
    for line in config_summary(config):
        print(f"  {scrub(line, secrets)}")
    return 0
