"""The preflight of a MariaDB/MySQL source for the ``mysql`` fetcher (``changebus check-source``).

:func:`check_mysql` logs in as the fetcher would (host, port, user,
password or password file, and TLS of its options), reads variables, grants and
``information_schema`` only, and returns the findings in :mod:`.._check`'s
model: binary logging on, ``binlog_format = ROW``, ``binlog_row_image =
FULL``, ``binlog_row_metadata = FULL`` (MariaDB 10.5+ / MySQL 8.0+: the
fetcher decodes rows by it; :mod:`._setup` refuses to start otherwise),
``server_id`` set, GTIDs (failover finds its place by them), the grants
(REPLICATION SLAVE for the binlog dump, BINLOG MONITOR / REPLICATION CLIENT
for ``SHOW BINARY LOGS`` and ``SHOW MASTER STATUS``, SELECT for column
types and seeding), binlog retention, and tables in scope with a primary
key. Blocking; runs in a worker thread. Grants are parsed from ``SHOW GRANTS``
(on MariaDB it lists the default role's grants too; a monitor privilege it
does not show is probed with ``SHOW MASTER STATUS``), never printed: it may
quote a password hash.
"""

from __future__ import annotations

import re
from typing import Any

from changebus.schemas import SourceError

from .._check import Finding
from ._config import SYSTEM_DATABASES, MySQLConfig
from ._setup import connect, foreign_key_actions, reason

__all__ = ["check_mysql"]

_VARIABLES = (
    "log_bin",
    "binlog_format",
    "binlog_row_image",
    "binlog_row_metadata",
    "log_bin_compress",
    "binlog_row_value_options",
    "server_id",
    "gtid_strict_mode",
    "gtid_mode",
    "expire_logs_days",
    "binlog_expire_logs_seconds",
)
#: ``GRANT <privileges> ON <what> TO ...``
_GRANT = re.compile(r"^GRANT (.+?) ON (\S+) TO ", re.I)
#: binlogs kept for less than this risk a relay outage turning into data loss
_SHORT_RETENTION_S = 86_400
_WEEK_S = 7 * 86_400


def check_mysql(cfg: MySQLConfig, tables: tuple[str, ...] = ()) -> tuple[str, str, list[Finding]]:
    """``(target, server version, findings)`` for ``cfg`` (see the module docstring).

    ``tables`` (``db.table``) narrows the tables checked for keys (default: the
    configured databases, else every non-system one). Raises
    :class:`~changebus.schemas.SourceError` when the server cannot be reached.
    """
    import pymysql

    conn = connect(cfg)
    target = f"{cfg.host}:{cfg.port} as {cfg.user}"
    try:
        with conn.cursor() as cur:
            return target, *_checks(cur, cfg, tables)
    except pymysql.err.OperationalError as exc:
        raise SourceError(f"lost the MySQL connection: {reason(exc)}") from None
    except pymysql.err.MySQLError as exc:
        raise SourceError(f"a query of the check failed: {reason(exc)}") from None
    finally:
        conn.close()


def _checks(cur: Any, cfg: MySQLConfig, tables: tuple[str, ...]) -> tuple[str, list[Finding]]:
    cur.execute("SELECT VERSION(), CURRENT_USER()")
    version, account = (str(v) for v in cur.fetchone())
    mariadb = "mariadb" in version.lower()
    server = f"{'MariaDB' if mariadb else 'MySQL'} {version.split('-')[0]}"
    names = ", ".join(f"'{n}'" for n in _VARIABLES)
    cur.execute(f"SHOW GLOBAL VARIABLES WHERE Variable_name IN ({names})")
    values = {str(k).lower(): str(v) for k, v in cur.fetchall()}
    out = [Finding.ok("server_version", server)]
    out += _binlog_settings(values, mariadb)
    out.append(_gtid(cur, values, mariadb))
    user, _, host = account.rpartition("@")
    grantee = f"'{user}'@'{host}'"
    out += _grants(cur, cfg, grantee, mariadb)
    out.append(_retention(values, mariadb))
    out.append(_keys(cur, cfg, tables))
    actions = foreign_key_actions(cur, cfg.databases)
    if actions:
        out.append(
            Finding.warn(
                "foreign_key_actions",
                "; ".join(actions),
                "their changes cannot be captured from the binlog",
            )
        )
    else:
        out.append(Finding.ok("foreign_key_actions", "no captured table is changed by one"))
    return server, out


def _conf(name: str, value: str, dynamic: bool = True) -> str:
    """The fix for a server variable: the SQL, and the config file line that keeps it."""
    line = f"my.cnf [mysqld]: {name} = {value}"
    if not dynamic:
        return f"{line}, then restart the server"
    quoted = value if value.isdigit() or value in ("ON", "OFF") else f"'{value}'"
    fix = f"SET GLOBAL {name} = {quoted}; and {line} (no restart"
    if name in ("binlog_format", "binlog_row_image", "binlog_row_metadata"):
        fix += "; sessions already open keep the old value until they reconnect"
    return fix + ")"


