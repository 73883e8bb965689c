"""The throwaway Postgres fixture works and decodes logically."""

from __future__ import annotations

import psycopg
import pytest

pytestmark = pytest.mark.pg


def test_server_has_logical_decoding(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        assert conn.execute("SHOW wal_level").fetchone() == ("logical",)
        assert conn.execute("SHOW listen_addresses").fetchone() == ("127.0.0.1",)
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        conn.execute("CREATE PUBLICATION p FOR TABLE t")
        conn.execute("SELECT pg_create_logical_replication_slot('s', 'pgoutput')")
        conn.execute("INSERT INTO t VALUES (1, 'a')")
        rows = conn.execute(
            "SELECT data FROM pg_logical_slot_peek_binary_changes('s', NULL, NULL, "
            "'proto_version', '1', 'publication_names', 'p')"
        ).fetchall()
    kinds = [bytes(r[0])[:1] for r in rows]
    assert kinds == [b"B", b"R", b"I", b"C"]
