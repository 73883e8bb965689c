"""The chaos workload's tables: names, columns, keys, and their SQL per dialect.

The checker (:mod:`_chaos_check`) compares these tables row by row, the
workload (:mod:`_chaos_workload`) creates and writes them; ``pg`` and
``mysql`` are the two dialects (Postgres 15, MariaDB).
"""

from __future__ import annotations

__all__ = ["COLUMNS", "DDL", "EXCLUDED", "KEYS", "NEW_DOC_BASE", "TABLES", "UPSERT_KV"]

#: the workload's tables, in creation order
TABLES: tuple[str, ...] = ("accounts", "ledger", "kv", "docs")
#: every column of each table, in a fixed order (``kv.extra`` exists after the DDL only)
COLUMNS: dict[str, tuple[str, ...]] = {
    "accounts": ("id", "balance"),
    "ledger": ("writer", "seq", "amount", "kind"),
    "kv": ("k", "v", "n", "b", "extra"),
    "docs": ("id", "small", "note", "big"),
}
#: the primary key columns of each table
KEYS: dict[str, tuple[str, ...]] = {
    "accounts": ("id",),
    "ledger": ("writer", "seq"),
    "kv": ("k",),
    "docs": ("id",),
}
#: ids of inserted documents: ``NEW_DOC_BASE * writer + seq`` (never collide with 1..docs)
NEW_DOC_BASE = 100_000_000

DDL = {
    "pg": (
        "CREATE TABLE IF NOT EXISTS accounts (id integer PRIMARY KEY, balance bigint NOT NULL)",
        "CREATE TABLE IF NOT EXISTS ledger (writer integer NOT NULL, seq bigint NOT NULL,"
        " amount bigint NOT NULL, kind text NOT NULL, PRIMARY KEY (writer, seq))",
        "CREATE TABLE IF NOT EXISTS kv (k integer PRIMARY KEY, v text, n bigint, b bytea)",
        "CREATE TABLE IF NOT EXISTS docs (id bigint PRIMARY KEY, small bigint NOT NULL,"
        " note text, big text)",
        "ALTER TABLE docs ALTER COLUMN big SET STORAGE EXTERNAL",
        # before-images on transfers: the tail's lines then tell online windows from snapshots
        "ALTER TABLE accounts REPLICA IDENTITY FULL",
    ),
    "mysql": (
        "CREATE TABLE IF NOT EXISTS accounts (id INT PRIMARY KEY, balance BIGINT NOT NULL)"
        " ENGINE=InnoDB",
        "CREATE TABLE IF NOT EXISTS ledger (writer INT NOT NULL, seq BIGINT NOT NULL,"
        " amount BIGINT NOT NULL, kind VARCHAR(16) NOT NULL, PRIMARY KEY (writer, seq))"
        " ENGINE=InnoDB",
        "CREATE TABLE IF NOT EXISTS kv (k INT PRIMARY KEY, v TEXT, n BIGINT, b VARBINARY(255))"
        " ENGINE=InnoDB",
        "CREATE TABLE IF NOT EXISTS docs (id BIGINT PRIMARY KEY, small BIGINT NOT NULL,"
        " note TEXT, big MEDIUMTEXT) ENGINE=InnoDB",
    ),
}

UPSERT_KV = {
    "pg": "INSERT INTO kv ({cols}) VALUES ({marks}) ON CONFLICT (k) DO UPDATE SET {sets}",
    "mysql": "INSERT INTO kv ({cols}) VALUES ({marks}) ON DUPLICATE KEY UPDATE {sets}",
}
EXCLUDED = {"pg": "{c} = excluded.{c}", "mysql": "{c} = VALUES({c})"}
