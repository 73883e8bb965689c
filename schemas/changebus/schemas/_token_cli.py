"""``changebus token new|hash``: bearer tokens for the ``[[security.principals]]`` of a server.

``changebus token new [--name N]`` prints a fresh random token (256 bits) on
its first line -- give it to the client (a token file, ``CHANGEBUS_TOKEN``),
it is shown only this once -- then the lines to paste into the server's
config, which hold only the token's ``sha256:`` hash. ``changebus token
hash`` reads a token from stdin (one line) and prints its hash; tokens
shorter than 32 characters are refused (exit status 2): a plain SHA-256
protects only tokens too long to guess.
"""

from __future__ import annotations

import argparse
import json
import sys

from ._auth import hash_token, new_token
from .errors import ConfigError

__all__ = ["register"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``changebus token`` and its subcommands ``new`` and ``hash``."""
    p = sub.add_parser(
        "token",
        help="make bearer tokens and their hashes for [[security.principals]]",
        description="Make bearer tokens (for clients) and their sha256: hashes (for server configs).",
    )
    p.set_defaults(func=lambda _args: _usage(p))
    actions = p.add_subparsers(dest="token_command", metavar="ACTION")
    new = actions.add_parser(
        "new",
        help="print a new random token, then the config lines with its hash",
        description="Print a new random token (first line; shown once), then the lines "
        "for the server's [[security.principals]] entry.",
    )
    new.add_argument("--name", default="", help="the principal's name for the config lines")
    new.set_defaults(func=_new)
    hashed = actions.add_parser(
        "hash",
        help="read a token from stdin, print its sha256: hash",
        description="Read a token from stdin (one line) and print the sha256: hash a server "
        "config's tokens list holds.",
    )
    hashed.set_defaults(func=_hash)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _new(args: argparse.Namespace) -> int:
    token = new_token()
    print(token)
    print("# in the server config (the token itself is not stored there):")
    print("[[security.principals]]")
    print(f"name = {json.dumps(args.name or 'CHANGE-ME')}")
    print(f'tokens = ["{hash_token(token)}"]')
    return 0


def _hash(args: argparse.Namespace) -> int:
    token = sys.stdin.readline().strip()
    try:
        print(hash_token(token))
    except ConfigError as exc:
        print(f"changebus token hash: {exc.message}", file=sys.stderr)
        return 2
    return 0
