"""What the autoscaling planner reads: a window summarized from the router's per-request records, observations
that refuse to be inconsistent, and spec.autoscaling mapped to the planner's policy."""
from __future__ import annotations

import pytest

from disagg.operator import api
from disagg.operator.autoscaling.observed import EngineLoad, RoleObserved, RouterWindow
from disagg.operator.autoscaling.policy import AutoscalingPolicy, RolePolicy, from_spec
from disagg.operator.autoscaling.window import RequestSample, percentile, summarize


@pytest.mark.parametrize(("values", "p", "expected"), [
    ([], 90, None), ([5.0], 99, 5.0), ([1.0, 2.0, 3.0, 4.0], 50, 2.0), ([1.0, 2.0, 3.0, 4.0], 75, 3.0),
    ([float(v) for v in range(1, 11)], 90, 9.0), ([float(v) for v in range(10, 0, -1)], 91, 10.0),
])
def test_percentile_is_the_nearest_rank(values, p, expected):
    assert percentile(values, p) == expected


def test_a_window_counts_refusals_as_arrivals_and_takes_means_and_latencies_from_the_served():
    requests = [RequestSample(input_tokens=100 * i, output_tokens=10 * i, ttft_s=0.1 * i, tpot_s=0.01 * i,
                              handoff_s=0.001 * i) for i in range(1, 11)]
    requests += [RequestSample(rejected=True)] * 3
    requests += [RequestSample(finished=False, input_tokens=99_999, ttft_s=5.0)]  # streaming still: no usage yet
    w = summarize(requests, seconds=30, percentile_at=90, queued=2, idle_seconds=0.5)
    assert (w.arrivals, w.rejected, w.queued, w.idle_seconds) == (14, 3, 2, 0.5)
    assert (w.mean_input_tokens, w.mean_output_tokens) == (550, 55)
    assert w.ttft_ms == pytest.approx(1000)  # 11 first tokens, the 10th of them 1.0 s
    assert w.tpot_ms == pytest.approx(90) and w.handoff_ms == pytest.approx(9)
    assert w.arrival_rate == pytest.approx(14 / 30)


def test_an_empty_window_has_no_latencies_and_no_sizes():
    w = summarize([], seconds=60, percentile_at=90, idle_seconds=600)
    assert (w.arrivals, w.mean_input_tokens, w.ttft_ms, w.tpot_ms, w.handoff_ms) == (0, 0, None, None, None)


@pytest.mark.parametrize(("build", "message"), [
    (lambda: RouterWindow(seconds=0, arrivals=0), "seconds must be positive"),
    (lambda: RouterWindow(seconds=60, arrivals=1, rejected=2), "rejected 2 exceeds arrivals 1"),
    (lambda: RouterWindow(seconds=60, arrivals=1, idle_seconds=61), "idle for 61 s"),
    (lambda: RouterWindow(seconds=60, arrivals=0, ttft_ms=-1), "ttft_ms must not be negative"),
    (lambda: RouterWindow(seconds=60, arrivals=0, tpot_ms=float("nan")), "tpot_ms must not be negative"),
    (lambda: RouterWindow(seconds=60, arrivals=0, percentile=100), "percentile"),
    (lambda: EngineLoad(kv_usage=-0.1), "kv_usage"),
    (lambda: RoleObserved(desired=2, ready=2, starting=1), "ready 2 \\+ starting 1 exceed desired 2"),
    (lambda: RoleObserved(desired=2, ready=1, seconds_since_scale=-1), "seconds_since_scale"),
    (lambda: RolePolicy(min_replicas=0, max_replicas=2), "1 <= min_replicas <= max_replicas"),
    (lambda: RolePolicy(min_replicas=3, max_replicas=2), "1 <= min_replicas <= max_replicas"),
    (lambda: RolePolicy(tokens_per_second=0), "tokens_per_second"),
    (lambda: AutoscalingPolicy(down_band=1.0), "down_band"),
    (lambda: AutoscalingPolicy(up_max_step=0), "at least one engine"),
])
def test_inconsistent_observations_and_policies_are_refused(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_the_policy_is_what_spec_autoscaling_says():
    spec = api.AutoscalingSpec.model_validate({
        "prefill": {"minReplicas": 2, "maxReplicas": 6, "inputTokensPerSecond": 4000},
        "decode": {"maxReplicas": 12},
        "slo": {"percentile": 99, "ttftMilliseconds": 500, "tpotMilliseconds": 40},
        "scaleUp": {"maxStep": 2, "cooldownSeconds": 10},
        "scaleDown": {"maxStep": 3, "cooldownSeconds": 600, "utilization": 0.6},
        "scaleToZero": {"idleSeconds": 1800}})
    assert from_spec(spec) == AutoscalingPolicy(
        prefill=RolePolicy(2, 6, 4000), decode=RolePolicy(1, 12, None), percentile=99, ttft_ms=500, tpot_ms=40,
        up_max_step=2, up_cooldown_seconds=10, down_max_step=3, down_cooldown_seconds=600, down_band=0.6,
        idle_seconds=1800)


def test_spec_defaults_make_the_planners_defaults_and_no_scale_to_zero():
    spec = api.AutoscalingSpec.model_validate({"prefill": {"maxReplicas": 1}, "decode": {"maxReplicas": 1}})
    assert from_spec(spec) == AutoscalingPolicy()
