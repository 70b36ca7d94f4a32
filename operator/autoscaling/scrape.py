"""The planner's observation from what the routers and the engines export on `/metrics`: Prometheus text parsed into
a `Snapshot`, and two snapshots taken `seconds` apart turned into a `RouterWindow` and each role's `EngineLoad`.
Pure: the caller fetches the text (and names each source by its pod); nothing here does I/O.

Read from the routers (connector/router/app.py, `Metrics` and `AdmissionMetrics`):
- `disagg_router_admitted_total` and `disagg_router_rejected_total{reason}`: arrivals and refusals (see
  `router_window` for why not `disagg_router_requests_total`);
- `disagg_router_queue_length` and `disagg_router_pair_waiting`: requests waiting for a slot, and for a pair when
  there is none (a router older than that gauge exports none: 0);
- `disagg_router_ttft_seconds`, `disagg_router_handoff_seconds`: TTFT and KV handoff.
Read from the engines (vLLM 0.32's families, which the emulator exports too: connector/emulator/metrics.py):
- prefill: `vllm:request_prompt_tokens` (mean input tokens);
- decode: `vllm:request_generation_tokens` (mean output tokens), `vllm:request_time_per_output_token_seconds` (TPOT);
- each role: `vllm:num_requests_waiting`, `vllm:num_requests_running`, `vllm:kv_cache_usage_perc` (`EngineLoad`).
The router relays streams without parsing them, so token counts and TPOT can only come from the engines.

Over a window, counters and histograms count what they gained between the two snapshots, as Prometheus'
`increase()` does but without its extrapolation (the two scrapes are the window's edges), series by series and then
summed over the sources:
- a value lower than before means its process restarted (a reset): it counts from 0;
- a series new at `after` in a source scraped at both counts from 0 (prometheus_client creates a labelled series at
  0 on its first use);
- a source only in `after` (a new pod, or a failed scrape at `before`) counts nothing until its next window, as
  Prometheus needs two samples of a series; a source only in `before` (gone) counts nothing either.
Gauges are read at `after`, from every source in it.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from prometheus_client.parser import text_string_to_metric_families

from .observed import EngineLoad, RouterWindow

ROUTER_ADMITTED = "disagg_router_admitted_total"
ROUTER_REJECTED = "disagg_router_rejected_total"
ROUTER_QUEUE = "disagg_router_queue_length"
ROUTER_PAIR_WAITING = "disagg_router_pair_waiting"
ROUTER_TTFT = "disagg_router_ttft_seconds"
ROUTER_HANDOFF = "disagg_router_handoff_seconds"
PROMPT_TOKENS = "vllm:request_prompt_tokens"
GENERATION_TOKENS = "vllm:request_generation_tokens"
TPOT = ("vllm:request_time_per_output_token_seconds", "vllm:time_per_output_token_seconds",
        "vllm:inter_token_latency_seconds")
"""TPOT histograms, the first one the decode engines export wins. The SLO's TPOT is per request (a request's time
after its first token over its output tokens after the first: `window.RequestSample.tpot_s`), which only the first
one measures (vLLM observes 0 in it for a request of one output token); the other two observe every gap between
tokens, so long requests weigh more in them. vLLM 0.32 exports the first and the last (tests/emulator/vllm_wire/
records it); `vllm:time_per_output_token_seconds` is older vLLM's name of `vllm:inter_token_latency_seconds`."""
WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"

Labels = tuple[tuple[str, str], ...]
"""A series' labels (without `le`), sorted by name."""
Series = tuple[str, Labels]
"""(source, labels): one series of one metric in one source."""
Buckets = tuple[tuple[float, float], ...]
"""(upper bound, cumulative count), ascending by bound."""


