"""Environment variables as config overrides: which ones name a config key.

:func:`env_overrides` turns the variables ``<PREFIX><SECTION>__<KEY>`` of an
environment into ``(name, key path, value)`` overrides for
:func:`~changebus.schemas.config.load_config`. The key path is resolved
against the config's frozen dataclasses (:func:`key_type`): a field of a
section (a nested dataclass, or the dataclass arm of ``X | None``) is a key,
and so is anything below a free-form table (``dict`` or ``Any`` fields:
a fetcher's ``options``). Entries of arrays of tables (``partitions``) are
not: such an array is overridden whole or not at all.

Kubernetes service links: for every Service of the namespace the kubelet
adds ``<NAME>_SERVICE_HOST``, ``<NAME>_SERVICE_PORT``,
``<NAME>_SERVICE_PORT_<PORT NAME>``, ``<NAME>_PORT`` and
``<NAME>_PORT_<number>_<TCP|UDP|SCTP>[_PROTO|_PORT|_ADDR]`` to each pod's
environment (unless the pod spec says ``enableServiceLinks: false``). A
Service called ``changebus-bootstrap`` thus puts ``CHANGEBUS_BOOTSTRAP_PORT
=tcp://...`` beside the daemon's own overrides. A variable whose name has
that form and is *not* a config key is skipped with a debug log line; a real
key always wins (``CHANGEBUS_RELAY_HTTP__PORT`` ends in ``_PORT`` and is
``http.port``), and any other unknown name stays an error (typos do not pass
silently). Values are never logged (a variable may hold a DSN).

Values (:func:`env_value`): a variable for a key of type ``str`` or ``Path``
(or ``X | None`` of them) is taken as it is, never parsed: a password, token
or member id that reads as a TOML number, date or boolean (``123456``,
``2024-01-01``, ``true``) stays the text it is, quotes included. The items
of a ``tuple[str, ...]`` key are text too unless the value is a TOML array
(``a,b`` splits at commas, ``["a", "b"]`` is parsed). Other values are
parsed as TOML when they parse (``8080``, ``true``, ``[1, 2]``), else taken
as text (``64MiB``): the key's own conversion then accepts or refuses them.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

__all__ = [
    "NOT_A_KEY",
    "env_overrides",
    "env_value",
    "is_service_link",
    "key_type",
    "parse_text",
]

log = logging.getLogger(__name__)

#: what :func:`key_type` returns for a path that names no config key
NOT_A_KEY: Final = object()

#: the names Kubernetes gives service-link variables (upper case; ``<NAME>`` is the
#: Service's name with ``-`` as ``_``), each with the form of its value: an address,
#: a port number, a protocol or an ``tcp://address:port`` URL. A name alone matched
#: typos too (``..._HTTP_PORT=9000`` for ``HTTP__PORT``: skipped, not refused; review)
_ADDRESS: Final = r"[0-9a-fA-F.:]+"
_PORT_NUMBER: Final = r"[0-9]{1,5}"
_PROTOCOL: Final = r"(?:TCP|UDP|SCTP)"
_SERVICE_LINKS: Final = tuple(
    (re.compile(rf"[A-Z0-9_]+_{name}"), re.compile(value, re.IGNORECASE))
    for name, value in (
        ("SERVICE_HOST", _ADDRESS),
        ("SERVICE_PORT(?:_[A-Z0-9_]+)?", _PORT_NUMBER),
        (f"PORT(?:_[0-9]+_{_PROTOCOL})?", rf"{_PROTOCOL}://\[?{_ADDRESS}\]?:{_PORT_NUMBER}"),
        (f"PORT_[0-9]+_{_PROTOCOL}_PROTO", _PROTOCOL),
        (f"PORT_[0-9]+_{_PROTOCOL}_PORT", _PORT_NUMBER),
        (f"PORT_[0-9]+_{_PROTOCOL}_ADDR", _ADDRESS),
    )
)


def parse_text(text: str) -> Any:
    """A value given as text: a TOML value when it parses (``8080``, ``true``,
    ``["a", "b"]``), else the text itself."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def is_service_link(name: str, value: str) -> bool:
    """Whether ``name`` and ``value`` have the form of a Kubernetes service-link variable
    (module docstring)."""
    upper, text = name.upper(), value.strip()
    return any(
        form.fullmatch(upper) is not None and value_form.fullmatch(text) is not None
        for form, value_form in _SERVICE_LINKS
    )


def _section(tp: Any) -> type[Any] | None:
    """The dataclass a field of type ``tp`` holds as a section (``X`` or ``X | None``)."""
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if dataclasses.is_dataclass(arg) and isinstance(arg, type):
                return arg
    return None


def _free_form(tp: Any) -> bool:
    """Whether a field of type ``tp`` is a table of any keys (``dict``, ``Any``)."""
    return tp is Any or tp is dict or typing.get_origin(tp) is dict


def key_type(cls: type[Any], path: Sequence[str]) -> Any:
    """The type of the config key at ``path`` in dataclass ``cls``, or :data:`NOT_A_KEY`.

    ``Any`` for a path below a free-form table (its keys have no declared type).
    """
    tp: Any = cls
    for part in path:
        if _free_form(tp):
            return Any
        section = _section(tp)
        if section is None:  # through a value, or into an array of tables
            return NOT_A_KEY
        fields = {f.name for f in dataclasses.fields(section)}
        if part not in fields:
            return NOT_A_KEY
        tp = typing.get_type_hints(section)[part]
    return tp


def _text(tp: Any) -> bool:
    """Whether a key of type ``tp`` holds text: ``str``, ``Path``, or either ``| None``."""
    if tp in (str, Path):
        return True
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        arms = [a for a in typing.get_args(tp) if a is not type(None)]
        return bool(arms) and all(a in (str, Path) for a in arms)
    return False


def env_value(tp: Any, text: str) -> Any:
    """The value of an environment variable ``text`` for a key of type ``tp`` (module docstring)."""
    if _text(tp):
        return text
    value = parse_text(text)
    if typing.get_origin(tp) is tuple and _text(typing.get_args(tp)[0]):
        return value if isinstance(value, list) else text
    return value


def env_overrides(
    cls: type[Any], environ: Mapping[str, str], prefix: str
) -> list[tuple[str, list[str], Any]]:
    """``(variable, key path, value)`` for each variable of ``environ`` under ``prefix``.

    Names are case-insensitive; ``__`` separates levels. Service links that are
    no config key are left out (module docstring); other unknown keys are kept,
    for the loader to refuse with the nearest valid key.
    """
    found = []
    for name, text in sorted(environ.items()):
        if not name.upper().startswith(prefix.upper()) or len(name) <= len(prefix):
            continue
        path = name[len(prefix) :].lower().split("__")
        tp = key_type(cls, path)
        if tp is NOT_A_KEY and is_service_link(name, text):
            log.debug("environment variable %s skipped: a Kubernetes service link", name)
            continue
        found.append((name, path, parse_text(text) if tp is NOT_A_KEY else env_value(tp, text)))
    return found
