"""Set-up of the MySQL fetcher: server checks, the start position, loss and divergence.

Runs at every start (:meth:`MySQLFetcher.start`, in a worker thread) on a
regular connection and returns a :class:`StartPlan`; it also seeds the
declared-type history (:class:`DeclaredTypes`) the stream refines layouts
with.

Checks, each a clear non-retriable :class:`SourceConfigError` naming the
setting: binary logging on, ``binlog_format=ROW``,
``binlog_row_image=FULL``, ``binlog_row_metadata=FULL``.

Where the stream starts: after the relay's last window (its position names
file, offset, server and SCN base), else at the binlog's end
(``start_at = "current"``) or its oldest file (``"earliest"``). Loss
detection: a resume position in a purged binlog file becomes a DATA_LOSS
window (or a failure with ``on_binlog_purged = "fail"``), never a silent
jump. Failover (MariaDB): a last window read from another server is found
by its GTID in this server's binlog (:mod:`._failover`), and the SCN base
moves so that SCNs keep increasing; a GTID this server does not hold (or
cannot place exactly) is divergent history, refused or (with
``on_divergent_server = "data_loss"``) a DATA_LOSS window and the binlog's
end. On the same server, a GTID that is not where the relay saw it means
the binlog was rewritten (``RESET MASTER``): refused too.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from changebus.schemas import (
    SchemaRegistry,
    SourceConfigError,
    SourceError,
    binlog_file_number,
    binlog_to_scn,
    scn_to_binlog,
)

from .._base import ResumePoint
from ._config import SYSTEM_DATABASES, MySQLConfig
from ._connect import open_connection
from ._ddl import DeclaredTypes
from ._failover import gtid_parts, locate_gtid
from ._position import format_position, parse_position, parse_restart

__all__ = ["StartPlan", "reason", "set_up"]

log = logging.getLogger("changebus.fetchers.mysql")

_REQUIRED = (
    ("binlog_format", "ROW"),
    ("binlog_row_image", "FULL"),
    ("binlog_row_metadata", "FULL"),
)

_JSON_VALID = re.compile(r"json_valid\(`((?:[^`]|``)+)`\)", re.I)


@dataclass(frozen=True, slots=True)
class StartPlan:
    """Where and how the stream of a (re)started fetcher begins.

    ``start``: the binlog (file, offset) to read from. ``server``: the
    server's ``@@server_id``. ``base``: the SCN base (SCN = base +
    ``(file_number << 32 | offset)``, see :mod:`._fetcher`). ``checksum``:
    bytes of the events' checksum (0 or 4). ``data_loss``: ``(from_scn,
    to_scn, reason, position, cause)`` of a DATA_LOSS window to emit first (cause:
    ``binlog_purged`` or ``divergent_server``, the relay's metric label), None
    without a gap. ``scn``: the SCN after which the stream is complete.
    """

    start: tuple[str, int]
    server: int
    base: int
    checksum: int
    data_loss: tuple[int, int, str, str, str] | None
    scn: int


def set_up(
    config: MySQLConfig, resume: ResumePoint, declared: DeclaredTypes, partition: str
) -> StartPlan:
    """Check the server, plan the start position, seed ``declared`` (see the module docstring)."""
    import pymysql

    conn = connect(config)
    try:
        with conn.cursor() as cur:
            _check_settings(cur)
            for text in foreign_key_actions(cur, config.databases):
                log.warning("partition %s: %s", partition, text)
            _register_collations(cur)
            cur.execute("SELECT @@binlog_checksum, @@server_id")
            row = cur.fetchone()
            checksum = 0 if row is None or str(row[0]).upper() == "NONE" else 4
            server = 0 if row is None else int(row[1])
            try:
                cur.execute("SHOW BINARY LOGS")
                logs = [str(r[0]) for r in cur.fetchall()]
                cur.execute("SHOW MASTER STATUS")
                status = cur.fetchone()
            except pymysql.err.OperationalError as exc:
                raise SourceConfigError(
                    f"the MySQL user lacks a privilege: {reason(exc)} (grant REPLICATION "
                    "SLAVE, BINLOG MONITOR (REPLICATION CLIENT on MySQL) and SELECT)"
                ) from None
            if status is None or not logs:
                raise SourceConfigError("binary logging is off: start the server with log_bin")
            current = (str(status[0]), int(status[1]))
            planner = _Planner(config, resume, partition, server)
            start_scn = planner.plan_start(cur, logs, current)
            planner.verify_start(cur)
            planner.rewind_to_prepared(logs)
            # information_schema is read now: valid at the binlog's end as it is now (read
            # again: DDL since the first look would be in it and applied a second time)
            cur.execute("SHOW MASTER STATUS")
            now = cur.fetchone() or status
            now_scn = planner.base + binlog_to_scn(binlog_file_number(str(now[0])), int(now[1]))
            _seed_declared(cur, config, resume, declared, now_scn)
    except pymysql.err.OperationalError as exc:
        raise SourceError(f"lost the MySQL connection: {reason(exc)}") from None
    finally:
        conn.close()
    return StartPlan(planner.start, server, planner.base, checksum, planner.data_loss, start_scn)


def _register_collations(cur: Any) -> None:
    """Teach mysql-replication the server's collation ids it does not know.

    It takes an unknown id (MariaDB 10.10's ``uca1400`` collations, a newer
    server's) for UTF-8: the bytes of a utf16 column went out as UTF-8 text no
    consumer could decode (review). The ids and their character sets come from
    the server; its registry is process-wide and only grows (an id names one
    collation on every server of a kind).
    """
    import pymysql
    from pymysqlreplication.constants import CHARSET

    cur.execute("SELECT VERSION()")
    row = cur.fetchone()
    dbms = "mariadb" if row is not None and "mariadb" in str(row[0]).lower() else "mysql"
    found: list[tuple[Any, ...]] = []
    try:  # (MariaDB 10.10+: the collations of every character set, with their ids)
        cur.execute(
            "SELECT ID, CHARACTER_SET_NAME, FULL_COLLATION_NAME FROM "
            "information_schema.COLLATION_CHARACTER_SET_APPLICABILITY WHERE ID IS NOT NULL"
        )
        found.extend(cur.fetchall())
    except (pymysql.err.OperationalError, pymysql.err.ProgrammingError):
        pass  # (MySQL, an older MariaDB: COLLATIONS has them all)
    cur.execute(
        "SELECT ID, CHARACTER_SET_NAME, COLLATION_NAME FROM information_schema.COLLATIONS "
        "WHERE ID IS NOT NULL"
    )
    found.extend(cur.fetchall())
    for ident, charset, collation in found:
        if CHARSET.charset_by_id(int(ident), dbms) is None:
            CHARSET.charsets.add(
                CHARSET.Charset(int(ident), str(charset), str(collation), False, dbms)
            )


def connect(cfg: MySQLConfig, **extra: Any) -> Any:
    """A PyMySQL connection (:func:`._connect.open_connection`: TLS as configured);
    a refused login or TLS failure is a :class:`SourceConfigError`.

    Its reads and writes time out like the binlog stream's
    (:attr:`MySQLConfig.read_timeout_s`): a frozen server or a half-open path
    fails the set-up retriably instead of hanging it.
    """
    import pymysql

    timeout = cfg.read_timeout_s
    try:
        return open_connection(
            cfg,
            connect_timeout=cfg.connect_timeout_s,
            read_timeout=timeout,
            write_timeout=timeout,
            autocommit=True,
            charset="utf8mb4",
            **extra,
        )
    except pymysql.err.OperationalError as exc:
        code = exc.args[0] if exc.args else 0
        if code in (1044, 1045, 1049):  # access denied, unknown database
            raise SourceConfigError(f"cannot log in to MySQL: {reason(exc)}") from None
        raise SourceError(f"cannot connect to MySQL: {reason(exc)}") from None


def foreign_key_actions(cur: Any, databases: tuple[str, ...]) -> list[str]:
    """What to say of the captured tables that are children of a foreign key with an
    ON DELETE / ON UPDATE action (CASCADE, SET NULL, SET DEFAULT): InnoDB carries the
    action out below the SQL layer, and the row-based binlog holds only the
    statement's own rows, so the child rows it deletes or changes reach no binlog
    reader (review). One text per foreign key, at most 20."""
    wanted = sorted({d.lower() for d in databases})
    scope = (
        f" AND LOWER(CONSTRAINT_SCHEMA) IN ({', '.join(['%s'] * len(wanted))})" if wanted else ""
    )
    try:
        cur.execute(
            "SELECT CONSTRAINT_SCHEMA, TABLE_NAME, REFERENCED_TABLE_NAME, DELETE_RULE, "
            "UPDATE_RULE FROM information_schema.REFERENTIAL_CONSTRAINTS WHERE (DELETE_RULE "
            "NOT IN ('RESTRICT', 'NO ACTION') OR UPDATE_RULE NOT IN ('RESTRICT', 'NO ACTION'))"
            f"{scope} ORDER BY 1, 2",
            wanted,
        )
        rows = cur.fetchall()
    except Exception as exc:  # noqa: BLE001 - a warning's query: never the start's failure
        log.debug("foreign-key actions not read: %s", reason(exc))
        return []
    out = []
    for db, table, parent, on_delete, on_update in rows:
        if str(db).lower() in SYSTEM_DATABASES:
            continue
        actions = [
            f"ON {what} {rule}"
            for what, rule in (("DELETE", on_delete), ("UPDATE", on_update))
            if str(rule).upper() not in ("RESTRICT", "NO ACTION")
        ]
        out.append(
            f"{db}.{table} is the child of a foreign key to {db}.{parent} with "
            f"{' and '.join(actions)}: the rows these actions change are not in the "
            "binlog, so consumers and the bootstrap snapshot keep them (delete or update "
            "the children in the same transaction instead, or re-snapshot the table)"
        )
    return out[:20]


def _check_settings(cur: Any) -> None:
    cur.execute(
        "SHOW GLOBAL VARIABLES WHERE Variable_name IN "
        "('log_bin', 'binlog_format', 'binlog_row_image', 'binlog_row_metadata', "
        "'log_bin_compress', 'binlog_row_value_options')"
    )
    values = {str(k).lower(): str(v).upper() for k, v in cur.fetchall()}
    if values.get("log_bin") not in ("ON", "1"):
        raise SourceConfigError(
            "binary logging is off (log_bin = OFF): start the server with --log-bin"
        )
    if values.get("log_bin_compress") in ("ON", "1"):
        # (the replication library has no reader for compressed events: their rows
        # would be skipped without a word)
        raise SourceConfigError(
            "MariaDB log_bin_compress is ON: the fetcher cannot read compressed binlog "
            "events; SET GLOBAL log_bin_compress = OFF (and in the server's config file)"
        )
    if values.get("binlog_row_value_options", "") not in ("", "NONE"):
        raise SourceConfigError(
            "MySQL binlog_row_value_options is set (PARTIAL_JSON): partial JSON updates "
            "cannot be decoded; SET GLOBAL binlog_row_value_options = ''"
        )
    for name, wanted in _REQUIRED:
        have = values.get(name)
        if have != wanted:
            raise SourceConfigError(
                f"MySQL setting {name} is {have or 'unsupported'!s}, not {wanted}: set "
                f"{name} = {wanted} (SET GLOBAL {name} = '{wanted}' and in the server's "
                "config file); the fetcher cannot decode rows otherwise"
            )


class _Planner:
    """Plans the start position (one per set-up; see the module docstring).

    Starts as the relay left off (``base`` from its last position, no
    DATA_LOSS window); :meth:`plan_start` sets ``start`` and may move
    ``base`` or plan a ``data_loss`` window.
    """

    def __init__(
        self, config: MySQLConfig, resume: ResumePoint, partition: str, server: int
    ) -> None:
        self.config = config
        self.resume = resume
        self.name = partition
        self.server = server
        self.start: tuple[str, int] = ("", 0)
        self.base = 0
        self.data_loss: tuple[int, int, str, str, str] | None = None

    def plan_start(self, cur: Any, logs: list[str], current: tuple[str, int]) -> int:
        """Where the stream starts; plans a DATA_LOSS window for a purged resume file."""
        resume = self.resume
        self.data_loss = None
        self.base = 0
        pos = parse_position(resume.source_position) if resume.scn >= 0 else {}
        if pos:
            self.base = int(pos.get("base", "0"))
            if self._other_server(pos):
                return self._fail_over(cur, logs, current, pos)
        if resume.scn >= 0 and not pos:
            # no window yet (the relay recorded only where the stream started):
            # the SCN itself is the binlog position
            number, offset = scn_to_binlog(resume.scn)
            base = logs[-1].rsplit(".", 1)[0]
            names = {binlog_file_number(f): f for f in logs}
            pos = {"file": names.get(number, f"{base}.{number:06d}"), "pos": str(offset)}
        if pos:
            file, offset = pos["file"], int(pos["pos"])
            if file in logs:
                self.start = (file, offset)
                return resume.scn
            oldest = logs[0]
            new_scn = self.base + binlog_to_scn(binlog_file_number(oldest), 4)
            why = (
                f"binlog file {file} was purged (the oldest kept is {oldest}): changes "
                f"committed after SCN {resume.scn} and before {oldest} are missing"
            )
            if new_scn <= resume.scn:
                raise SourceConfigError(
                    f"binlog file {file} is not on this server and its binlogs are older than "
                    "the relay's last window (another server? see docs/mysql.md, failover)"
                )
            if self.config.on_binlog_purged == "fail":
                raise SourceConfigError(
                    f"{why}; set on_binlog_purged = 'data_loss' to go on after a data-loss event"
                )
            log.error("partition %s: %s", self.name, why)
            where = format_position("", oldest, 4, self.server, self.base).partition(";")[2]
            self.data_loss = (resume.scn + 1, new_scn, why, where, "binlog_purged")
            self.start = (oldest, 4)
            return resume.scn
        if self.config.start_at == "earliest":
            self.start = (logs[0], 4)
        else:
            self.start = current
        return binlog_to_scn(binlog_file_number(self.start[0]), self.start[1])

    def _other_server(self, pos: Mapping[str, str]) -> bool:
        """Whether the relay's last window was read from another server than this one.

        Positions name their server (``server=ID``); older ones do not, and
        then the GTID's originating server stands in for it (a relay reading a
        primary sees its own GTIDs; an old position with a MySQL GTID,
        ``uuid:N``, is taken as this server's).
        """
        if "server" in pos:
            return int(pos["server"]) != self.server
        parts = gtid_parts(pos.get("gtid", ""))
        return parts is not None and parts[1] != self.server

    def _fail_over(
        self, cur: Any, logs: list[str], current: tuple[str, int], pos: Mapping[str, str]
    ) -> int:
        """Resume after the relay's last window on another server, found by its GTID."""
        import pymysql

        resume = self.resume
        gtid = pos.get("gtid", "")
        origin = pos.get("server") or "unknown"
        where = f"{pos['file']}:{pos['pos']} of server id {origin}"
        prepared = parse_restart(pos.get("xa", ""))
        if prepared is not None:
            return self._diverged(
                current,
                f"an XA transaction prepared before the relay's last window (prepared event "
                f"group GTID {prepared[0] or 'unknown'} at {prepared[1]}:{prepared[2]} of "
                f"server id {origin}) was not committed yet; its rows cannot be found by "
                "GTID on another server",
            )
        if not gtid:
            return self._diverged(
                current,
                f"the relay's last window ended at {where}, this is server id {self.server}, "
                "and that window has no GTID to find its place here",
            )
        try:
            found = locate_gtid(cur, logs, gtid)
            cur.execute("SELECT @@gtid_binlog_state")
            row = cur.fetchone()
        except pymysql.err.MySQLError:
            found, row = None, None  # MySQL: no Gtid_list events, no gtid_binlog_state
        if found is None:
            return self._diverged(
                current,
                f"the relay's last transaction (GTID {gtid}, ending at {where}) is not in "
                f"this server's binlog (server id {self.server}): its history diverged from "
                "the old server's, or it purged that part of its binlog",
            )
        parts = gtid_parts(gtid)
        state = "" if row is None or row[0] is None else str(row[0])
        domains = {p[0] for g in state.split(",") if (p := gtid_parts(g)) is not None}
        if parts is not None and domains - {parts[0]}:
            # transactions of other domains may lie on either side of this one here and
            # on the old server: the position after it is not the same cut on both
            return self._diverged(
                current,
                f"this server's binlog holds more than one GTID domain "
                f"({', '.join(str(d) for d in sorted(domains))}): resuming after GTID {gtid} "
                "by position is exact only with one domain",
            )
        file, end = found
        self.start = (file, end)
        self.base = resume.scn - binlog_to_scn(binlog_file_number(file), end)
        log.warning(
            "partition %s: the relay's last window came from server id %s; its transaction "
            "%s ends at %s:%d on this server (id %d): going on from there, SCN base %d",
            self.name,
            origin,
            gtid,
            file,
            end,
            self.server,
            self.base,
        )
        return resume.scn

    def _diverged(self, current: tuple[str, int], why: str) -> int:
        """No exact place on this server: refuse, or a DATA_LOSS window and the binlog's end."""
        if self.config.on_divergent_server == "fail":
            raise SourceConfigError(
                f"{why}. Resuming anywhere would skip or repeat transactions; see "
                "docs/mysql.md, Failover (on_divergent_server = 'data_loss' goes on from this "
                "server's binlog end after a data-loss event)"
            )
        resume = self.resume
        hi = resume.scn + 1
        self.start = current
        self.base = hi - binlog_to_scn(binlog_file_number(current[0]), current[1])
        log.error(
            "partition %s: %s; going on from %s:%d after a data-loss event",
            self.name,
            why,
            *current,
        )
        where = format_position("", current[0], current[1], self.server, self.base)
        self.data_loss = (
            resume.scn + 1,
            hi,
            f"{why}: changes from here on up to the switch to this server may be missing",
            where.partition(";")[2],
            "divergent_server",
        )
        return resume.scn

    def rewind_to_prepared(self, logs: list[str]) -> None:
        """Start at the oldest XA transaction prepared before the relay's last window and
        not committed then (its ``xa`` field, :mod:`._xa`): its rows are only there. The
        windows read again up to the last one are dropped by SCN."""
        pos = parse_position(self.resume.source_position) if self.resume.scn >= 0 else {}
        prepared = parse_restart(pos.get("xa", ""))
        if prepared is None or self.data_loss is not None or self._other_server(pos):
            return
        gtid, file, offset = prepared
        if file not in logs:
            why = (
                f"binlog file {file} was purged, and it holds the rows of an XA transaction "
                f"(GTID {gtid or 'unknown'}, prepared at {file}:{offset}) not committed "
                "before the relay's last window: its changes cannot be delivered"
            )
            if self.config.on_binlog_purged == "fail":
                raise SourceConfigError(
                    f"{why}. Keep binlogs until prepared XA transactions end (XA RECOVER "
                    "lists them); set on_binlog_purged = 'data_loss' to go on (its XA COMMIT "
                    "becomes a data-loss event), or reseed the tables it changed"
                )
            # its XA COMMIT finds no prepared half: a DATA_LOSS window names it then;
            # other prepares still pending may sit in the files kept: read from the
            # oldest (what the relay holds already is dropped by SCN)
            log.error("partition %s: %s; its XA COMMIT will be a data-loss event", self.name, why)
            self.start = (logs[0], 4)
            return
        log.info(
            "partition %s: an XA transaction prepared at %s:%d (GTID %s) is not committed "
            "yet: reading from there",
            self.name,
            file,
            offset,
            gtid,
        )
        self.start = (file, offset)

    def verify_start(self, cur: Any) -> None:
        """Refuse a resume position that this server's binlog does not hold.

        The relay's last window names its GTID and where it ended (file and
        position; after :meth:`_fail_over`, where it ends on this server). On
        the server that wrote the position, ``BINLOG_GTID_POS(file, pos)``
        (MariaDB) is the GTID state right after that window, so it lists the
        window's GTID. Anything else means the binlog was rewritten under the
        same file names (``RESET MASTER``; GTIDs may then be reused by other
        transactions, so they are not searched for): reading on would decode
        garbage or skip or repeat transactions, so the fetcher stops instead.
        MySQL has no such function; there the check is skipped.
        """
        import pymysql

        pos = parse_position(self.resume.source_position) if self.resume.scn >= 0 else {}
        gtid = pos.get("gtid", "")
        if not gtid or self.data_loss is not None or not pos:
            return
        file, offset = self.start
        try:
            cur.execute("SELECT BINLOG_GTID_POS(%s, %s)", (file, offset))
            row = cur.fetchone()
        except pymysql.err.MySQLError:
            return  # MySQL: no BINLOG_GTID_POS
        state = "" if row is None or row[0] is None else str(row[0])
        if gtid not in {g.strip() for g in state.split(",")}:
            raise SourceConfigError(
                f"the relay's last transaction (GTID {gtid}, ending at {file}:{offset}) is not "
                f"in this server's binlog there (GTID state at that point: {state or 'none'}): "
                "its binlog was reset (RESET MASTER) or rewritten. Resuming "
                "by file and offset would skip or repeat transactions; see docs/mysql.md, "
                "Failover, for the way back"
            )


def _seed_declared(
    cur: Any, config: MySQLConfig, resume: ResumePoint, declared: DeclaredTypes, now_scn: int
) -> None:
    """Declared types: information_schema's, the relay's registry for tables gone since.

    information_schema's types are those at ``now_scn`` (the binlog's end as
    it was read), so the DDL the stream reads again up to there must not be
    applied to them a second time (``valid_at``). The registry's newest
    version of a table is that of its last row change, not of the relay's
    last window: DDL after it that the stream does not read again (it
    resumes past it) would be lost, and a column decoded with the binlog's
    raw type (a JSON column as longtext, a UUID as binary(16)) for good.
    """
    import pymysql

    registry = SchemaRegistry()
    registry.import_entries(resume.schemas)
    cur.execute(
        "SELECT TABLE_SCHEMA, TABLE_NAME, COLUMN_NAME, COLUMN_TYPE "
        "FROM information_schema.COLUMNS ORDER BY TABLE_SCHEMA, TABLE_NAME, ORDINAL_POSITION"
    )
    tables: dict[tuple[str, str], dict[str, str]] = {}
    wanted = {d.lower() for d in config.databases}
    for db, table, column, ctype in cur.fetchall():
        if db.lower() in SYSTEM_DATABASES or (wanted and db.lower() not in wanted):
            continue
        tables.setdefault((db, table), {})[column] = str(ctype)
    # MariaDB's JSON is LONGTEXT with a json_valid() check constraint
    try:
        cur.execute(
            "SELECT CONSTRAINT_SCHEMA, TABLE_NAME, CHECK_CLAUSE "
            "FROM information_schema.CHECK_CONSTRAINTS WHERE CHECK_CLAUSE LIKE 'json_valid(%'"
        )
        for db, table, clause in cur.fetchall():
            m = _JSON_VALID.fullmatch(str(clause).strip())
            cols = tables.get((db, table))
            if m and cols is not None and m.group(1) in cols:
                cols[m.group(1)] = "json"
    except pymysql.err.MySQLError:
        pass  # MySQL < 8.0.16 has no CHECK_CONSTRAINTS (and a real JSON type)
    for (db, table), cols in tables.items():
        declared.set(db, table, cols, valid_at=now_scn)
    for _sid, name in registry.sources():
        db, _, table = name.partition(".")
        if (db, table) not in tables:  # (dropped or renamed since: rows read again need it)
            declared.set(db, table, {c.name: c.source_type for c in registry.latest(name).columns})


def reason(exc: BaseException) -> str:
    """An error's message without connection details (never a password)."""
    args: tuple[Any, ...] = tuple(getattr(exc, "args", ()))
    if len(args) >= 2 and isinstance(args[1], str):
        return f"{args[1]} ({args[0]})"
    return str(exc) or exc.__class__.__name__
