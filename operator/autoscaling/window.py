"""A `RouterWindow` from the router's per-request records (what its access log holds for each request), for a
caller that observes requests directly rather than through Prometheus' histograms."""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .observed import RouterWindow


@dataclass(frozen=True, slots=True)
class RequestSample:
    """One request the router received in the window. A refused request (429) has only `rejected`; a request not
    finished yet has its tokens and the times it has reached so far."""

    rejected: bool = False
    finished: bool = True
    input_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    handoff_s: float | None = None


def percentile(values: Sequence[float], p: float) -> float | None:
    """The nearest-rank `p`th percentile (the smallest value with at least p% of them at or below it); None for no
    values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def _ms(values: Iterable[float | None], p: float) -> float | None:
    found = percentile([v for v in values if v is not None], p)
    return None if found is None else found * 1000


def summarize(requests: Iterable[RequestSample], seconds: float, percentile_at: float, *, queued: int = 0,
              idle_seconds: float = 0.0) -> RouterWindow:
    """The window of `requests` received over `seconds`: arrivals and refusals counted, token means over the
    finished ones, latencies at `percentile_at` over those that reached each point."""
    requests = list(requests)
    served = [r for r in requests if not r.rejected]
    finished = [r for r in served if r.finished]
    return RouterWindow(
        seconds=seconds, arrivals=len(requests), rejected=len(requests) - len(served), queued=queued,
        mean_input_tokens=sum(r.input_tokens for r in finished) / len(finished) if finished else 0.0,
        mean_output_tokens=sum(r.output_tokens for r in finished) / len(finished) if finished else 0.0,
        percentile=percentile_at, ttft_ms=_ms((r.ttft_s for r in served), percentile_at),
        tpot_ms=_ms((r.tpot_s for r in served), percentile_at),
        handoff_ms=_ms((r.handoff_s for r in served), percentile_at), idle_seconds=idle_seconds)
