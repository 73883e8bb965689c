"""Column policies: exclude, hash (HMAC-SHA256) or truncate columns at ingest.

A fetcher's options may name, per source (``schema.table`` for Postgres,
``database.table`` for MySQL/MariaDB, as the fetcher names its sources), what
to do with some of its columns before anything leaves the fetcher::

    [partitions.fetcher.options.column_policy."public.users"]
    email = "hash"          # HMAC-SHA256 of the value, lower-case hex
    ssn = "exclude"         # not captured at all
    bio = "truncate:256"    # strings cut to 256 characters, bytes to 256 bytes

    [partitions.fetcher.options]
    column_hash_key = "..."                  # the HMAC key (secret), or
    column_hash_key_env = "CHANGEBUS_COLUMN_KEY"   # the environment variable holding it
    # column_policy_file = "/etc/changebus/columns.toml"  # instead of column_policy

The bootstrap server's ``[seed]`` table takes the same four options, so that
seeded snapshot rows follow the same policy (the seeders check the relay's
schemas against it: :meth:`ColumnPolicy.check_schema`).

:class:`ColumnPolicy` is that table parsed and checked (:meth:`ColumnPolicy.parse`
raises :class:`~changebus.schemas.ConfigError` naming the source and column,
never the key). :meth:`ColumnPolicy.plan` applies it to one table's columns
when the fetcher first sees the table (a Relation message, a TABLE_MAP event)
and gives a :class:`TablePlan`: the columns of the table schema (excluded ones
dropped; a hashed column becomes ``string``; ``Column.policy`` says what was
done, shown as the ``changebus.policy`` field property) and one
:class:`ColumnRule` (or None) per source column, which the fetchers' row
paths apply to values. Tables without a policy get no plan (None), so their
fast paths run unchanged; a table with one pays per-value work only in the
columns it names.

Hashing. ``hash`` replaces a value by ``HMAC-SHA256(key, canonical(value))``
as 64 lower-case hex characters; NULL stays NULL. The canonical bytes
(:func:`canonical_bytes`) of a value are: text -> its UTF-8; integers -> their
decimal text; bytes -> themselves; booleans -> ``true``/``false``; decimals
-> their plain decimal text; UUIDs -> the hyphenated lower-case text;
dates and times -> ISO 8601 text; anything else -> ``str()``. Text, integer
and binary columns therefore hash the same from Postgres, from MariaDB, and
from the bootstrap seeders, so joins on hashed columns work across sources.

Key columns. A hashed key column keeps the event key consistent: the key
record holds the hashed value (both row paths compute it from the same
rule), so the partition hash of mod filters is stable for a given key and
secret. Excluding or truncating a key column is refused
(:class:`~changebus.schemas.SourceConfigError` when the table is first
seen): events would lose or merge their identity. Changing the hash key
changes every hashed key: treat it as a new source (re-seed).

A policy naming a column the table does not have is logged once as a
warning (the table may gain it later), not an error.

Thread-safety: immutable after construction (the "warned once" set is a
benign race: at worst a warning is logged twice).
"""

from __future__ import annotations

import datetime
import decimal
import hmac
import logging
import os
import tomllib
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from changebus.schemas import Column, ConfigError, SourceConfigError, TableSchema
from changebus.schemas.config import remember_secret, secret

__all__ = ["ColumnPolicy", "ColumnRule", "TablePlan", "canonical_bytes"]

log = logging.getLogger("changebus.fetchers.policy")

HASH_LABEL: Final = "hmac-sha256"
_STRING_KINDS: Final = frozenset({"string"})
_BYTES_KINDS: Final = frozenset({"bytes"})


def canonical_bytes(value: Any) -> bytes:
    """The bytes a hashed value is keyed over (see the module docstring)."""
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass")
    if isinstance(value, bool):
        return b"true" if value else b"false"
    if isinstance(value, int):
        return str(value).encode()
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, decimal.Decimal):
        return format(value, "f").encode()
    if isinstance(value, uuid.UUID):
        return str(value).encode()
    if isinstance(value, datetime.date | datetime.time):
        return value.isoformat().encode()
    return str(value).encode("utf-8", "surrogatepass")


@dataclass(frozen=True)
class ColumnRule:
    """What to do with one column: ``action`` is ``exclude``, ``hash`` or ``truncate``.

    ``length`` -- characters (text) or bytes (binary) kept by ``truncate``.
    ``key`` -- the HMAC key of ``hash`` (secret: not in the repr, not compared).
    """

    action: str
    length: int = 0
    key: bytes = field(default=b"", repr=False, compare=False)

    @property
    def label(self) -> str:
        """What the schema says (``Column.policy``): ``hmac-sha256`` / ``truncate:<n>``."""
        if self.action == "hash":
            return HASH_LABEL
        if self.action == "truncate":
            return f"truncate:{self.length}"
        return "exclude"

    def apply(self, value: Any) -> Any:
        """The value as captured (None stays None; not for ``exclude``)."""
        if value is None:
            return None
        if self.action == "hash":
            # OpenSSL's one-shot HMAC: a few times faster than hmac.new(...).hexdigest()
            return hmac.digest(self.key, canonical_bytes(value), "sha256").hex()
        if isinstance(value, str | bytes):
            return value[: self.length]
        if isinstance(value, bytearray | memoryview):
            return bytes(value)[: self.length]
        return value


