"""The report of `disagg compare`: every request's timings, per mode each metric's p50 and p99 with 90% intervals,
push / pull ratios, and the verdict; as JSON (the typed model), markdown and an SVG plot.

`build` is pure: the same requests and seed give the same report.
"""
from __future__ import annotations

import random
from html import escape

from pydantic import BaseModel, ConfigDict

from . import stats
from .schedule import MODES, Mode
from .verdict import Metric, Ratio, Verdict, decide

METRICS = ("ttft", "tpot", "handoff")


class RequestTiming(BaseModel):
    """One replayed request, as the client saw it; `handoff_ms` and `served_mode` are the router's (its access
    log), None when it logged none for the request."""

    model_config = ConfigDict(frozen=True)
    mode: Mode
    segment: int
    sent_s: float
    ok: bool
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    handoff_ms: float | None = None
    served_mode: str | None = None
    error: str | None = None

    def value(self, metric: str) -> float | None:
        return getattr(self, f"{metric}_ms") if self.ok else None


class MetricSummary(BaseModel):
    p50_ms: float | None
    p50_ci_ms: tuple[float, float] | None
    p99_ms: float | None
    p99_ci_ms: tuple[float, float] | None
    n: int


class RatioSummary(BaseModel):
    """push / pull."""

    p50: float | None
    p50_ci: tuple[float, float] | None
    p99: float | None
    p99_ci: tuple[float, float] | None


class VerdictSummary(BaseModel):
    mode: Mode | None
    within_noise: bool
    reason: str


class Workload(BaseModel):
    source: str
    requests: int
    rate: float
    seed: int


class CompareReport(BaseModel):
    deployment: str
    """namespace/name of the DisaggregatedInference."""
    workload: Workload
    order: list[Mode]
    prefer: Metric
    sent: dict[Mode, int]
    failed: dict[Mode, int]
    served_in_other_mode: dict[Mode, int]
    """Requests of a mode's segments that the router logged as served in the other mode: more than 0 voids the
    comparison (a rollout had not finished)."""
    unlogged: dict[Mode, int]
    """Answered requests the routers' logs did not show (their mode unproven)."""
    summary: dict[Mode, dict[str, MetricSummary]]
    ratios: dict[str, RatioSummary]
    verdict: VerdictSummary
    requests: list[RequestTiming]


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def build(deployment: str, workload: Workload, order: list[Mode], requests: list[RequestTiming],
          prefer: Metric = "ttft", seed: int = 0, resamples: int = 2000) -> CompareReport:
    rng = random.Random(seed)
    values = {m: {k: [x for r in requests if r.mode == m and (x := r.value(k)) is not None] for k in METRICS}
              for m in MODES}
    summary = {m: {k: MetricSummary(p50_ms=_r(stats.quantile(v, 0.5)),
                                    p50_ci_ms=stats.quantile_ci(v, 0.5, rng, resamples),
                                    p99_ms=_r(stats.quantile(v, 0.99)),
                                    p99_ci_ms=stats.quantile_ci(v, 0.99, rng, resamples), n=len(v))
                   for k, v in per.items()} for m, per in values.items()}
    ratios = {}
    for k in METRICS:
        push, pull = values["push"][k], values["pull"][k]
        ratios[k] = RatioSummary(
            p50=_ratio(stats.quantile(push, 0.5), stats.quantile(pull, 0.5)),
            p50_ci=stats.ratio_ci(push, pull, 0.5, rng, resamples),
            p99=_ratio(stats.quantile(push, 0.99), stats.quantile(pull, 0.99)),
            p99_ci=stats.ratio_ci(push, pull, 0.99, rng, resamples))
    sent = {m: sum(1 for r in requests if r.mode == m) for m in MODES}
    failed = {m: sum(1 for r in requests if r.mode == m and not r.ok) for m in MODES}
    other = {m: sum(1 for r in requests if r.mode == m and r.served_mode not in (None, m)) for m in MODES}
    unlogged = {m: sum(1 for r in requests if r.mode == m and r.ok and r.served_mode is None) for m in MODES}
    verdict = decide({k: Ratio(ratios[k].p50, ratios[k].p50_ci) for k in ("ttft", "tpot")}, failed, sent, prefer)
    if any(other.values()):
        verdict = Verdict(None, False, "no comparison: " + ", ".join(
            f"{n} requests of the {m} segments were served in the other mode" for m, n in other.items() if n))
    return CompareReport(deployment=deployment, workload=workload, order=order, prefer=prefer, sent=sent,
                         failed=failed, served_in_other_mode=other, unlogged=unlogged, summary=summary, ratios=ratios,
                         verdict=VerdictSummary(mode=verdict.mode, within_noise=verdict.within_noise,
                                                 reason=verdict.reason),
                         requests=requests)


