"""Source workloads of the chaos harness: writers that keep checkable invariants.

:class:`SourceWorkload` writes to one source database -- PostgreSQL
(psycopg 3) or MariaDB (PyMySQL) -- from ``writers`` threads at a total of
``rate_tps`` transactions per second, into four tables (:data:`TABLES`):

* ``accounts (id, balance)`` -- bank transfers between two accounts: the sum of
  the balances is ``accounts * initial_balance`` in every committed state, so a
  replica that applies windows atomically shows that sum in every state too
  (Postgres: ``REPLICA IDENTITY FULL``, so updates carry before-images);
* ``ledger (writer, seq, amount, kind)`` -- append-only. **Every** transaction
  of the workload inserts its ledger row ``(writer, seq)`` first, ``seq``
  counting 1, 2, 3 ... per writer, so the ledger is the list of committed
  transactions: no gap and no duplicate, at the source and in every replica;
* ``kv (k, v, n, b[, extra])`` -- upserts and deletes of random keys (text,
  integers, bytes); ``ALTER TABLE kv ADD COLUMN extra`` runs once, mid-run
  (``ddl_after_s``): older rows keep NULL there, later upserts fill it;
* ``docs (id, small, note, big)`` -- ``big`` is ~``big_bytes`` of
  incompressible text (Postgres: ``STORAGE EXTERNAL``, so it is TOASTed and
  pgoutput does not resend it when an UPDATE leaves it unchanged). Most updates
  touch ``small``/``note`` only; some replace ``big``; new documents are
  inserted, and some of them moved to another key (``big`` unchanged: the
  replica must keep the value it never got again) or deleted again.

Surviving the database restarting under it: any error closes the writer's
connection; the writer reconnects with capped exponential backoff and retries
the same transaction (same ``seq``, same values). A failure of ``COMMIT``
itself leaves the outcome unknown: the writer then looks its ledger row up
by ``(writer, seq)`` on a new connection -- present means committed (counted,
``seq`` advances), absent means rolled back (retried). Because the ledger row
is the first statement of the transaction, a retry racing a commit still in
flight waits on that row's lock and fails with a duplicate key, which also
means "committed". So the source's ledger never has a gap or a duplicate.

Deadlocks and lock timeouts (transactions rolled back by the server) are
retried on the same connection. Errors are counted in :attr:`errors` by kind
(never with values: connection strings stay out of them).

Thread-safety: the public counters are updated under a lock by the writer
threads; read them from any thread (copies). ``start``/``stop`` are called
from one controlling thread. The connections live in their writer thread.
"""

from __future__ import annotations

import base64
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from _chaos_schema import COLUMNS, DDL, EXCLUDED, KEYS, NEW_DOC_BASE, TABLES, UPSERT_KV

__all__ = [
    "COLUMNS",
    "KEYS",
    "TABLES",
    "SourceWorkload",
    "WorkloadConfig",
]

log = logging.getLogger("changebus.bench.chaos.workload")


@dataclass(frozen=True)
class WorkloadConfig:
    """Sizes and pace of a :class:`SourceWorkload` (module docstring)."""

    accounts: int = 50
    initial_balance: int = 1000
    kv_keys: int = 300
    docs: int = 20
    #: docs.big: incompressible text -> TOASTed (Postgres, STORAGE EXTERNAL)
    big_bytes: int = 20_000
    #: writer threads per database
    writers: int = 2
    #: transactions/s per database, all writers together
    rate_tps: float = 40.0
    #: ``ALTER TABLE kv ADD COLUMN extra`` once, this long after start (< 0: never)
    ddl_after_s: float = 20.0
    #: reconnect backoff: first pause and cap (seconds)
    backoff_s: float = 0.05
    backoff_max_s: float = 1.0
    #: after stop(), how long a writer still tries to reach the database to settle its
    #: last transaction (then it gives up: the ledger has no gap either way)
    stop_grace_s: float = 20.0

    def __post_init__(self) -> None:
        if self.accounts < 2 or self.writers < 1 or self.rate_tps <= 0:
            raise ValueError("a workload needs >= 2 accounts, >= 1 writer and a positive rate")
        if self.kv_keys < 1 or self.docs < 1 or self.big_bytes < 1:
            raise ValueError("kv_keys, docs and big_bytes must be positive")

    @property
    def total_balance(self) -> int:
        """The sum of the balances, in every consistent state."""
        return self.accounts * self.initial_balance