@dataclass(frozen=True)
class TablePlan:
    """A policy applied to one table: the schema's columns and a rule per source column.

    ``columns`` -- the table schema's columns (policy applied: excluded ones
    dropped, hashed ones retyped, ``Column.policy`` set). ``rules`` -- per
    source column, in the source's order: its :class:`ColumnRule` or None.
    ``source_columns`` -- the source's columns the plan was made from (as
    long as ``rules``).
    """

    columns: tuple[Column, ...]
    rules: tuple[ColumnRule | None, ...]
    source_columns: tuple[Column, ...]

    @property
    def excluded(self) -> frozenset[str]:
        """Names of the excluded source columns."""
        return frozenset(
            c.name for c, r in zip(self.source_columns, self.rules, strict=True) if _is_excluded(r)
        )


def _is_excluded(rule: ColumnRule | None) -> bool:
    return rule is not None and rule.action == "exclude"


def _parse_rule(source: str, column: str, text: Any, key: bytes) -> ColumnRule:
    where = f"column_policy.{source!r}.{column!r}"
    if not isinstance(text, str):
        raise ConfigError(f"{where}: expected 'exclude', 'hash' or 'truncate:<n>', got {text!r}")
    action, _, arg = text.strip().partition(":")
    if action == "exclude" and not arg:
        return ColumnRule("exclude")
    if action == "hash" and not arg:
        if not key:
            raise ConfigError(
                f"{where} is 'hash' but no key is set: set column_hash_key or "
                "column_hash_key_env (an environment variable holding the key)"
            )
        return ColumnRule("hash", key=key)
    if action == "truncate":
        if not arg.strip().isdigit() or int(arg) <= 0 or len(arg.strip()) > 9:
            raise ConfigError(f"{where}: truncate needs a positive length, e.g. 'truncate:256'")
        return ColumnRule("truncate", int(arg))
    raise ConfigError(
        f"{where}: unknown policy {text!r} (expected 'exclude', 'hash' or 'truncate:<n>')"
    )


def _avro_kind(avro: Any) -> str:
    if isinstance(avro, dict):
        if avro.get("logicalType"):
            return str(avro["logicalType"])
        return str(avro.get("type"))
    return str(avro)


