"""Reading a running server's ``/metrics`` in tests: samples by name and labels."""

from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families


async def scrape(url: str) -> str:
    """The ``/metrics`` text of the server at ``url``."""
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
        assert resp.status == 200
        return await resp.text()


def families(text: str) -> set[str]:
    """The family names of a ``/metrics`` text as its ``# TYPE`` lines name them."""
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples named ``name`` (counters: with ``_total``), keyed by sorted labels."""
    out: dict[tuple[tuple[str, str], ...], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def value(text: str, name: str, **labels: str) -> float | None:
    """One sample's value (None: no such sample)."""
    return samples(text, name).get(tuple(sorted(labels.items())))