def _binlog_settings(values: dict[str, str], mariadb: bool) -> list[Finding]:
    out: list[Finding] = []
    if values.get("log_bin", "").upper() in ("ON", "1"):
        out.append(Finding.ok("log_bin", "binary logging is on"))
    else:
        out.append(
            Finding.fail(
                "log_bin",
                "binary logging is off (log_bin = OFF)",
                _conf("log_bin", "mysql-bin", False),
            )
        )
    for name in ("binlog_format", "binlog_row_image", "binlog_row_metadata"):
        wanted = "ROW" if name == "binlog_format" else "FULL"
        have = values.get(name)
        if have is None:
            out.append(
                Finding.fail(
                    name,
                    f"the server has no {name}: the fetcher decodes rows by it",
                    "upgrade to MariaDB 10.5+ or MySQL 8.0+"
                    if mariadb or name == "binlog_row_metadata"
                    else "upgrade the server",
                )
            )
        elif have.upper() == wanted:
            out.append(Finding.ok(name, f"{name} = {have}"))
        else:
            out.append(
                Finding.fail(
                    name,
                    f"{name} = {have}, not {wanted}: the fetcher cannot decode the rows",
                    _conf(name, wanted),
                )
            )
    if values.get("log_bin_compress", "").upper() in ("ON", "1"):
        out.append(
            Finding.fail(
                "log_bin_compress",
                "log_bin_compress = ON: compressed binlog events cannot be read (their rows "
                "would be lost)",
                _conf("log_bin_compress", "OFF"),
            )
        )
    if values.get("binlog_row_value_options", "").upper() not in ("", "NONE"):
        out.append(
            Finding.fail(
                "binlog_row_value_options",
                "binlog_row_value_options = PARTIAL_JSON: partial JSON updates cannot be decoded",
                "SET GLOBAL binlog_row_value_options = '' (and in the server's config file)",
            )
        )
    server_id = values.get("server_id", "0")
    if server_id in ("", "0"):
        out.append(
            Finding.fail(
                "server_id",
                "server_id = 0: the server refuses binlog readers",
                _conf("server_id", "1", mariadb),
            )
        )
    else:
        out.append(Finding.ok("server_id", f"server_id = {server_id}"))
    return out


def _gtid(cur: Any, values: dict[str, str], mariadb: bool) -> Finding:
    """GTIDs: how a failover finds the relay's last transaction on another server."""
    if not mariadb:
        mode = values.get("gtid_mode", "OFF").upper()
        if mode == "ON":
            return Finding.ok("gtid", "gtid_mode = ON")
        return Finding.warn(
            "gtid",
            f"gtid_mode = {mode}: after a failover the fetcher cannot find its place on "
            "another server",
            "my.cnf [mysqld]: gtid_mode = ON and enforce_gtid_consistency = ON (online: step "
            "gtid_mode through OFF_PERMISSIVE, ON_PERMISSIVE, ON with SET GLOBAL)",
        )
    cur.execute("SELECT @@gtid_binlog_pos")
    row = cur.fetchone()
    pos = str(row[0] or "") if row else ""
    found = f"gtid_binlog_pos = {pos or '(empty)'}"
    if values.get("gtid_strict_mode", "OFF").upper() not in ("ON", "1"):
        return Finding.warn(
            "gtid",
            f"{found}, gtid_strict_mode = OFF: a failover to a server with diverged "
            "history may go unnoticed",
            _conf("gtid_strict_mode", "ON"),
        )
    return Finding.ok("gtid", f"{found}, gtid_strict_mode = ON")


