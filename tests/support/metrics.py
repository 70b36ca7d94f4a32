"""Read a Prometheus text endpoint (the operator's, the router's, an engine's): one counter or gauge, or every
sample."""
from __future__ import annotations

import re
import urllib.request

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? ([0-9.e+-]+)$", line)
        if m and all(dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or "")).get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


async def samples(session: aiohttp.ClientSession, base_url: str) -> Samples:
    """Every sample of `base_url`/metrics, by name and sorted labels."""
    async with session.get(base_url + "/metrics") as r:
        text = await r.text()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}
