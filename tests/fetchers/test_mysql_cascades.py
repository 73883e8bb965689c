"""Foreign-key actions (ON DELETE CASCADE, SET NULL) and the binlog.

InnoDB carries out a foreign key's ON DELETE / ON UPDATE action below the
server's SQL layer, and MariaDB's row-based binlog holds only the statement's
own rows: the child rows a cascade deleted or changed are in no row event, so
no CDC reader of the binlog sees them (review). The fetcher cannot recover
them; it warns when a captured table is the child of such a foreign key
(``changebus check-source`` and the relay's start).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from test_mysql_fetcher import caught_up, execute, relay_config, replay, wait_until

from changebus.fetchers.mysql import EmbeddedMariaDB
from changebus.relay import Relay


async def test_cascaded_deletes_are_not_in_the_binlog_and_the_relay_says_so(
    tmp_path: Path,
    mysql_server: EmbeddedMariaDB,
    mysql_db: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    execute(
        mysql_server,
        mysql_db,
        "CREATE TABLE parent (id int PRIMARY KEY)",
        "CREATE TABLE child (id int PRIMARY KEY, pid int, FOREIGN KEY (pid) REFERENCES "
        "parent (id) ON DELETE CASCADE)",
    )
    with caplog.at_level(logging.WARNING, logger="changebus.fetchers.mysql"):
        async with Relay(relay_config(tmp_path, mysql_server, mysql_db)) as relay:
            await wait_until(lambda: relay.hosts["my"].state == "streaming")
            execute(
                mysql_server,
                mysql_db,
                "INSERT INTO parent VALUES (1), (2)",
                "INSERT INTO child VALUES (10, 1), (20, 2)",
                "DELETE FROM parent WHERE id = 1",
            )
            await caught_up(relay, mysql_server, mysql_db)
            children, _, _ = replay(relay, "child")
    # the cascade's delete of child 10 is in no row event
    assert sorted(children) == [10, 20]
    warned = [r.getMessage() for r in caplog.records if "ON DELETE" in r.getMessage()]
    assert warned and f"{mysql_db}.child" in warned[0], warned
