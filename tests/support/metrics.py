"""Read one counter or gauge from a Prometheus text endpoint (the operator's, the router's)."""
from __future__ import annotations

import re
import urllib.request


def scrape(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? ([0-9.e+-]+)$", line)
        if m and all(dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or "")).get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total
