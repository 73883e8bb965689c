"""SCN helpers: Postgres LSNs, binlog positions, text forms."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from changebus.schemas import (
    MAX_SCN,
    BadRequestError,
    binlog_file_number,
    binlog_to_scn,
    format_scn,
    lsn_to_scn,
    parse_scn,
    scn_to_binlog,
    scn_to_lsn,
)

scns = st.integers(0, MAX_SCN)


def test_known_lsns() -> None:
    assert lsn_to_scn("0/0") == 0
    assert lsn_to_scn("16/B374D848") == (0x16 << 32) | 0xB374D848
    assert lsn_to_scn("16/b374d848") == lsn_to_scn("16/B374D848")
    assert scn_to_lsn((0x16 << 32) | 0xB374D848) == "16/B374D848"
    assert scn_to_lsn(0x1_0000_0001) == "1/1"


@given(scns)
def test_lsn_round_trip(scn: int) -> None:
    assert lsn_to_scn(scn_to_lsn(scn)) == scn


@given(st.integers(0, 2**31 - 2), st.integers(0, 2**32 - 1))
def test_binlog_round_trip_and_order(file_number: int, position: int) -> None:
    scn = binlog_to_scn(file_number, position)
    assert scn_to_binlog(scn) == (file_number, position)
    if position < 2**32 - 1:
        assert binlog_to_scn(file_number, position + 1) > scn
    assert binlog_to_scn(file_number + 1, 4) > scn  # rotation keeps order


@given(scns, st.sampled_from(["plain", "pg", "mysql"]))
def test_format_parse_round_trip(scn: int, kind: str) -> None:
    if kind == "mysql" and scn >> 32 >= 2**31:
        return
    assert parse_scn(format_scn(scn, kind)) == scn  # type: ignore[arg-type]


def test_binlog_file_numbers() -> None:
    assert binlog_file_number("mysql-bin.000123") == 123
    assert binlog_file_number("host-relay.bin.7") == 7
    for bad in ("mysql-bin", "mysql-bin.", "mysql-bin.abc", "mysql-bin.12345678901"):
        with pytest.raises(BadRequestError, match="numeric suffix"):
            binlog_file_number(bad)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "abc",
        "-1",
        "1/",
        "/1",
        "G/1",
        "123456789/1",
        "1:2:3",
        "99999999999:1",
        "1.5",
        str(2**63),
        "²",  # str.isdigit() says yes to these; int() refused it (ValueError)
        "١٢",  # (int() reads 12)
        "\uff11\uff12",  # (fullwidth 12)
        "1²",
    ],
)
def test_garbage_is_rejected_clearly(text: str) -> None:
    with pytest.raises(BadRequestError) as info:
        parse_scn(text)
    assert (
        "SCN" in info.value.message or "LSN" in info.value.message or "binlog" in info.value.message
    )


def test_ranges() -> None:
    with pytest.raises(BadRequestError):
        scn_to_lsn(-1)
    with pytest.raises(BadRequestError):
        binlog_to_scn(2**31, 0)
    with pytest.raises(BadRequestError):
        binlog_to_scn(1, 2**32)