@dataclass(frozen=True, slots=True)
class Histogram:
    """One histogram series, or the sum or the increase of several: cumulative counts by upper bound, ascending and
    ending with +Inf, never decreasing; the count is the +Inf bucket's."""

    buckets: Buckets
    sum: float = 0.0

    def __post_init__(self) -> None:
        if not self.buckets or self.buckets[-1][0] != math.inf:
            raise ValueError("a histogram needs a +Inf bucket")
        bounds = [le for le, _ in self.buckets]
        if any(a >= b for a, b in zip(bounds, bounds[1:], strict=False)):
            raise ValueError(f"bucket bounds must ascend, got {bounds}")
        counts = [n for _, n in self.buckets]
        if not all(math.isfinite(n) and n >= 0 for n in counts) or any(
                a > b for a, b in zip(counts, counts[1:], strict=False)):
            raise ValueError(f"cumulative bucket counts must be finite, non-negative and never decrease, got {counts}")

    @property
    def count(self) -> float:
        return self.buckets[-1][1]

    @property
    def bounds(self) -> tuple[float, ...]:
        return tuple(le for le, _ in self.buckets)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What a set of sources (several routers, or one role's engines) exported at one scrape, series by series.
    Counters are keyed by their family name as prometheus_client parses it, without `_total`; the accessors take
    either spelling. `_created` samples and families are dropped; summaries and untyped families are not kept."""

    sources: frozenset[str] = frozenset()
    counters: Mapping[str, Mapping[Series, float]] = field(default_factory=dict)
    gauges: Mapping[str, Mapping[Series, float]] = field(default_factory=dict)
    histograms: Mapping[str, Mapping[Series, Histogram]] = field(default_factory=dict)

    def exports(self, source: str, name: str) -> bool:
        """`source` exports at least one series of `name`, whatever its type."""
        kinds = (self.counters.get(_counter_name(name), {}), self.gauges.get(name, {}), self.histograms.get(name, {}))
        return any(series[0] == source for kind in kinds for series in kind)

    def counter(self, name: str, **labels: str) -> float:
        """The sum of the counter's series whose labels include `labels`."""
        return sum(v for s, v in self.counters.get(_counter_name(name), {}).items() if _matches(s, labels))

    def gauge(self, name: str, **labels: str) -> float:
        """The sum of the gauge's series whose labels include `labels`."""
        return sum(v for s, v in self.gauges.get(name, {}).items() if _matches(s, labels))

    def histogram(self, name: str, **labels: str) -> Histogram | None:
        """The sum of the histogram's series whose labels include `labels` (see `sum_histograms`); None for none."""
        return sum_histograms(h for s, h in self.histograms.get(name, {}).items() if _matches(s, labels))


def _counter_name(name: str) -> str:
    return name.removesuffix("_total")


def _matches(series: Series, labels: Mapping[str, str]) -> bool:
    have = dict(series[1])
    return all(have.get(k) == v for k, v in labels.items())


def sum_histograms(histograms: Iterable[Histogram]) -> Histogram | None:
    """The sum of `histograms`, over the bounds they all have (+Inf at least): a cumulative count at a bound each
    series has is exact, so series of different bucket layouts (routers of two versions) sum into a coarser but
    correct histogram. None for no histogram."""
    hs = list(histograms)
    if not hs:
        return None
    bounds = sorted(set.intersection(*(set(h.bounds) for h in hs)))
    by_bound = [dict(h.buckets) for h in hs]
    return Histogram(tuple((le, sum(b[le] for b in by_bound)) for le in bounds), sum(h.sum for h in hs))


# -- parsing ----------------------------------------------------------------------------------------------------
def parse(texts: Mapping[str, str]) -> Snapshot:
    """One scrape of each source (`texts`: source name -> its `/metrics` text). Raises ValueError naming the source
    when a text is not Prometheus text exposition, or holds a series twice, a negative or non-finite counter, or a
    histogram without a +Inf bucket, with decreasing cumulative counts, or whose `_count` is not its +Inf bucket."""
    counters: dict[str, dict[Series, float]] = {}
    gauges: dict[str, dict[Series, float]] = {}
    histograms: dict[str, dict[Series, Histogram]] = {}
    for source, text in texts.items():
        try:
            _parse_one(source, text, counters, gauges, histograms)
        except ValueError as e:
            raise ValueError(f"metrics of {source}: {e}") from None
    return Snapshot(frozenset(texts), counters, gauges, histograms)


def _families(text: str) -> list[tuple[str, str, list[tuple[str, dict[str, str], float]]]]:
    try:
        return [(f.name, f.type, [(s.name, dict(s.labels), float(s.value)) for s in f.samples])
                for f in text_string_to_metric_families(text)]
    except Exception as e:  # the parser lets what its internals meet through (ValueError, IndexError, ...)
        raise ValueError(f"not Prometheus text exposition ({type(e).__name__}: {e})") from None


def _put(into: dict[str, dict[Series, float]], name: str, series: Series, value: float) -> None:
    values = into.setdefault(name, {})
    if series in values:
        raise ValueError(f"{name}{dict(series[1])} appears twice")
    values[series] = value


def _parse_one(source: str, text: str, counters: dict[str, dict[Series, float]],
               gauges: dict[str, dict[Series, float]], histograms: dict[str, dict[Series, Histogram]]) -> None:
    families = _families(text)
    # prometheus_client's text format puts each counter's and histogram's `_created` in a gauge family of its own.
    with_created = {name for name, kind, _ in families if kind in ("counter", "histogram", "summary")}
    for name, kind, samples in families:
        if kind == "counter":
            for sample, labels, value in samples:
                if sample == f"{name}_created":
                    continue
                if not (math.isfinite(value) and value >= 0):
                    raise ValueError(f"counter {sample} is {value}")
                _put(counters, name, (source, _labels(labels)), value)
        elif kind == "gauge" and not (name.endswith("_created") and name.removesuffix("_created") in with_created):
            for _, labels, value in samples:
                _put(gauges, name, (source, _labels(labels)), value)
        elif kind == "histogram":
            for series, h in _histograms(source, name, samples).items():
                if series in histograms.setdefault(name, {}):
                    raise ValueError(f"{name}{dict(series[1])} appears twice")
                histograms[name][series] = h


def _labels(labels: Mapping[str, str]) -> Labels:
    return tuple(sorted((k, v) for k, v in labels.items() if k != "le"))


def _histograms(source: str, name: str,
                samples: list[tuple[str, dict[str, str], float]]) -> dict[Series, Histogram]:
    buckets: dict[Series, dict[float, float]] = {}
    sums: dict[Series, float] = {}
    counts: dict[Series, float] = {}
    for sample, labels, value in samples:
        series = (source, _labels(labels))
        if sample == f"{name}_bucket":
            try:
                le = float(labels["le"])
            except (KeyError, ValueError):
                raise ValueError(f"{sample} has no numeric le label: {labels}") from None
            if le in buckets.setdefault(series, {}):
                raise ValueError(f"{sample}{labels} appears twice")
            buckets[series][le] = value
        elif sample == f"{name}_sum":
            sums[series] = value
        elif sample == f"{name}_count":
            counts[series] = value
    out = {}
    for series in buckets.keys() | counts.keys():
        try:
            h = Histogram(tuple(sorted(buckets.get(series, {}).items())), sums.get(series, 0.0))
        except ValueError as e:
            raise ValueError(f"histogram {name}{dict(series[1])}: {e}") from None
        if series in counts and counts[series] != h.count:
            raise ValueError(f"histogram {name}{dict(series[1])}: _count {counts[series]} is not its +Inf bucket "
                             f"{h.count}")
        out[series] = h
    return out


# -- increases over a window -------------------------------------------------------------------------------------
def increase(before: Snapshot, after: Snapshot, name: str, **labels: str) -> float:
    """What the counter's series whose labels include `labels` gained from `before` to `after`, summed (the module
    docstring says how resets and new or gone sources count). Never negative."""
    key = _counter_name(name)
    old = before.counters.get(key, {})
    total = 0.0
    for series, value in after.counters.get(key, {}).items():
        if series[0] not in before.sources or not _matches(series, labels):
            continue
        prior = old.get(series, 0.0)
        total += value - prior if value >= prior else value
    return total


def histogram_increase(before: Snapshot, after: Snapshot, name: str, **labels: str) -> Histogram | None:
    """The observations the histogram's series gained from `before` to `after`, summed as `sum_histograms` does;
    None when no source in both exports it. A series whose bucket layout changed, or any of whose buckets holds fewer
    observations than before, was reset and counts from 0."""
    old = before.histograms.get(name, {})
    gained = []
    for series, h in after.histograms.get(name, {}).items():
        if series[0] not in before.sources or not _matches(series, labels):
            continue
        prior = old.get(series)
        if prior is None or prior.bounds != h.bounds or any(a < b for a, b in zip(_raw(h), _raw(prior), strict=True)):
            gained.append(h)
        else:
            gained.append(Histogram(tuple((le, n - p) for (le, n), (_, p) in zip(h.buckets, prior.buckets,
                                                                                  strict=True)), h.sum - prior.sum))
    return sum_histograms(gained)


def _raw(h: Histogram) -> list[float]:
    """Each bucket's own count (not cumulative): what a reset lowers."""
    counts = [n for _, n in h.buckets]
    return [counts[0]] + [b - a for a, b in zip(counts, counts[1:], strict=False)]


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The `q`-quantile (0 < q <= 1) of cumulative `buckets` (upper bound, count), as Prometheus' classic
    `histogram_quantile` computes it (promql/quantile.go): buckets sorted by bound, equal bounds merged, counts made
    non-decreasing; the quantile's rank is q x count, and its value is interpolated linearly within the bucket that
    reaches that rank, from 0 for the lowest one (or that bucket's bound when it is 0 or less); a rank only the +Inf
    bucket reaches gives the highest finite bound. None when there is no observation.

    Raises ValueError for q outside (0, 1], no +Inf bucket, or no finite bucket (where Prometheus answers NaN)."""
    if not 0 < q <= 1:
        raise ValueError(f"a quantile is in (0, 1], got {q}")
    merged: dict[float, float] = {}
    for le, n in buckets:
        merged[le] = merged.get(le, 0.0) + n
    bounds = sorted(merged)
    if not bounds or bounds[-1] != math.inf:
        raise ValueError("histogram_quantile needs a +Inf bucket")
    if len(bounds) < 2:
        raise ValueError("histogram_quantile needs a finite bucket besides +Inf")
    counts: list[float] = []
    for le in bounds:
        counts.append(max(merged[le], counts[-1]) if counts else merged[le])
    total = counts[-1]
    if total == 0:
        return None
    rank = q * total
    b = next((i for i, n in enumerate(counts[:-1]) if n >= rank), len(bounds) - 1)
    if b == len(bounds) - 1:
        return bounds[-2]
    if b == 0 and bounds[0] <= 0:
        return bounds[0]
    start, below = (bounds[b - 1], counts[b - 1]) if b else (0.0, 0.0)
    return start + (bounds[b] - start) * (rank - below) / (counts[b] - below)


def _percentile_ms(h: Histogram | None, percentile: float) -> float | None:
    found = None if h is None else histogram_quantile(percentile / 100, h.buckets)
    return None if found is None else found * 1000


def _require(snapshot: Snapshot, names: Iterable[str], what: str) -> None:
    """Every source of `snapshot` exports each of `names`: a source that does not is not `what`."""
    for source in sorted(snapshot.sources):
        missing = [n for n in names if not snapshot.exports(source, n)]
        if missing:
            raise ValueError(f"{source} exports no {', '.join(missing)}: is it {what}?")


# -- the router's window ---------------------------------------------------------------------------------------
def router_window(before: Snapshot, after: Snapshot, seconds: float, percentile: float, *,
                  idle_seconds: float | None = None) -> RouterWindow:
    """The routers' window from two scrapes of all of them `seconds` apart; latencies at `percentile` (0 to 100).
    The token means and TPOT are left at none: they come from the engines (`window` adds them).

    Arrivals are `disagg_router_admitted_total` + `disagg_router_rejected_total` gained. The invariant relied on
    (connector/router/app.py `Router._serve`, admission.py `Admission.admit`): every request with a valid body
    reaches `admit` once as a new request, which either admits it (admitted +1: at once, after waiting for a slot,
    or with no pair at all, when the router holds it for one) or refuses it (rejected +1: queue_full at once,
    deadline when no slot freed in the queue; the router answers 429). So a request counts when the router takes
    or refuses it, at most the queue's deadline after it came; a request still waiting in the queue is in `queued`
    instead, and `rejected` <= arrivals in any window. Two rare exceptions: a client that leaves while queued counts
    in neither, and a retry refused at its deadline counts in both.

    `disagg_router_requests_total{mode,endpoint,status}` is not used: it counts a request once, at its answer, with
    its status: 429s (each refusal above, a loop turn after `rejected` counts it, unless the client left first, so a
    window's `rejected` can exceed its 429s), 400/413/415 for bodies the router refuses before admission (never
    load), 502/503 and 200 (a stream that failed mid-way too); not a client that left mid-stream, nor the
    middleware's 500. As arrivals it would lag every change of load by the requests' duration, and at zero it would
    show a request held for a pair only when its pairWaitSeconds end in a 503.

    `queued` is `disagg_router_queue_length` + `disagg_router_pair_waiting` at `after`: requests waiting for a slot,
    and requests held for a pair while there is none (at zero, the demand that wakes the fleet).
    `idle_seconds`, when not given: 0 with arrivals, else `seconds` (no request for at
    least the window); a caller that keeps windows passes its own (the previous idle time plus `seconds` while
    nothing arrives). Raises ValueError when `after` has no router, or a source of it is not a disagg router."""
    if not after.sources:
        raise ValueError("no router was scraped: a window without routers would read as no load")
    _require(after, (ROUTER_ADMITTED, ROUTER_REJECTED, ROUTER_QUEUE), "a disagg router")
    rejected = round(increase(before, after, ROUTER_REJECTED))
    # The window checks itself (the percentile among the rest) before the quantiles are read at that percentile.
    arrived = arrivals(before, after)
    counted = RouterWindow(seconds=seconds, arrivals=arrived, rejected=rejected,
                           queued=round(_gauge(after, ROUTER_QUEUE) + _gauge(after, ROUTER_PAIR_WAITING)),
                           percentile=percentile,
                           idle_seconds=idle_seconds if idle_seconds is not None else 0.0 if arrived else seconds)
    return replace(counted, ttft_ms=_percentile_ms(histogram_increase(before, after, ROUTER_TTFT), percentile),
                   handoff_ms=_percentile_ms(histogram_increase(before, after, ROUTER_HANDOFF), percentile))


def arrivals(before: Snapshot, after: Snapshot) -> int:
    """Requests the routers took or refused between two scrapes: a window's arrivals (see `router_window`)."""
    return round(increase(before, after, ROUTER_ADMITTED)) + round(increase(before, after, ROUTER_REJECTED))


def _gauge(snapshot: Snapshot, name: str) -> float:
    """The gauge summed over `snapshot`'s sources, each of its values a finite non-negative number."""
    for (source, labels), value in snapshot.gauges.get(name, {}).items():
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{source} exports {name}{dict(labels)} = {value}")
    return snapshot.gauge(name)


# -- the engines -----------------------------------------------------------------------------------------------
def _mean(before: Snapshot, after: Snapshot, name: str) -> float:
    _require(after, (name,), "a vLLM engine")
    gained = histogram_increase(before, after, name)
    return gained.sum / gained.count if gained is not None and gained.count else 0.0


def mean_input_tokens(before: Snapshot, after: Snapshot) -> float:
    """Mean prompt tokens of the requests the prefill engines finished between the scrapes (0 for none): the
    `vllm:request_prompt_tokens` histogram's sum over its count, both gained in the window.

    Not `vllm:prompt_tokens_total` / `vllm:request_success_total`: vLLM observes the histogram once per finished
    request, at the moment it counts it in `request_success_total` (any finished_reason), so sum and count cover the
    same requests; the prompt-token counter counts when the prompt is computed, a window's tokens then belonging to
    other requests than the window's finished ones."""
    return _mean(before, after, PROMPT_TOKENS)


def mean_output_tokens(before: Snapshot, after: Snapshot) -> float:
    """Mean output tokens of the requests the decode engines finished between the scrapes (0 for none), from
    `vllm:request_generation_tokens` as `mean_input_tokens` reads the prompt's. (`vllm:generation_tokens_total`
    counts every token as it is made: over a window shorter than a request, its ratio to the requests finished
    is not a mean of anything.)"""
    return _mean(before, after, GENERATION_TOKENS)


def tpot_ms(before: Snapshot, after: Snapshot, percentile: float) -> float | None:
    """TPOT at `percentile` over the requests the decode engines finished between the scrapes, in ms; None when
    none did. From the first histogram of `TPOT` that any engine in `after` exports (engines that export only a
    later one are left out); ValueError when engines were scraped and none exports any."""
    name = next((n for n in TPOT if n in after.histograms), None)
    if name is None:
        if after.sources:
            raise ValueError(f"no engine of {sorted(after.sources)} exports a TPOT histogram ({', '.join(TPOT)})")
        return None
    return _percentile_ms(histogram_increase(before, after, name), percentile)


def engine_load(snapshot: Snapshot) -> EngineLoad:
    """A role's load at one scrape of its ready engines: `vllm:num_requests_waiting`, `vllm:num_requests_running` and
    `vllm:kv_cache_usage_perc` summed over them (every engine must export all three). A caller that wants the
    window's average averages the loads of several scrapes."""
    _require(snapshot, (WAITING, RUNNING, KV_USAGE), "a vLLM engine")
    return EngineLoad(waiting=_gauge(snapshot, WAITING), running=_gauge(snapshot, RUNNING),
                      kv_usage=_gauge(snapshot, KV_USAGE))


def window(routers: tuple[Snapshot, Snapshot], prefill: tuple[Snapshot, Snapshot],
           decode: tuple[Snapshot, Snapshot], seconds: float, percentile: float, *,
           idle_seconds: float | None = None) -> RouterWindow:
    """The planner's whole window from (before, after) scrapes of the routers and of each role's engines, all taken
    at the same two moments: `router_window` with the prefill engines' mean input tokens and the decode engines'
    mean output tokens and TPOT."""
    w = router_window(*routers, seconds, percentile, idle_seconds=idle_seconds)
    return replace(w, mean_input_tokens=mean_input_tokens(*prefill), mean_output_tokens=mean_output_tokens(*decode),
                   tpot_ms=tpot_ms(*decode, percentile))
