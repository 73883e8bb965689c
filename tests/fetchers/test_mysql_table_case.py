"""Tables whose names differ only in case (``lower_case_table_names = 0``, Linux's default).

The DDL the stream reads names tables in lower case, and a TRUNCATE found its
table by that name: ``TRUNCATE TABLE orders`` went out for ``app.Orders``
where both existed, so consumers emptied the wrong one (review).
"""

from __future__ import annotations

from pathlib import Path

from test_mysql_fetcher import caught_up, execute, relay_config, replay, wait_until

from changebus.fetchers.mysql import EmbeddedMariaDB
from changebus.relay import Relay


async def test_a_truncate_empties_the_table_of_its_own_case(
    tmp_path: Path, mysql_server: EmbeddedMariaDB, mysql_db: str
) -> None:
    execute(
        mysql_server,
        mysql_db,
        "CREATE TABLE Orders (id int PRIMARY KEY)",
        "CREATE TABLE orders (id int PRIMARY KEY)",
    )
    async with Relay(relay_config(tmp_path, mysql_server, mysql_db)) as relay:
        await wait_until(lambda: relay.hosts["my"].state == "streaming")
        execute(
            mysql_server,
            mysql_db,
            "INSERT INTO Orders VALUES (1), (2)",
            "INSERT INTO orders VALUES (3)",
            "INSERT INTO Orders VALUES (4)",
            "TRUNCATE TABLE orders",
        )
        await caught_up(relay, mysql_server, mysql_db)
        upper, _, _ = replay(relay, "Orders")
        lower, _, _ = replay(relay, "orders")
    assert sorted(upper) == [1, 2, 4]
    assert lower == {}
    # after a restart, Orders is not mapped in this run (only registered), orders is:
    # TRUNCATE Orders must not fall back to the lower-case name
    async with Relay(relay_config(tmp_path, mysql_server, mysql_db)) as relay:
        await wait_until(lambda: relay.hosts["my"].state == "streaming")
        execute(mysql_server, mysql_db, "INSERT INTO orders VALUES (5)", "TRUNCATE TABLE Orders")
        await caught_up(relay, mysql_server, mysql_db)
        upper, _, _ = replay(relay, "Orders")
        lower, _, _ = replay(relay, "orders")
    assert upper == {}
    assert sorted(lower) == [5]
