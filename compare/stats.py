"""Percentiles of per-request timings and their bootstrap intervals (requests resampled with replacement)."""
from __future__ import annotations

import math
import random
from collections.abc import Sequence

CONFIDENCE = 0.90
"""Every interval here is a 90% one: the two-sided 5%-95% of the bootstrap distribution."""


def quantile(values: Sequence[float], q: float) -> float | None:
    """The q-quantile by linear interpolation between order statistics; None for no values."""
    if not values:
        return None
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def _interval(stats: list[float]) -> tuple[float, float] | None:
    tail = (1 - CONFIDENCE) / 2
    lo, hi = quantile(stats, tail), quantile(stats, 1 - tail)
    return None if lo is None or hi is None else (round(lo, 3), round(hi, 3))


def quantile_ci(values: Sequence[float], q: float, rng: random.Random, n: int = 2000) -> tuple[float, float] | None:
    """90% bootstrap interval of quantile_q(values); None for no values."""
    if not values:
        return None
    stats = [quantile([rng.choice(values) for _ in values], q) for _ in range(n)]
    return _interval([s for s in stats if s is not None])


def ratio_ci(num: Sequence[float], den: Sequence[float], q: float, rng: random.Random,
             n: int = 2000) -> tuple[float, float] | None:
    """90% bootstrap interval of quantile_q(num) / quantile_q(den); None when either side has no values."""
    if not num or not den:
        return None
    stats = []
    for _ in range(n):
        a = quantile([rng.choice(num) for _ in num], q)
        b = quantile([rng.choice(den) for _ in den], q)
        if a and b:
            stats.append(a / b)
    return _interval(stats)