class _Committed(Exception):
    """The transaction's ledger row exists already: it committed before."""


class _Unknown(Exception):
    """COMMIT failed: the outcome must be looked up."""


@dataclass
class _Txn:
    """One transaction to run (kept for retries: the same values every attempt)."""

    kind: str
    amount: int
    statements: list[tuple[str, tuple[Any, ...]]]
    new_doc: int | None = None
    deleted_doc: int | None = None


class SourceWorkload:
    """Writes to one source database (kind ``"pg"`` | ``"mysql"``) from writer threads.

    ``connect()`` returns a new DB-API connection to the source database
    (psycopg for ``pg``, PyMySQL for ``mysql``, e.g.
    ``lambda: server.connect("chaos")``); the database must exist. Survives
    the database restarting under it (see the module docstring), so the
    SOURCE itself never has a ledger gap.

    Public state (read from any thread; :meth:`stats` copies it at once):
    ``transactions`` (committed), ``errors`` (by kind), ``last_seq`` (writer
    -> last committed seq: the ledger's high-water mark), ``ddl_done``.

    Give ``connect`` timeouts so that a writer never hangs on a dead server:
    ``psycopg.connect(dsn, connect_timeout=5)``; PyMySQL has
    ``connect_timeout`` (set by ``EmbeddedMariaDB.connect``) and takes
    ``read_timeout``/``write_timeout``.
    """

    TABLES: tuple[str, ...] = TABLES

    def __init__(
        self, kind: str, connect: Callable[[], Any], config: WorkloadConfig, seed: int
    ) -> None:
        if kind not in DDL:
            raise ValueError(f"workload kind must be 'pg' or 'mysql', not {kind!r}")
        self.kind = kind
        self.connect = connect
        self.config = config
        self.seed = seed
        self.transactions = 0
        self.errors: dict[str, int] = {}
        self.last_seq: dict[int, int] = {}
        self.ddl_done = threading.Event()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._started = 0.0
        self._give_up_at = 0.0

    # ---- setup -------------------------------------------------------------

    def create_tables(self) -> None:
        """Create the tables and their initial rows (one transaction); idempotent."""
        cfg = self.config
        conn = self._open()
        try:
            cur = conn.cursor()
            for sql in DDL[self.kind]:
                cur.execute(sql)
            cur.execute("SELECT count(*) FROM accounts")
            row = cur.fetchone()
            if row is not None and int(row[0]) > 0:
                self._check_ddl(cur)
                return
            rng = random.Random(self.seed)
            cur.execute("BEGIN")
            cur.executemany(
                "INSERT INTO accounts (id, balance) VALUES (%s, %s)",
                [(i, cfg.initial_balance) for i in range(1, cfg.accounts + 1)],
            )
            cur.executemany(
                "INSERT INTO kv (k, v, n, b) VALUES (%s, %s, %s, %s)",
                [(k, f"v{k}", k, rng.randbytes(1 + k % 32)) for k in range(1, cfg.kv_keys + 1)],
            )
            for i in range(1, cfg.docs + 1):
                cur.execute(
                    "INSERT INTO docs (id, small, note, big) VALUES (%s, %s, %s, %s)",
                    (i, 0, f"doc {i}", _big(rng, cfg.big_bytes)),
                )
            cur.execute("COMMIT")
        finally:
            _close(conn)

    def _check_ddl(self, cur: Any) -> None:
        if self._has_extra(cur):
            self.ddl_done.set()

    def _has_extra(self, cur: Any) -> bool:
        schema = "current_schema()" if self.kind == "pg" else "DATABASE()"
        cur.execute(
            "SELECT count(*) FROM information_schema.columns"
            f" WHERE table_schema = {schema} AND table_name = 'kv' AND column_name = 'extra'"
        )
        row = cur.fetchone()
        return row is not None and int(row[0]) > 0

    # ---- threads -------------------------------------------------------------

    def start(self) -> None:
        """Start the writer threads (after :meth:`create_tables`)."""
        if self._threads:
            raise RuntimeError("workload already started")
        self._stop.clear()
        self._started = time.monotonic()
        for writer in range(1, self.config.writers + 1):
            t = threading.Thread(
                target=self._run,
                args=(writer,),
                name=f"chaos-{self.kind}-writer-{writer}",
                daemon=True,
            )
            self._threads.append(t)
            t.start()

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop the writers after their current transaction (resolved); wait for them."""
        self._give_up_at = time.monotonic() + self.config.stop_grace_s
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                log.warning("writer %s did not stop within %.0f s", t.name, timeout_s)
        self._threads = []

    @property
    def running(self) -> bool:
        """Whether writer threads are alive."""
        return any(t.is_alive() for t in self._threads)

    def high_water(self) -> dict[int, int]:
        """A copy of :attr:`last_seq` (writer -> last committed seq)."""
        with self._lock:
            return dict(self.last_seq)

    def stats(self) -> dict[str, Any]:
        """A consistent copy: ``transactions``, ``errors`` (by kind), ``high_water``, ``ddl_done``."""
        with self._lock:
            return {
                "transactions": self.transactions,
                "errors": dict(self.errors),
                "high_water": dict(self.last_seq),
                "ddl_done": self.ddl_done.is_set(),
            }

    def _count(self, kind: str) -> None:
        with self._lock:
            self.errors[kind] = self.errors.get(kind, 0) + 1

    # ---- one writer ------------------------------------------------------------

    def _run(self, writer: int) -> None:
        cfg = self.config
        rng = random.Random(self.seed * 1_000_003 + writer)
        state = _Writer(writer)
        interval = cfg.writers / cfg.rate_tps
        try:
            state.seq = self._resume_seq(state)
            if state.seq is None:
                return
            with self._lock:
                self.last_seq[writer] = state.seq
            next_at = time.monotonic()
            while not self._stop.is_set():
                if (
                    writer == 1
                    and cfg.ddl_after_s >= 0
                    and not self.ddl_done.is_set()
                    and time.monotonic() - self._started >= cfg.ddl_after_s
                ):
                    self._ddl(state)
                    continue
                txn = self._make(rng, state)
                if not self._commit(state, txn):
                    return  # stopped while the database was unreachable
                next_at = max(next_at + interval, time.monotonic() - 1.0)
                pause = next_at - time.monotonic()
                if pause > 0 and self._stop.wait(pause):
                    return
        except Exception:
            log.exception("writer %d of %s failed", writer, self.kind)
            self._count("writer_crashed")
        finally:
            if state.conn is not None:
                _close(state.conn)

    def _resume_seq(self, state: _Writer) -> int | None:
        """The writer's last committed seq in the ledger (0: none); None if stopped."""
        while True:
            cur = self._cursor(state)
            if cur is None:
                return None
            try:
                cur.execute("SELECT max(seq) FROM ledger WHERE writer = %s", (state.writer,))
                row = cur.fetchone()
                return int(row[0]) if row is not None and row[0] is not None else 0
            except Exception:  # noqa: BLE001 - any failure: reconnect and ask again
                self._lost(state, "query_failed")

    def _make(self, rng: random.Random, state: _Writer) -> _Txn:
        """The next transaction's statements (without the ledger row)."""
        cfg = self.config
        pick = rng.random()
        if pick < 0.35:
            a, b = rng.sample(range(1, cfg.accounts + 1), 2)
            amount = rng.randint(1, 50)
            first, second = sorted(((a, -amount), (b, amount)))  # lock order: by id
            sql = "UPDATE accounts SET balance = balance + %s WHERE id = %s"
            return _Txn(
                "transfer", amount, [(sql, (first[1], first[0])), (sql, (second[1], second[0]))]
            )
        if pick < 0.45:
            return _Txn("append", rng.randint(1, 1000), [])
        if pick < 0.75:
            k = rng.randint(1, cfg.kv_keys)
            if rng.random() < 0.3:
                return _Txn("kv_delete", 0, [("DELETE FROM kv WHERE k = %s", (k,))])
            values: dict[str, Any] = {
                "k": k,
                "v": f"w{state.writer}-{rng.randrange(1 << 30):x}",
                "n": rng.randint(-(1 << 40), 1 << 40),
                "b": rng.randbytes(rng.randint(0, 200)),
            }
            if self.ddl_done.is_set():
                values["extra"] = f"x{rng.randrange(1 << 20)}"
            cols = list(values)
            sql = UPSERT_KV[self.kind].format(
                cols=", ".join(cols),
                marks=", ".join("%s" for _ in cols),
                sets=", ".join(EXCLUDED[self.kind].format(c=c) for c in cols if c != "k"),
            )
            return _Txn("kv_upsert", 0, [(sql, tuple(values.values()))])
        doc = rng.randint(1, cfg.docs)
        pick = rng.random()
        if pick < 0.7:
            return _Txn(
                "doc_small",
                0,
                [
                    (
                        "UPDATE docs SET small = small + 1, note = %s WHERE id = %s",
                        (f"note {rng.randrange(1 << 20)}", doc),
                    )
                ],
            )
        if pick < 0.85:
            return _Txn(
                "doc_big",
                0,
                [("UPDATE docs SET big = %s WHERE id = %s", (_big(rng, cfg.big_bytes), doc))],
            )
        if pick < 0.95 or not state.docs:
            new = NEW_DOC_BASE * state.writer + (state.seq or 0) + 1
            return _Txn(
                "doc_insert",
                0,
                [
                    (
                        "INSERT INTO docs (id, small, note, big) VALUES (%s, %s, %s, %s)",
                        (new, 0, "new", _big(rng, cfg.big_bytes)),
                    )
                ],
                new_doc=new,
            )
        old = state.docs[rng.randrange(len(state.docs))]
        if rng.random() < 0.5:  # a key change: big stays (TOASTed, not resent by pgoutput)
            new = NEW_DOC_BASE * state.writer + (state.seq or 0) + 1
            return _Txn(
                "doc_move",
                0,
                [("UPDATE docs SET id = %s, small = small + 1 WHERE id = %s", (new, old))],
                new_doc=new,
                deleted_doc=old,
            )
        return _Txn("doc_delete", 0, [("DELETE FROM docs WHERE id = %s", (old,))], deleted_doc=old)

    def _commit(self, state: _Writer, txn: _Txn) -> bool:
        """Run ``txn`` with the next ledger row until it is known committed (False: stopped)."""
        assert state.seq is not None
        seq = state.seq + 1
        ledger = (
            "INSERT INTO ledger (writer, seq, amount, kind) VALUES (%s, %s, %s, %s)",
            (state.writer, seq, txn.amount, txn.kind),
        )
        statements = [ledger, *txn.statements]
        while True:
            cur = self._cursor(state)
            if cur is None:
                return False
            try:
                self._attempt(cur, statements)
            except _Committed:
                self._count("duplicate_resolved")
                self._rollback(state)
                break
            except _Unknown:
                self._lost(state, "commit_unknown")
                found = self._lookup(state, seq)
                if found is None:
                    return False
                self._count("unknown_committed" if found else "unknown_rolled_back")
                if found:
                    break
                continue
            except Exception as exc:  # noqa: BLE001 - classified below
                if self._rolled_back_by_server(exc):
                    self._count("deadlock_retried")
                    self._rollback(state)
                    continue
                self._lost(state, "statement_failed")
                time.sleep(self.config.backoff_s)
                continue
            break
        state.seq = seq
        if txn.new_doc is not None:
            state.docs.append(txn.new_doc)
        if txn.deleted_doc is not None and txn.deleted_doc in state.docs:
            state.docs.remove(txn.deleted_doc)
        with self._lock:
            self.transactions += 1
            self.last_seq[state.writer] = seq
        return True

    def _attempt(self, cur: Any, statements: Sequence[tuple[str, tuple[Any, ...]]]) -> None:
        cur.execute("BEGIN")
        try:
            sql, params = statements[0]
            cur.execute(sql, params)
        except Exception as exc:
            if self._duplicate(exc):
                raise _Committed from exc
            raise
        for sql, params in statements[1:]:
            cur.execute(sql, params)
        try:
            cur.execute("COMMIT")
        except Exception as exc:
            if self._rolled_back_by_server(exc):
                raise
            raise _Unknown from exc

    def _lookup(self, state: _Writer, seq: int) -> bool | None:
        """Whether ledger row ``(writer, seq)`` exists (None: stopped before knowing)."""
        while True:
            cur = self._cursor(state)
            if cur is None:
                return None
            try:
                cur.execute(
                    "SELECT count(*) FROM ledger WHERE writer = %s AND seq = %s",
                    (state.writer, seq),
                )
                row = cur.fetchone()
                return row is not None and int(row[0]) > 0
            except Exception:  # noqa: BLE001 - reconnect and ask again
                self._lost(state, "query_failed")

    def _ddl(self, state: _Writer) -> None:
        """``ALTER TABLE kv ADD COLUMN extra`` unless it exists; retried until done."""
        cur = self._cursor(state)
        if cur is None:
            return
        try:
            if not self._has_extra(cur):
                cur.execute(
                    "ALTER TABLE kv ADD COLUMN extra " + ("text" if self.kind == "pg" else "TEXT")
                )
                log.info("%s: kv.extra added", self.kind)
            self.ddl_done.set()
        except Exception:  # noqa: BLE001 - reconnect; the next round checks again
            self._lost(state, "ddl_failed")
            time.sleep(self.config.backoff_s)

    # ---- connections -------------------------------------------------------------

    def _open(self) -> Any:
        conn = self.connect()
        if self.kind == "pg":
            conn.autocommit = True  # transactions are explicit BEGIN ... COMMIT
        else:
            conn.autocommit(True)
            with conn.cursor() as cur:
                cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
        return conn

    def _cursor(self, state: _Writer) -> Any:
        """A cursor on the writer's connection, reconnecting with backoff (None: stopped)."""
        cfg = self.config
        pause = cfg.backoff_s
        while state.conn is None:
            if self._stop.is_set() and time.monotonic() > self._give_up_at:
                return None
            try:
                state.conn = self._open()
            except Exception:  # noqa: BLE001 - the database is down or restarting
                self._count("connect_failed")
                time.sleep(pause)
                pause = min(pause * 2, cfg.backoff_max_s)
        return state.conn.cursor()

    def _lost(self, state: _Writer, kind: str) -> None:
        self._count(kind)
        if state.conn is not None:
            _close(state.conn)
            state.conn = None

    def _rollback(self, state: _Writer) -> None:
        if state.conn is None:
            return
        try:
            state.conn.cursor().execute("ROLLBACK")
        except Exception:  # noqa: BLE001 - a broken connection: start over
            self._lost(state, "rollback_failed")

    def _duplicate(self, exc: BaseException) -> bool:
        if self.kind == "pg":
            import psycopg

            return isinstance(exc, psycopg.errors.UniqueViolation)
        import pymysql

        return isinstance(exc, pymysql.err.IntegrityError) and _code(exc) == 1062

    def _rolled_back_by_server(self, exc: BaseException) -> bool:
        """A deadlock or lock timeout: the server rolled back, the connection is fine."""
        if self.kind == "pg":
            import psycopg

            errors = psycopg.errors
            return isinstance(
                exc,
                errors.TransactionRollback
                | errors.DeadlockDetected
                | errors.SerializationFailure
                | errors.LockNotAvailable,
            )
        import pymysql

        return isinstance(exc, pymysql.err.OperationalError) and _code(exc) in (1205, 1213)


class _Writer:
    """A writer thread's own state (its connection, next seq, documents it inserted)."""

    def __init__(self, writer: int) -> None:
        self.writer = writer
        self.conn: Any = None
        self.seq: int | None = None
        self.docs: list[int] = []


def _code(exc: BaseException) -> int | None:
    args = getattr(exc, "args", ())
    return args[0] if args and isinstance(args[0], int) else None


def _big(rng: random.Random, size: int) -> str:
    """``size`` characters of incompressible (random base64) text."""
    raw = rng.randbytes(size * 3 // 4 + 3)
    return base64.b64encode(raw).decode()[:size]


def _close(conn: Any) -> None:
    try:
        conn.close()
    except Exception:
        log.debug("closing a broken connection failed", exc_info=True)
