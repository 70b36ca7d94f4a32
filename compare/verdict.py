"""Which mode `disagg compare` recommends, from its measured ratios: push / pull of TTFT and TPOT p50 with their
90% intervals, and each mode's failed requests.

1. Reliability first: a mode that failed requests where the other failed none, or at more than twice its rate
   (and at least 1% of what it sent), loses.
2. A metric favours push when its interval lies wholly below 1, pull when wholly above; else it is inside the
   noise.
3. Both favour one mode, or one does and the other is noise: that mode. They disagree: the `prefer`red metric's
   (TTFT by default: push mode's reason to exist). Neither: no recommendation; the difference is inside the noise.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .schedule import MODES, Mode, other

Metric = Literal["ttft", "tpot"]


@dataclass(frozen=True, slots=True)
class Ratio:
    """push / pull of one metric's p50, with its 90% interval (None: a side had no sample)."""

    p50: float | None
    ci: tuple[float, float] | None

    def favours(self) -> Mode | None:
        if self.ci is None:
            return None
        lo, hi = self.ci
        return "push" if hi < 1 else "pull" if lo > 1 else None

    def describe(self, metric: Metric) -> str:
        if self.p50 is None or self.ci is None:
            return f"{metric.upper()} p50: no sample on one side"
        return f"{metric.upper()} p50 push/pull {self.p50:.2f}x (90% interval {self.ci[0]:.2f}-{self.ci[1]:.2f}x)"


@dataclass(frozen=True, slots=True)
class Verdict:
    mode: Mode | None
    within_noise: bool
    reason: str


def _less_reliable(failed: dict[Mode, int], sent: dict[Mode, int]) -> Mode | None:
    rate = {m: failed.get(m, 0) / sent[m] if sent.get(m) else 0.0 for m in MODES}
    for m in MODES:
        o = other(m)
        if failed.get(m, 0) and not failed.get(o, 0):
            return m
        if rate[m] >= 0.01 and rate[m] > 2 * rate[o]:
            return m
    return None


def decide(ratios: dict[Metric, Ratio], failed: dict[Mode, int], sent: dict[Mode, int],
           prefer: Metric = "ttft") -> Verdict:
    worse = _less_reliable(failed, sent)
    if worse is not None:
        return Verdict(other(worse), False, f"{worse} failed {failed.get(worse, 0)} of {sent.get(worse, 0)} "
                       f"requests, {other(worse)} {failed.get(other(worse), 0)} of {sent.get(other(worse), 0)}")
    said = "; ".join(ratios[m].describe(m) for m in ("ttft", "tpot"))
    ttft, tpot = ratios["ttft"].favours(), ratios["tpot"].favours()
    if ttft is None and tpot is None:
        return Verdict(None, True, f"the difference is inside the noise: {said}")
    if ttft is None or tpot is None or ttft == tpot:
        mode = ttft or tpot
        assert mode is not None
        return Verdict(mode, False, f"{mode} is faster: {said}")
    mode = ttft if prefer == "ttft" else tpot
    return Verdict(mode, False, f"a trade-off, decided by {prefer.upper()} (--prefer): {said}")
