"""The MariaDB seeder's connection: its settings, its server's errors, SQL text helpers.

:func:`mysql_config_from_dsn` turns ``seed.dsn`` into connection settings
(the fetcher's: password file and TLS options as query parameters; never
quoting the DSN: it holds the password); :func:`relay_origin` reads
the server id and SCN base a seed must align with; :func:`source_errors`
maps PyMySQL errors to retriable :class:`~changebus.schemas.SourceError`;
:func:`check_readable` tells a dropped table from one the seed's user may
not read. Blocking (PyMySQL): the seeder's thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final

from changebus.schemas import SourceConfigError, SourceError

__all__ = [
    "check_readable",
    "column_names",
    "mysql_config_from_dsn",
    "q",
    "relay_origin",
    "server_message",
    "source_errors",
    "where_sql",
]


def mysql_config_from_dsn(dsn: str) -> Any:
    """A :class:`~changebus.fetchers.mysql.MySQLConfig` from ``seed.dsn``.

    ``mysql://user[:password]@host:port[?option=value&...]`` (``mariadb://``
    too; user and password percent-decoded): the query takes the fetcher's
    connection options (``password_file``, ``require_tls``, ``tls_ca_file``,
    ``tls_cert_file``, ``tls_key_file``, ``tls_check_hostname``), so the seed
    logs in and verifies the server as the relay's fetcher does. The
    password file is not read here (:meth:`MySQLConfig.resolved`, at the
    seed's start). Errors never quote the DSN (it may hold the password).
    """
    from changebus.fetchers.mysql import MySQLConfig

    return MySQLConfig.from_dsn(dsn, "seed.dsn")


def relay_origin(relay_fetcher: Mapping[str, Any] | None) -> tuple[int, int]:
    """``(server id, SCN base)`` of the relay's started mysql fetcher.

    Without them a chunk's tag could not be placed among the relay's SCNs
    (after a failover the base is not 0), so their absence is an error
    (retriable: a relay that is starting has no fetcher status yet).
    """
    server = int((relay_fetcher or {}).get("mysql_server_id", 0) or 0)
    if relay_fetcher is None or relay_fetcher.get("kind") != "mysql" or not server:
        raise SourceError(
            "the relay's fetcher of this partition is not a running mysql fetcher (no server "
            "id and SCN base in its /v1/status): cannot align a MySQL seed with its SCNs",
            retriable=True,
        )
    return server, int(relay_fetcher.get("scn_base", 0) or 0)


def q(name: str) -> str:
    """A quoted identifier, for a query formatted with parameters (``%`` doubled)."""
    return "`" + name.replace("`", "``").replace("%", "%%") + "`"


def server_message(exc: BaseException) -> tuple[int, str]:
    """``(error code, message)`` of a PyMySQL error (code 0: unknown)."""
    args = getattr(exc, "args", ())
    code = args[0] if args and isinstance(args[0], int) else 0
    return code, str(args[-1]) if args else type(exc).__name__


@contextlib.contextmanager
def source_errors(what: str) -> Iterator[None]:
    """PyMySQL errors as retriable :class:`SourceError` (``what`` failed)."""
    import pymysql

    try:
        yield
    except pymysql.err.MySQLError as exc:
        code, message = server_message(exc)
        raise SourceError(f"MariaDB error {code} {what}: {message}", retriable=True) from None


def where_sql(conditions: Sequence[str]) -> str:
    return " WHERE " + " AND ".join(conditions) if conditions else ""


def column_names(cur: Any) -> list[str]:
    return [str(d[0]) for d in cur.description]


#: ER_NO_SUCH_TABLE; ER_TABLEACCESS_DENIED_ERROR, ER_DBACCESS_DENIED_ERROR
_NO_SUCH_TABLE: Final = 1146
_DENIED: Final = frozenset((1142, 1044))


def check_readable(conn: Any, name: str) -> None:
    """Raise for a table ``db.table`` the server does not have (``gone``: dropped since
    the stream brought it) or does not let the seed's user read. The server's own
    answer tells them apart: ``information_schema`` hides tables the user may not
    read, which would look dropped."""
    import pymysql

    db, _, table = name.partition(".")
    try:
        with conn.cursor() as cur:
            # (with parameters, even none: q() doubles a % for them; without, a name
            # holding % named another table, and the table was seeded as gone: review)
            cur.execute(f"SELECT 1 FROM {q(db)}.{q(table)} LIMIT 0", ())
        conn.rollback()
    except pymysql.err.MySQLError as exc:
        with contextlib.suppress(Exception):
            conn.rollback()
        code, message = server_message(exc)
        if code == _NO_SUCH_TABLE:
            raise SourceConfigError(
                f"table {name} does not exist in the source", gone=True
            ) from None
        if code in _DENIED:
            raise SourceConfigError(
                f"the seed's user may not read table {name} (MariaDB error {code}: "
                f"{message}): grant it SELECT"
            ) from None
        raise SourceError(
            f"MariaDB error {code} looking up {name}: {message}", retriable=True
        ) from None