def _ms(x: float | None, ci: tuple[float, float] | None) -> str:
    if x is None:
        return "—"
    return f"{x:.1f}" + (f" ({ci[0]:.1f}-{ci[1]:.1f})" if ci else "")


def _x(x: float | None, ci: tuple[float, float] | None) -> str:
    if x is None:
        return "—"
    return f"{x:.2f}x" + (f" ({ci[0]:.2f}-{ci[1]:.2f})" if ci else "")


def markdown(report: CompareReport) -> str:
    w = report.workload
    lines = [f"# disagg compare: {report.deployment}", "",
             f"Workload: {w.source}, {w.requests} requests at {w.rate:g}/s (seed {w.seed}), served in the order "
             f"{', '.join(report.order)}.", "",
             "| metric | push p50 ms | pull p50 ms | push/pull p50 | push p99 ms | pull p99 ms | push/pull p99 |",
             "|---|---|---|---|---|---|---|"]
    for k in METRICS:
        push, pull, r = report.summary["push"][k], report.summary["pull"][k], report.ratios[k]
        lines.append(f"| {k.upper()} | {_ms(push.p50_ms, push.p50_ci_ms)} | {_ms(pull.p50_ms, pull.p50_ci_ms)} | "
                     f"{_x(r.p50, r.p50_ci)} | {_ms(push.p99_ms, push.p99_ci_ms)} | "
                     f"{_ms(pull.p99_ms, pull.p99_ci_ms)} | {_x(r.p99, r.p99_ci)} |")
    lines += ["", "Intervals are 90% bootstrap intervals over requests.",
              f"Failed requests: push {report.failed['push']} of {report.sent['push']}, pull "
              f"{report.failed['pull']} of {report.sent['pull']}. Served in the mode of their segment, by the "
              f"routers' logs: push {_proved(report, 'push')}, pull {_proved(report, 'pull')}.", "",
              "**Recommendation: " + (f"{report.verdict.mode}**" if report.verdict.mode else "either mode**")
              + f" ({report.verdict.reason}).", ""]
    return "\n".join(lines)


def _proved(report: CompareReport, mode: Mode) -> str:
    answered = report.sent[mode] - report.failed[mode]
    return f"{answered - report.served_in_other_mode[mode] - report.unlogged[mode]} of {answered}"


COLOURS: dict[Mode, str] = {"push": "#1f77b4", "pull": "#d62728"}


def svg(report: CompareReport, width: int = 640, height: int = 360) -> str:
    """Each mode's TTFT as a cumulative distribution (x: TTFT ms, y: share of requests), with the p50 marked."""
    left, right, top, bottom = 60, 20, 30, 50
    ttft = {m: sorted(x for r in report.requests if r.mode == m and (x := r.value("ttft")) is not None)
            for m in MODES}
    top_ms = max((v[-1] for v in ttft.values() if v), default=1.0) or 1.0
    pw, ph = width - left - right, height - top - bottom

    def xy(ms: float, share: float) -> str:
        return f"{left + pw * ms / top_ms:.1f},{top + ph * (1 - share):.1f}"

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             'font-size="12">',
             f'<text x="{left}" y="18">{escape(report.deployment)}: TTFT, push against pull</text>',
             f'<line x1="{left}" y1="{top + ph}" x2="{left + pw}" y2="{top + ph}" stroke="black"/>',
             f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + ph}" stroke="black"/>',
             f'<text x="{left + pw / 2}" y="{height - 12}" text-anchor="middle">TTFT (ms)</text>',
             f'<text x="14" y="{top + ph / 2}" transform="rotate(-90 14 {top + ph / 2})" text-anchor="middle">'
             'share of requests</text>']
    for i in range(5):
        ms = top_ms * i / 4
        parts.append(f'<text x="{left + pw * i / 4:.1f}" y="{top + ph + 16}" text-anchor="middle">{ms:.0f}</text>')
        parts.append(f'<text x="{left - 6}" y="{top + ph * (1 - i / 4) + 4:.1f}" text-anchor="end">{i / 4:.2f}</text>')
    for n, mode in enumerate(MODES):
        xs = ttft[mode]
        if xs:
            points = " ".join(xy(x, (j + 1) / len(xs)) for j, x in enumerate(xs))
            parts.append(f'<polyline fill="none" stroke="{COLOURS[mode]}" stroke-width="2" points="{points}"/>')
        p50 = report.summary[mode]["ttft"].p50_ms
        label = f"{mode}: p50 {p50:.0f} ms, n {len(xs)}" if p50 is not None else f"{mode}: no sample"
        parts.append(f'<text x="{left + pw - 4}" y="{top + ph - 24 + 16 * n}" text-anchor="end" '
                     f'fill="{COLOURS[mode]}">{escape(label)}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