@dataclass(frozen=True)
class ColumnPolicy:
    """Parsed column policies of one fetcher: ``{source: {column: rule}}`` (see module doc)."""

    sources: Mapping[str, Mapping[str, ColumnRule]] = field(default_factory=dict)
    #: ``(source, column)`` pairs already warned about (a column the table lacks)
    _warned: set[tuple[str, str]] = field(default_factory=set, repr=False, compare=False)

    def __bool__(self) -> bool:
        return bool(self.sources)

    @classmethod
    def parse(
        cls,
        table: Mapping[str, Any] | None,
        hash_key: str = "",
        hash_key_env: str = "",
        *,
        file: str | Path = "",
        environ: Mapping[str, str] | None = None,
    ) -> ColumnPolicy:
        """Check and parse a ``column_policy`` table; :class:`ConfigError` when wrong.

        ``file``: a TOML file holding the table instead (its top-level tables
        are the sources), so that a relay and a bootstrap server share one.
        The key is ``hash_key``, else the value of the environment variable
        ``hash_key_env`` (which must then be set and non-empty).
        """
        if file:
            if table:
                raise ConfigError("set column_policy or column_policy_file, not both")
            try:
                with Path(file).open("rb") as fh:
                    table = tomllib.load(fh)
            except OSError as exc:
                raise ConfigError(
                    f"column_policy_file {file}: cannot read it ({exc.strerror})"
                ) from None
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError(f"column_policy_file {file} is not valid TOML: {exc}") from None
        if hash_key and hash_key_env:
            raise ConfigError("set column_hash_key or column_hash_key_env, not both")
        key = hash_key
        if hash_key_env:
            key = (os.environ if environ is None else environ).get(hash_key_env, "")
            remember_secret(key)  # (read after the log formatters were built)
            if not key:
                raise ConfigError(
                    f"column_hash_key_env names the environment variable {hash_key_env!r}, "
                    "which is not set or empty"
                )
        if not table:
            return cls()
        if not isinstance(table, Mapping):
            raise ConfigError("column_policy must be a table of sources")
        sources: dict[str, dict[str, ColumnRule]] = {}
        for source, columns in table.items():
            if "." not in source:
                raise ConfigError(
                    f"column_policy: source {source!r} must be named 'schema.table' "
                    "('database.table' for MySQL)"
                )
            if not isinstance(columns, Mapping) or not columns:
                raise ConfigError(f"column_policy.{source!r}: expected a table of columns")
            sources[source] = {
                str(col): _parse_rule(source, str(col), text, key.encode())
                for col, text in columns.items()
            }
        return cls(sources)

    def plan(self, source: str, columns: Sequence[Column], key: Sequence[str]) -> TablePlan | None:
        """The policy for table ``source`` with ``columns`` and ``key``; None: no policy.

        Raises :class:`SourceConfigError` for an excluded or truncated key
        column, a truncate of a non-text, non-binary column, or a policy that
        would leave the table without columns.
        """
        rules_of = self.sources.get(source)
        if not rules_of:
            return None
        names = {c.name for c in columns}
        for col in rules_of:
            if col not in names and (source, col) not in self._warned:
                self._warned.add((source, col))
                log.warning(
                    "column_policy names %s.%s, which the table does not have (ignored)",
                    source,
                    col,
                )
        keys = set(key)
        out: list[Column] = []
        rules: list[ColumnRule | None] = []
        for c in columns:
            rule = rules_of.get(c.name)
            rules.append(rule)
            if rule is None:
                out.append(c)
                continue
            where = f"column_policy for {source}.{c.name}"
            if c.name in keys and rule.action != "hash":
                raise SourceConfigError(
                    f"{where}: {rule.action} is refused on a key column (events would lose "
                    "their identity); only 'hash' is allowed on key columns"
                )
            if rule.action == "exclude":
                continue
            if rule.action == "hash":
                out.append(Column(c.name, "string", c.nullable, c.source_type, rule.label))
                continue
            kind = _avro_kind(c.type)
            if kind not in _STRING_KINDS and kind not in _BYTES_KINDS:
                raise SourceConfigError(
                    f"{where}: truncate applies to text and binary columns, not {kind} "
                    f"({c.source_type or kind})"
                )
            out.append(Column(c.name, c.type, c.nullable, c.source_type, rule.label))
        if not out:
            raise SourceConfigError(f"column_policy for {source} excludes every column")
        if all(r is None for r in rules):
            return None
        return TablePlan(tuple(out), tuple(rules), tuple(columns))

    def rules_for(self, source: str) -> Mapping[str, ColumnRule]:
        """The rules of ``source`` by column name (empty: none)."""
        return self.sources.get(source, {})

    def check_schema(self, schema: TableSchema) -> None:
        """Refuse ``schema`` (a fetcher's) if this policy would not have made it.

        For the bootstrap seeders, whose rows must follow the same policy as
        the fetcher's: a column the schema shows hashed or truncated that this
        policy leaves alone (or the reverse), or a column this policy
        excludes that the schema has, raises :class:`SourceConfigError`
        naming the column. (The hash key itself cannot be checked.)
        """
        rules = self.rules_for(schema.name)
        for c in schema.columns:
            rule = rules.get(c.name)
            want = "exclude" if _is_excluded(rule) else (rule.label if rule else "")
            if want != c.policy:
                raise SourceConfigError(
                    f"column {schema.name}.{c.name}: the relay's schema has policy "
                    f"{c.policy or 'none'!r}, this column_policy says {want or 'none'!r}: "
                    "give the seed the fetcher's column_policy (and hash key)"
                )


@dataclass(frozen=True, kw_only=True)
class ColumnPolicyOptions:
    """The column-policy settings, one set for every config that needs them.

    The Postgres and MySQL fetchers' configs and the bootstrap server's
    ``[seed]`` table inherit these four keyword-only fields, so an operator
    writes the same keys everywhere (a shared ``column_policy_file`` and
    ``column_hash_key_env`` say them once):

    * ``column_policy`` -- per source (``schema.table`` / ``database.table``):
      ``{column: "exclude" | "hash" | "truncate:<n>"}``, applied at ingest;
    * ``column_hash_key`` -- the HMAC key of ``hash`` policies (secret: never
      logged, not in the repr), or ``column_hash_key_env`` naming the
      environment variable that holds it;
    * ``column_policy_file`` -- a TOML file holding the ``column_policy``
      table instead.
    """

    column_policy: dict[str, Any] = field(default_factory=dict)
    column_hash_key: str = secret()
    column_hash_key_env: str = ""
    column_policy_file: str = ""

    def column_rules(self) -> ColumnPolicy:
        """The parsed column policy (:class:`ConfigError` when it is wrong)."""
        return ColumnPolicy.parse(
            self.column_policy,
            self.column_hash_key,
            self.column_hash_key_env,
            file=self.column_policy_file,
        )
