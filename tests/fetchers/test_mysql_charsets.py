"""ENUM and SET labels in character sets other than UTF-8, and collations mysql-replication
does not know.

mysql-replication decodes the labels of the binlog's table map as UTF-8 (a latin1
``é`` became ``''``, a ucs2 ``b`` became ``'\\x00b'``) and takes a collation id it
does not know (MariaDB's ``uca1400`` ones) for UTF-8: a utf16 column's bytes went
out as UTF-8 text no consumer could decode (review).
"""

from __future__ import annotations

from pathlib import Path

from test_mysql_fetcher import caught_up, execute, relay_config, replay, wait_until

from changebus.fetchers.mysql import EmbeddedMariaDB
from changebus.relay import Relay


async def test_labels_and_text_in_other_character_sets_arrive_as_the_server_holds_them(
    tmp_path: Path, mysql_server: EmbeddedMariaDB, mysql_db: str
) -> None:
    execute(
        mysql_server,
        mysql_db,
        "CREATE TABLE cs (id int PRIMARY KEY, "
        "e enum('é','ü','a') CHARACTER SET latin1, "
        "s set('é','ü') CHARACTER SET latin1, "
        "u enum('a','b') CHARACTER SET ucs2, "
        "w set('x','y') CHARACTER SET utf16, "
        "t varchar(20) CHARACTER SET utf16 COLLATE utf16_uca1400_ai_ci)",
    )
    async with Relay(relay_config(tmp_path, mysql_server, mysql_db)) as relay:
        await wait_until(lambda: relay.hosts["my"].state == "streaming")
        execute(
            mysql_server,
            mysql_db,
            "INSERT INTO cs VALUES (1, 'ü', 'é,ü', 'b', 'x,y', 'héllo wörld')",
            "INSERT INTO cs VALUES (2, 'a', '', 'a', 'y', 'ascii')",
        )
        await caught_up(relay, mysql_server, mysql_db)
        assert relay.hosts["my"].state == "streaming", relay.hosts["my"].last_error
        rows, _, _ = replay(relay, "cs")
    got = {k: (r["e"], sorted(r["s"]), r["u"], sorted(r["w"]), r["t"]) for k, r in rows.items()}
    assert got == {
        1: ("ü", ["é", "ü"], "b", ["x", "y"], "héllo wörld"),
        2: ("a", [], "a", ["y"], "ascii"),
    }


async def test_mixed_case_labels_of_a_latin1_enum_keep_their_case(
    tmp_path: Path, mysql_server: EmbeddedMariaDB, mysql_db: str
) -> None:
    """The labels of a non-UTF-8 column come from information_schema's COLUMN_TYPE, which
    the fetcher lowercased: 'Active' went out as 'active' for every table that existed
    when the relay started (latin1 is MariaDB 10.11's default: review)."""
    execute(
        mysql_server,
        mysql_db,
        "CREATE TABLE st (id int PRIMARY KEY, e enum('Active','Done','ÉTÉ') CHARACTER SET "
        "latin1, s set('Red','Blue') CHARACTER SET latin1)",
    )
    async with Relay(relay_config(tmp_path, mysql_server, mysql_db)) as relay:
        await wait_until(lambda: relay.hosts["my"].state == "streaming")
        execute(
            mysql_server,
            mysql_db,
            "INSERT INTO st VALUES (1, 'Active', 'Red,Blue')",
            "INSERT INTO st VALUES (2, 'ÉTÉ', 'Blue')",
        )
        await caught_up(relay, mysql_server, mysql_db)
        rows, _, _ = replay(relay, "st")
    got = {k: (r["e"], sorted(r["s"])) for k, r in rows.items()}
    assert got == {1: ("Active", ["Blue", "Red"]), 2: ("ÉTÉ", ["Blue"])}
