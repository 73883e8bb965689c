"""Configuration loading shared by the daemons: TOML file, env, CLI overrides.

Every component describes its configuration as frozen dataclasses (nested for
sections, validated in ``__post_init__``) with one unit per quantity: sizes
in bytes, durations in seconds (float). :func:`load_config` fills them from,
in increasing priority:

1. the dataclass defaults;
2. a TOML file (sections are nested dataclasses; arrays of tables are
   ``tuple[SomeDataclass, ...]`` fields);
3. environment variables ``<PREFIX><SECTION>__<KEY>`` (double underscore
   between levels, case-insensitive), e.g. ``CHANGEBUS_RELAY_HTTP__PORT=9000``
   (:mod:`._config_env`: keys inside arrays of tables such as ``partitions``
   have none; Kubernetes service links such as ``CHANGEBUS_BOOTSTRAP_PORT``
   that are no config key are skipped);
4. ``--set key.path=value`` overrides from the command line.

An env value for a string or path key is taken as it is (a password
``123456`` stays text: :func:`._config_env.env_value`); other env values and
all ``--set`` values are parsed as TOML values when they parse (``8080``,
``true``, ``["a", "b"]``) and taken as plain strings otherwise (``--set
'cluster.zk_password="123456"'`` quotes a string that reads as a number).

Fields whose metadata holds ``{"secret": True}`` (DSNs, passwords) are shown
as ``"***"`` by :func:`redacted`, which is what daemons log; so are values of
free-form option tables under secret-looking keys (``dsn``, ``password``,
``column_hash_key``, ``token``...: :func:`secret_key`) and passwords inside
any DSN or URL string. :func:`scrub` removes a config's secrets
(:func:`secret_values`) and DSN passwords from any text: every error message
that can reach a log, a status page or an HTTP body goes through it. A secret
kept in a file is named by a ``*_file`` option beside it (``zk_password_file``,
the MySQL fetcher's ``password_file``; the client's ``token_file``), never both:
:func:`read_secret_file` reads it when the component starts, and its errors
name the option and the path, never the content. Size fields with
``{"unit": "bytes"}`` also accept strings such as ``"64MiB"`` or ``"2GB"``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import tomllib
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, TypeVar

from ._config_env import env_overrides, parse_text as _parse_text
from ._redact import (
    redact_value,
    remember_secret as remember_secret,
    scrub as scrub,
    scrub_exception as scrub_exception,
    secret_key as secret_key,
    secret_values as secret_values,
    url_without_user as url_without_user,
)
from .errors import ConfigError

__all__ = [
    "load_config",
    "load_config_dict",
    "parse_size",
    "read_secret_file",
    "read_toml",
    "redacted",
    "remember_secret",
    "scrub",
    "scrub_exception",
    "secret",
    "secret_key",
    "secret_values",
    "size_field",
    "unknown_key",
    "url_without_user",
]

T = TypeVar("T")

_SIZE_RE: Final = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmMgGtT]?)(i?)[bB]?\s*")
_SCALE: Final = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def _shown(value: object) -> str:
    """A bad value as an error message quotes it: a table is not quoted (it may hold a
    password), a text is scrubbed of passwords (DSNs, URLs) and cut to 200 characters."""
    if isinstance(value, Mapping):
        return "a table"
    return scrub(repr(value))[:200]


def parse_size(value: int | float | str) -> int:
    """Bytes from an int, a whole float (``6.4e7``) or a string like ``"64MiB"``, ``"1.5GB"``."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConfigError(f"expected a size, got {_shown(value)}")
    if isinstance(value, int):
        return value
    if isinstance(value, float):  # (a TOML float or an env "1e8": a TypeError before)
        if not value.is_integer():
            raise ConfigError(f"bad size {_shown(value)}: expected a whole number of bytes")
        return int(value)
    m = _SIZE_RE.fullmatch(value)
    if not m:
        raise ConfigError(f"bad size {_shown(value)}: expected bytes or e.g. '64MiB', '2GB'")
    base = 1024 if m.group(3) or m.group(2) == "" else 1000
    return int(float(m.group(1)) * base ** _SCALE[m.group(2).lower()])


def secret(default: Any = "", **kwargs: Any) -> Any:
    """A dataclass field whose value must never be logged (left out of the repr too)."""
    kwargs.setdefault("repr", False)
    return dataclasses.field(default=default, metadata={"secret": True}, **kwargs)


