"""Keeping secrets out of logs, status pages, metrics and error messages.

Three tools, all pure functions (thread-safe, no state), and :func:`printable`
(a client's text for a log line: cut, and escaped so it stays one line):

* :func:`secret_key` -- whether an option *name* holds a secret (``dsn``,
  ``password``, ``column_hash_key``, ``token``...); names of where a secret
  lives (``..._env``, ``..._file``, ``..._path``) are not secrets themselves.
* :func:`secret_values` -- every secret *value* of a config tree (frozen
  dataclasses, option dicts, lists): fields marked ``secret``, values under
  secret-looking keys, and the passwords inside any DSN or URL string.
* :func:`scrub` -- a text with those values replaced by ``***``, and with
  any password a DSN pattern reveals masked too: URL userinfo
  (``postgresql://user:pw@host``, ``mysql://...``, ``https://...``) and the
  libpq key/value form (``password=pw``, quoted or not). Used on every error
  text that can reach a log line, ``/v1/status``, ``/metrics`` or an HTTP
  error body, whether or not the message is known to quote a DSN (driver
  messages change between versions).

An empty secret is shown empty, never as ``***`` (an unset ``token`` reads
``token = ""`` in ``--check``; the mask would claim a value is set): every
pattern and :func:`redact_value` mask only a value that has characters.

Known values shorter than :data:`_MIN_SECRET` characters are not replaced
(replacing every ``a`` would make a message unreadable and still hint at the
value); the DSN patterns mask them anyway where the text quotes a DSN.
"""

from __future__ import annotations

import dataclasses
import re
import traceback
import urllib.parse
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Final

__all__ = [
    "MASK",
    "dsn_passwords",
    "printable",
    "redact_value",
    "remember_secret",
    "scrub",
    "scrub_exception",
    "secret_key",
    "secret_values",
    "url_without_user",
]

#: what replaces a secret
MASK: Final = "***"
_MIN_SECRET: Final = 3

#: a word of an option name that makes it secret wherever it stands
_SECRET_WORDS: Final = frozenset(
    {
        "dsn",
        "password",
        "passwd",
        "pwd",
        "passphrase",
        "secret",
        "secrets",
        "token",
        "tokens",
        "credential",
        "credentials",
        "apikey",
    }
)
#: a last word naming where a secret is kept, not the secret (``token_file``, ``key_env``)
_PLACE_WORDS: Final = frozenset({"env", "file", "path", "dir", "name"})

#: ``scheme://user:password@`` (the password part; no ``/``, ``@`` or blank in it)
_URL_PASSWORD: Final = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*://[^/\s:@]*):([^@/\s]+)@")
#: libpq ``password=value`` (or a quoted value, possibly unterminated) and look-alikes;
#: never an empty value (``token = ""``: nothing to hide, and ``***`` would say there is)
_KV_PASSWORD: Final = re.compile(
    r"""(\b(?:password|passwd|pwd|passphrase|secret|token)\s*=\s*)"""
    r"""('(?:[^'\\]|\\.)+(?:'|$)|"(?:[^"\\]|\\.)+(?:"|$)|[^\s'",;&]+)""",
    re.IGNORECASE,
)
#: ``'password': 'value'`` as a Python or JSON mapping prints it (not ``'dsn': ''``)
_MAP_PASSWORD: Final = re.compile(
    r"""((["'])(?:password|passwd|pwd|secret|token|dsn)\2\s*:\s*)(["'])(?:(?!\3)[^\\]|\\.)+\3""",
    re.IGNORECASE,
)
_CAMEL: Final = re.compile(r"([a-z0-9])([A-Z])")


def secret_key(name: str) -> bool:
    """Whether an option called ``name`` holds a secret (module docstring)."""
    words = [w for w in re.split(r"[^a-z0-9]+", _CAMEL.sub(r"\1_\2", name).lower()) if w]
    if not words or words[-1] in _PLACE_WORDS:
        return False
    return words[-1] == "key" or any(w in _SECRET_WORDS for w in words)


