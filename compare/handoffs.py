"""How the router served each replayed request, from the routers' access logs (connector/router/access_log.py:
one JSON line per request with its `request_id`, the router's `mode` and `handoff_ms`), joined to the client's
timings by the X-Request-Id the router answered with. Lines that are not access-log records (a pod's other
output) are skipped."""
from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Served:
    mode: str | None
    """The mode of the router that served it: the proof that a segment ran in the mode it claims."""
    handoff_ms: float | None
    """Prefill answered to decode's first token; None when the router did not see both."""


def served(lines: Iterable[str]) -> dict[str, Served]:
    """request_id -> how it was served, for every record that has a request id."""
    out: dict[str, Served] = {}
    for line in lines:
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(record, dict) or not isinstance(rid := record.get("request_id"), str):
            continue
        mode, handoff = record.get("mode"), record.get("handoff_ms")
        out[rid] = Served(mode if isinstance(mode, str) else None,
                          float(handoff) if isinstance(handoff, (int, float)) else None)
    return out