def read_secret_file(path: str | Path, option: str) -> str:
    """The secret a ``*_file`` option names: the file's text, surrounding whitespace stripped.

    The one way the configs read a secret kept in a file (``zk_password_file``,
    the MySQL fetcher's ``password_file``): read when the component starts
    (blocking: call it off the event loop), never kept in the config itself.
    A file that cannot be read, is not UTF-8 or holds only whitespace is a
    :class:`ConfigError` naming ``option`` and the path, never the content
    (nor the byte a decoding error stopped at).
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{option} {path}: cannot read it ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{option} {path}: cannot read it (not UTF-8 text)") from None
    secret_text = text.strip()
    if not secret_text:
        raise ConfigError(f"{option} {path} is empty")
    remember_secret(secret_text)  # (the log formatters were built before it was read)
    return secret_text


def size_field(default: int, **kwargs: Any) -> Any:
    """A dataclass field holding bytes; accepts ``"64MiB"``-style strings."""
    return dataclasses.field(default=default, metadata={"unit": "bytes"}, **kwargs)


def _set_path(tree: dict[str, Any], path: Sequence[str], value: Any, origin: str) -> None:
    node = tree
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{origin}: {'.'.join(path)} goes through a non-section value")
        node = child
    node[path[-1]] = value


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> None:
    for k, v in extra.items():
        if isinstance(v, Mapping) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        else:
            base[k] = v


def _convert(tp: Any, value: Any, where: str, field: dataclasses.Field[Any] | None) -> Any:
    origin = typing.get_origin(tp)
    if field is not None and field.metadata.get("unit") == "bytes":
        return parse_size(value)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if type(None) in args and (value is None or (value == "" and Path in args)):
            return None  # ("" clears an optional path: it was Path("."), the working directory)
        errors: list[ConfigError] = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, where, None)
            except ConfigError as exc:
                errors.append(exc)
        if len(errors) == 1:  # (X | None: X's own error says what is wrong)
            raise errors[0]
        # (not the value: a section may hold a password, which the text would quote)
        raise ConfigError(
            f"{where}: fits none of the accepted types ({'; '.join(str(e) for e in errors)})"
        )
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{where}: {_shown(value)} is not one of {list(typing.get_args(tp))}")
        return value
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, list | tuple):
            value = [value] if not isinstance(value, str) else [s for s in value.split(",") if s]
        item = args[0]
        return tuple(_convert(item, v, f"{where}[{i}]", None) for i, v in enumerate(value))
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a table, got {_shown(value)}")
        return dict(value)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a section (table), got {_shown(value)}")
        return _build(tp, value, where)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{where}: expected true or false, got {_shown(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected an integer, got {_shown(value)}")
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            if not math.isfinite(value):
                # (inf or nan: a deadline that never expires, a ratio whose product with
                # 0 is nan; every float setting has a finite largest useful value)
                raise ConfigError(f"{where}: expected a finite number, got {value!r}")
            return float(value)
        raise ConfigError(f"{where}: expected a number (seconds or a ratio), got {_shown(value)}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {_shown(value)}")
    if tp is Path:
        if value == "":
            raise ConfigError(f"{where}: expected a path, got an empty string")
        if isinstance(value, str | Path):
            return Path(value)
        raise ConfigError(f"{where}: expected a path, got {_shown(value)}")
    raise ConfigError(f"{where}: unsupported config type {tp!r}")  # pragma: no cover


def unknown_key(key: str, known: Iterable[str], where: str = "") -> str:
    """The error text for an unknown ``key`` in section ``where``: the nearest known key, if any.

    ``unknown config key http.prot; did you mean http.port?``; with nothing
    close enough (:func:`difflib.get_close_matches`), the known keys are listed.
    """
    prefix = f"{where}." if where else ""
    names = sorted(known)
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    if close:
        return f"unknown config key {prefix}{key}; did you mean {prefix}{close[0]}?"
    section = f" in {where}" if where else ""
    return f"unknown config key {prefix}{key}; known keys{section}: {', '.join(names)}"


def _build(cls: type[T], data: Mapping[str, Any], where: str) -> T:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError("; ".join(unknown_key(u, fields, where) for u in unknown))
    kwargs = {}
    for name, value in data.items():
        at = f"{where}.{name}" if where else name
        try:
            kwargs[name] = _convert(hints[name], value, at, fields[name])
        except ConfigError:
            if not (fields[name].metadata.get("secret") or secret_key(name)):
                raise
            # the message would quote the value
            raise ConfigError(f"{at}: bad value (not shown: it is a secret)") from None
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where or cls.__name__}: {exc}") from exc


def read_toml(path: str | Path) -> dict[str, Any]:
    """The TOML file ``path`` parsed; every way it can fail is a :class:`ConfigError`
    naming the file (a directory, a file the user may not read and bytes that are not
    UTF-8 gave a traceback: review)."""
    try:
        with Path(path).open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text: {exc.reason}") from None
    except OSError as exc:
        raise ConfigError(
            f"config file {path} cannot be read: {exc.strerror or type(exc).__name__}"
        ) from None


def load_config(
    cls: type[T],
    path: Path | str | None = None,
    *,
    env: Mapping[str, str] | None = None,
    env_prefix: str = "",
    overrides: Sequence[str] = (),
) -> T:
    """Build ``cls`` from defaults, a TOML file, env variables and overrides."""
    tree: dict[str, Any] = {}
    if path is not None:
        _merge(tree, read_toml(path))
    if env_prefix:
        source = os.environ if env is None else env
        for name, parts, value in env_overrides(cls, source, env_prefix):
            _set_path(tree, parts, value, f"environment variable {name}")
    for item in overrides:
        key, sep, text = item.partition("=")
        # (named by key only: the value may be a DSN or a token)
        if not sep or not key.strip():
            raise ConfigError("bad override: expected key.path=value")
        _set_path(
            tree, key.strip().split("."), _parse_text(text.strip()), f"override of {key.strip()}"
        )
    return _build(cls, tree, "")


def load_config_dict(cls: type[T], data: Mapping[str, Any], where: str = "") -> T:
    """Build ``cls`` from an already-parsed table (e.g. a plugin's options)."""
    return _build(cls, data, where)


def redacted(config: Any) -> Any:
    """A JSON-friendly copy of a config dataclass with secrets masked.

    Masked: fields marked :func:`secret`, values of option tables under
    secret-looking keys (:func:`secret_key`, at any depth) and the passwords
    of DSNs and URLs in any other string.
    """
    return redact_value(config)