def dsn_passwords(text: str) -> list[str]:
    """The passwords a DSN or URL string holds (raw and percent-decoded), if any."""
    found: list[str] = []
    for m in _URL_PASSWORD.finditer(text):
        found.append(m.group(2))
        decoded = urllib.parse.unquote(m.group(2))
        if decoded != m.group(2):
            found.append(decoded)
    if "://" in text:  # a URL password with blanks or slashes the pattern stops at
        try:
            parts = urllib.parse.urlsplit(text.strip())
            if parts.password:
                found += [parts.password, urllib.parse.unquote(parts.password)]
        except ValueError:
            pass
    for m in _KV_PASSWORD.finditer(text):
        value = m.group(2)
        if value[:1] in ("'", '"'):
            value = value[1:-1] if len(value) > 1 and value[-1] == value[0] else value[1:]
            value = re.sub(r"\\(.)", r"\1", value)
        found.append(value)
    return [p for p in found if p]


def secret_values(config: Any) -> tuple[str, ...]:
    """Every secret value in a config tree (module docstring), longest first."""
    found: set[str] = set()

    def walk(value: Any, secret: bool) -> None:
        if isinstance(value, str):
            if secret and value:
                found.add(value)
            found.update(dsn_passwords(value))
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for f in dataclasses.fields(value):
                walk(getattr(value, f.name), bool(f.metadata.get("secret")))
        elif isinstance(value, Mapping):
            for k, v in value.items():
                walk(v, secret or (isinstance(k, str) and secret_key(k)))
        elif isinstance(value, list | tuple | set | frozenset):
            for v in value:
                walk(v, secret)

    walk(config, False)
    return tuple(sorted(found, key=len, reverse=True))


#: secrets read from files after start-up (:func:`remember_secret`): every scrub
#: removes them too, so the log formatters, built before they were read, hide them
_READ_SECRETS: set[str] = set()
_READ_SECRETS_MAX: Final = 256


def remember_secret(value: str) -> None:
    """Have every later :func:`scrub` remove ``value`` (a password read from a file).

    Thread-safe (a set's ``add`` under the GIL); at most ``_READ_SECRETS_MAX`` are kept.
    """
    if len(value) >= _MIN_SECRET and len(_READ_SECRETS) < _READ_SECRETS_MAX:
        _READ_SECRETS.add(value)


def scrub(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` without the known ``secrets`` and without passwords of DSNs it quotes.

    ``secrets`` may hold whole DSNs: their passwords are removed as well; the
    secrets read from files (:func:`remember_secret`) are removed always.
    """
    known: set[str] = set(_READ_SECRETS)
    for s in secrets:
        if s:
            known.add(s)
            known.update(dsn_passwords(s))
    for s in sorted(known, key=len, reverse=True):
        if len(s) >= _MIN_SECRET and s in text:
            text = text.replace(s, MASK)
    text = _URL_PASSWORD.sub(rf"\1:{MASK}@", text)
    text = _KV_PASSWORD.sub(rf"\1{MASK}", text)
    return _MAP_PASSWORD.sub(rf"\1\3{MASK}\3", text)


def scrub_exception(exc: BaseException, secrets: Iterable[str] = (), *, trace: bool = False) -> str:
    """``Type: message`` of ``exc`` (its whole traceback with ``trace``), scrubbed."""
    if trace:
        text = "".join(traceback.format_exception(exc)).rstrip()
    else:
        text = f"{type(exc).__name__}: {exc}".rstrip(": ")
    return scrub(text, secrets)


def redact_value(value: Any, secret: bool = False) -> Any:
    """A JSON-friendly copy of a config tree with secrets masked (see ``config.redacted``)."""
    if secret:
        return MASK if value else value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: redact_value(getattr(value, f.name), bool(f.metadata.get("secret")))
            for f in dataclasses.fields(value)
        }
    if isinstance(value, Mapping):
        return {k: redact_value(v, isinstance(k, str) and secret_key(k)) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [redact_value(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, str):
        return scrub(value)
    return value


def printable(text: str, limit: int = 200) -> str:
    """``text`` cut to ``limit`` characters with control characters escaped.

    For a client's words in a log line (a request path is percent-decoded:
    ``%0A`` is a line break that would forge a second line).
    """
    return repr(text[:limit])[1:-1]


def url_without_user(url: object) -> str:
    """``url`` for a message: without its user name and password (``user:pw@``).

    For any text, a URL or not (a configuration's value may be anything):
    whatever precedes the last ``@`` of the part after ``scheme://`` and
    before the next ``/`` is left out.
    """
    text = printable(str(url))[:200]
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "", text
    host, slash, path = rest.partition("/")
    if "@" in host:
        host = "***@" + host.rpartition("@")[2]
    return f"{scheme}{sep}{host}{slash}{path}"
