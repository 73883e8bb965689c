"""The seeding interface: one SeedRequest value for every seeder, one progress record."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from changebus.bootstrap import (
    Seeder,
    SeedProgress,
    SeedRequest,
    seed_mysql,
    seed_postgres,
    seeder_for,
)
from changebus.schemas import ConfigError

PASSWORD = "s3cret-seed-password"


def test_a_request_is_a_frozen_value_that_hides_its_dsn() -> None:
    request = SeedRequest(f"postgresql://u:{PASSWORD}@h/db", 3, ("public.a", "public.b"))
    assert PASSWORD not in repr(request)  # secrets stay out of reprs, hence of logs
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.chunk_rows = 1  # type: ignore[misc]
    assert request.chunk_rows == 5000 and request.schemas == () and request.done == frozenset()
    with pytest.raises(ConfigError, match="chunk_rows"):
        SeedRequest("dsn", 1, ("t",), chunk_rows=0)


def test_progress_begins_with_the_tables_left_to_copy() -> None:
    request = SeedRequest("dsn", 1, ("s.a", "s.b", "s.c"), done=frozenset({"s.b"}))
    progress = SeedProgress()
    assert progress.begin(request) == ["s.a", "s.c"]
    assert (progress.state, progress.tables_total, progress.tables_done) == ("running", 3, 1)
    assert progress.started_at > 0


@pytest.mark.parametrize(("kind", "seeder"), [("postgres", seed_postgres), ("mysql", seed_mysql)])
def test_every_seeder_has_the_one_signature(kind: str, seeder: Seeder) -> None:
    assert seeder_for(kind) is seeder
    params = inspect.signature(seeder).parameters
    assert list(params) == ["request", "write", "progress", "stop", "sink"]
    assert params["stop"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["sink"].kind is inspect.Parameter.KEYWORD_ONLY


def test_an_unknown_seed_kind_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"seed\.kind"):
        seeder_for("oracle")


def test_nothing_left_to_copy_returns_the_known_scn_without_connecting() -> None:
    # the DSN points nowhere: a seeder with every table done must not connect
    request = SeedRequest("host=127.0.0.1 port=1 connect_timeout=1", 1, ("s.t",))
    request = dataclasses.replace(request, done=frozenset({"s.t"}))
    progress = SeedProgress(scn=42)
    assert seed_postgres(request, lambda *_: None, progress) == 42
    assert progress.state == "copied" and progress.tables_done == 1