def _grants(cur: Any, cfg: MySQLConfig, grantee: str, mariadb: bool) -> list[Finding]:
    """Global and per-database privileges of the current account (from SHOW GRANTS)."""
    cur.execute("SHOW GRANTS")
    global_privs: set[str] = set()
    db_select: set[str] = set()
    for (line,) in cur.fetchall():
        m = _GRANT.match(str(line))
        if m is None:
            continue
        privs = {p.strip().upper() for p in m.group(1).split(",")}
        if "ALL PRIVILEGES" in privs or "ALL" in privs:
            privs |= {"SELECT", "REPLICATION SLAVE", "REPLICATION CLIENT", "BINLOG MONITOR"}
        on = m.group(2).replace("`", "")
        if on == "*.*":
            global_privs |= privs
        elif on.endswith(".*") and "SELECT" in privs:
            db_select.add(on[:-2].replace("\\_", "_").lower())
    monitor = "BINLOG MONITOR" if mariadb else "REPLICATION CLIENT"
    wanted = ("REPLICATION SLAVE", monitor)
    lacking = [
        p
        for p in wanted
        if p not in global_privs
        and not (p == monitor and {"REPLICATION CLIENT", "BINLOG MONITOR"} & global_privs)
    ]
    if monitor in lacking and _can_list_binlogs(cur):
        lacking.remove(monitor)  # granted through a role: SHOW GRANTS lists only its name
    out: list[Finding] = []
    if lacking:
        out.append(
            Finding.fail(
                "grants",
                f"{grantee} lacks {', '.join(lacking)}: it cannot read the binlog "
                "(REPLICATION SLAVE) or list it (SHOW BINARY LOGS, SHOW MASTER STATUS)",
                f"GRANT {', '.join(lacking)} ON *.* TO {grantee};",
            )
        )
    else:
        out.append(Finding.ok("grants", f"{grantee} has {', '.join(wanted)}"))
    if "SELECT" in global_privs:
        out.append(Finding.ok("select", f"{grantee} has SELECT on *.*"))
        return out
    missing = [d for d in cfg.databases if d.lower() not in db_select]
    if cfg.databases and not missing:
        out.append(Finding.ok("select", f"{grantee} has SELECT on {', '.join(cfg.databases)}"))
        return out
    fix = (
        " ".join(f"GRANT SELECT ON `{d}`.* TO {grantee};" for d in missing)
        if missing
        else f"GRANT SELECT ON *.* TO {grantee};"
    )
    out.append(
        Finding.fail(
            "select",
            f"{grantee} lacks SELECT on {', '.join(missing) or '*.*'}: the fetcher reads column "
            "types from information_schema (it shows only readable tables) and seeding reads rows",
            fix,
        )
    )
    return out


def _can_list_binlogs(cur: Any) -> bool:
    """Whether ``SHOW MASTER STATUS`` is allowed (what BINLOG MONITOR grants)."""
    import pymysql

    try:
        cur.execute("SHOW MASTER STATUS")
        cur.fetchall()
    except pymysql.err.OperationalError as exc:
        if exc.args and exc.args[0] in (1227, 1044, 1045):  # access denied
            return False
        raise
    return True


def _retention(values: dict[str, str], mariadb: bool) -> Finding:
    seconds = int(float(values.get("binlog_expire_logs_seconds", "0") or 0))
    if not seconds:
        seconds = int(float(values.get("expire_logs_days", "0") or 0) * 86_400)
    has_seconds = "binlog_expire_logs_seconds" in values
    fix = (
        _conf("binlog_expire_logs_seconds", str(_WEEK_S))
        if has_seconds
        else _conf("expire_logs_days", "7")
    )
    if seconds == 0:
        return Finding.warn(
            "binlog_retention",
            "binlogs never expire: the disk fills unless something purges them",
            fix,
        )
    found = f"binlogs kept {seconds / 86_400:.1f} days"
    if seconds < _SHORT_RETENTION_S:
        return Finding.warn(
            "binlog_retention",
            f"{found}: a relay stopped for longer loses changes (a data-loss event)",
            fix,
        )
    return Finding.ok("binlog_retention", found)


def _keys(cur: Any, cfg: MySQLConfig, tables: tuple[str, ...]) -> Finding:
    cur.execute(
        # STATISTICS, not TABLE_CONSTRAINTS: MariaDB shows a user with only SELECT no
        # constraints, but it does show the indexes
        "SELECT t.TABLE_SCHEMA, t.TABLE_NAME, EXISTS (SELECT 1 FROM "
        "information_schema.STATISTICS s WHERE s.TABLE_SCHEMA = t.TABLE_SCHEMA AND "
        "s.TABLE_NAME = t.TABLE_NAME AND s.INDEX_NAME = 'PRIMARY') "
        "FROM information_schema.TABLES t WHERE t.TABLE_TYPE = 'BASE TABLE' "
        "ORDER BY 1, 2"
    )
    wanted_tables = {t.lower() for t in tables}
    wanted_dbs = {d.lower() for d in cfg.databases}
    scope: list[tuple[str, bool]] = []
    for db, table, has_pk in cur.fetchall():
        name = f"{db}.{table}"
        if str(db).lower() in SYSTEM_DATABASES:
            continue
        if wanted_tables and name.lower() not in wanted_tables:
            continue
        if wanted_dbs and str(db).lower() not in wanted_dbs:
            continue
        scope.append((name, bool(has_pk)))
    found_names = {n.lower() for n, _ in scope}
    absent = sorted(t for t in tables if t.lower() not in found_names)
    if absent:
        return Finding.fail(
            "keys",
            f"tables not found (or not readable): {', '.join(absent)}",
            "check the names (database.table) and the SELECT grant",
        )
    keyless = [n for n, pk in scope if not pk]
    if keyless:
        return Finding.fail(
            "keys",
            f"{len(keyless)} table(s) without a primary key: {', '.join(keyless)}; their "
            "changes cannot be keyed",
            " ".join(
                f"ALTER TABLE `{n.replace('.', '`.`', 1)}` ADD PRIMARY KEY (...);" for n in keyless
            ),
        )
    return Finding.ok("keys", f"{len(scope)} table(s) in scope, each with a primary key")
