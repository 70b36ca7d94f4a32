"""The KV handoff of each replayed request, from the routers' access logs (connector/router/access_log.py: one JSON
line per request with its `request_id` and `handoff_ms`), joined to the client's timings by the X-Request-Id the
router answered with. Lines that are not access-log records (a pod's other output) are skipped."""
from __future__ import annotations

import json
from collections.abc import Iterable


def handoffs(lines: Iterable[str]) -> dict[str, float]:
    """request_id -> handoff_ms of every record that has both."""
    out: dict[str, float] = {}
    for line in lines:
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(record, dict):
            continue
        rid, handoff = record.get("request_id"), record.get("handoff_ms")
        if isinstance(rid, str) and isinstance(handoff, (int, float)):
            out[rid] = float(handoff)
    return out
