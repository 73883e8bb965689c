"""Numbers in requests a relay must refuse (issue 17, item 4, and a review's finding):
over-long integers anywhere in a request are short 400s, never 500s or tracebacks; a
checkpoint offset at or past its window's end is a 400, not a silent skip.
"""

from __future__ import annotations

import base64
import json
import logging
from pathlib import Path

import aiohttp
import pytest

from changebus.relay import FetcherConfig, HttpConfig, PartitionConfig, Relay, RelayConfig
from waiting import wait_until

pytestmark = pytest.mark.usefixtures("no_blocking")


# ---- over-long integers ----------------------------------------------------------------

HUGE = "9" * 5000
LONG = "9" * 4000  # under Python's own 4,300-digit int() limit: refused before int()


def _token(text: str) -> str:
    return "cb1." + base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def _cp(field: str, number: str) -> str:
    return '{"v":1,"partitions":{"syn":{"' + field + '":' + number + "}}}"


@pytest.mark.parametrize(
    "params",
    [
        {"filter": f"mod:{HUGE}:1"},
        {"filter": f"mod:3:{LONG}"},
        {"filter": f"mod:3:0-{LONG}"},
        {"filter": f"mod:{LONG}:1"},
        {"filter": f"range:{LONG}:max"},
        {"filter": f"range:0:{HUGE}"},
        {"filter": f"slice:{LONG}/3"},
        {"filter": f"slice:1/{HUGE}"},
        {"checkpoint": _cp("window_scn", HUGE)},
        {"checkpoint": _cp("window_scn", LONG)},
        {"checkpoint": _cp("timestamp_ns", "-" + LONG)},
        {"checkpoint": _cp("window_offset", LONG)},
        {"checkpoint": _token(_cp("window_scn", HUGE))},
        {"checkpoint": _token(_cp("prev_scn", LONG))},
        {"checkpoint": '{"v":' + LONG + ',"partitions":{}}'},
        {"checkpoint": '{"v":1,"partitions":{"syn":{"window_scn":1e' + LONG + "}}}"},
        {"scn": LONG},
        {"offset": "-" + HUGE},
        {"max_bytes": LONG},
        {"wait": LONG + ".0"},
        {"follow": "1", "follow_bytes": LONG},
        {"sources": LONG},
    ],
)
async def test_long_integers_are_short_400s_without_tracebacks(
    tmp_path: Path, params: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    options = {"windows_per_s": 0, "max_windows": 5}
    cfg = RelayConfig(
        data_dir=tmp_path / "relay",
        http=HttpConfig(port=0),
        partitions=(PartitionConfig("syn", 1, fetcher=FetcherConfig("synthetic", options)),),
        flush_interval_s=0,
    )
    caplog.set_level(logging.INFO)
    async with (
        Relay(cfg) as relay,
        aiohttp.ClientSession() as http,
        http.get(f"{relay.url}/v1/stream", params={"partition": "syn", **params}) as resp,
    ):
        body = await resp.json()
        status = resp.status
    expected = 404 if "sources" in params else 400
    assert status == expected, body
    assert body["retriable"] is False
    assert len(body["message"]) < 300  # the number is not echoed back
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


@pytest.mark.parametrize("follow", ["0", "1"])
async def test_an_offset_past_its_windows_end_is_a_400_not_a_skip(
    tmp_path: Path, follow: str
) -> None:
    options = {"windows_per_s": 0, "max_windows": 3, "events_per_window": 4}
    cfg = RelayConfig(
        data_dir=tmp_path / "relay",
        http=HttpConfig(port=0),
        partitions=(PartitionConfig("syn", 1, fetcher=FetcherConfig("synthetic", options)),),
        flush_interval_s=0,
    )
    async with Relay(cfg) as relay, aiohttp.ClientSession() as http:
        await wait_until(lambda: relay.hosts["syn"].state == "finished", 60, "the windows")
        url = f"{relay.url}/v1/stream"
        everything = {"partition": "syn", "scn": "-1", "format": "ndjson"}
        async with http.get(url, params=everything) as resp:
            scns = [json.loads(line)["scn"] for line in (await resp.text()).splitlines()]
        first = scns[0]
        size = scns.count(first)  # its rows and the end-of-window event
        base = {"partition": "syn", "scn": str(first), "follow": follow, "wait": "0.2"}
        async with http.get(url, params={**base, "offset": str(size - 1)}) as resp:
            assert resp.status == 200  # only the end-of-window event left: fine
        for offset in (size, size + 1, 2**31):
            async with http.get(url, params={**base, "offset": str(offset)}) as resp:
                body = await resp.json()
                assert resp.status == 400, body
            assert body["error"] == "bad_checkpoint" and body["retriable"] is False
            assert f"past the end of window {first}" in body["message"]
