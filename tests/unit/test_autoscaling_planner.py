"""The autoscaling planner, situation by situation: what each signal makes of a load, the limits on a move (step,
cooldown, range), the hysteresis band, waiting for engines that are starting, and scaling to zero and back."""
from __future__ import annotations

from dataclasses import replace

import pytest

from disagg.operator.autoscaling.decision import Limited, Rescale, Steady, Waiting
from disagg.operator.autoscaling.planner import decide, engines_for
from disagg.operator.autoscaling.policy import RolePolicy
from support.autoscaling import NO_THROUGHPUT, POLICY, observe

NO_ZERO = replace(POLICY, idle_seconds=None)
QUIET = {"rps": 0.1, "isl": 1000, "osl": 100, "ttft": 200, "tpot": 30}  # far below every level

# name: (observation, policy, kind, (prefill, decode), (a prefill reason fragment, a decode reason fragment))
SITUATIONS = {
    "a steady load inside the band stays": (
        observe(2, 2, rps=1, isl=3000, osl=700, ttft=400, tpot=50, kv=(1.0, 1.0)), POLICY,
        Steady, (2, 2), ("steady at 2", "steady at 2")),
    "a step in load is met by the throughput floors in one decision": (
        observe(1, 1, rps=5, isl=1600, osl=200, ttft=300, tpot=40), POLICY,
        Rescale, (4, 2), ("1 → 4: 8000 prompt tokens/s (7538-8462 by the window's 300 arrivals) at 2000 per "
                          "engine calls for 4", "1 → 2: 1000 output tokens/s")),
    "a queue built before the planner saw a step is cleared within the TTFT target": (
        observe(1, 1, rps=1, isl=2000, osl=100, ttft=3000, tpot=40, waiting=(4, 0), queued=2), POLICY,
        Rescale, (5, 1), ("1 → 5 (at most 4 more per decision): 2000 prompt tokens/s (1742-2258 by the window's 60 "
                          "arrivals) and 12000 to clear the waiting requests within the TTFT target at 2000 per "
                          "engine calls for 7", "steady at minReplicas 1")),
    # A 15-s window at a quarter of an engine's load holds about 4 requests; a Poisson burst of 8 reads as 1.07
    # engines' worth, which grew the role and shrank it a minute later at steady load (bench/autoscale.py).
    "a short window's burst at a steady low load adds no engine": (
        observe(1, 1, seconds=15, rps=8 / 15, isl=4000, osl=0, ttft=500, tpot=30), POLICY,
        Steady, (1, 1), ("steady at minReplicas 1", "steady at minReplicas 1")),
    "a step to twice an engine's load shows beyond the deviation in the same short window": (
        observe(1, 1, seconds=15, rps=1, isl=4000, osl=0, ttft=500, tpot=30), POLICY,
        Rescale, (2, 1), ("1 → 2: 4000 prompt tokens/s (2967-5033 by the window's 15 arrivals)",
                          "steady at minReplicas 1")),
    "a short window's lull does not take away an engine the load may still need": (
        observe(2, 1, seconds=15, rps=4 / 15, isl=4000, osl=0, ttft=500, tpot=30), POLICY,
        Steady, (2, 1), ("steady at 2", "steady at minReplicas 1")),
    "growth beyond one step is taken max_step at a time, and never past the maximum": (
        observe(1, 1, rps=10, isl=2000, osl=0, ttft=300, tpot=30), POLICY,
        Rescale, (5, 1), ("1 → 5 (at most 4 more per decision, maxReplicas 8)", "steady at minReplicas 1")),
    "TTFT over its target adds one prefill": (
        observe(2, 2, rps=1, ttft=1500, tpot=80), NO_THROUGHPUT,
        Rescale, (3, 2), ("2 → 3: TTFT p90 1500 ms (target 1000 ms) calls for 3", "steady at 2: TPOT p90 80 ms")),
    "TPOT over its target adds one decode": (
        observe(2, 2, rps=1, ttft=800, tpot=150), NO_THROUGHPUT,
        Rescale, (2, 3), ("steady at 2: TTFT p90 800 ms", "2 → 3: TPOT p90 150 ms (target 100 ms) calls for 3")),
    "KV usage over its level sizes the role in proportion": (
        observe(2, 4, rps=1, ttft=800, tpot=80, kv=(0.5, 3.6)), NO_THROUGHPUT,
        Rescale, (2, 5), ("steady at 2", "4 → 5: KV usage 3.60 engines' worth (level 0.8) calls for 5")),
    "requests waiting in the engines size the role in proportion": (
        observe(2, 2, rps=1, ttft=800, tpot=80, waiting=(22, 0)), NO_THROUGHPUT,
        Rescale, (5, 2), ("2 → 5: 22 requests waiting (level 5 per engine) calls for 5", "steady at 2")),
    "requests the router refused add one engine to each role": (
        observe(2, 2, rps=1, isl=1000, osl=100, ttft=500, tpot=50, rejected=6), POLICY,
        Rescale, (3, 3), ("the router refused 6 of 60 requests (429) calls for 3", "refused 6 of 60")),
    "a hot role at its maximum is Limited": (
        observe(8, 2, rps=1, ttft=1500, tpot=80), NO_THROUGHPUT,
        Limited, (8, 2), ("held at maxReplicas 8: TTFT p90 1500 ms", "steady at 2")),
    "a role that changed recently waits out the scale-up cooldown": (
        observe(2, 2, rps=1, ttft=1500, tpot=80, since=10), NO_THROUGHPUT,
        Steady, (2, 2), ("held at 2: TTFT p90 1500 ms (target 1000 ms) calls for 3; the last change was 10 s ago "
                         "(cooldown 30 s)", "steady at 2")),
    "a low load shrinks each role one engine once the scale-down cooldown is over": (
        observe(4, 4, **QUIET), POLICY,
        Rescale, (3, 3), ("4 → 3: the load fits 1 under the band (0.7)", "4 → 3: the load fits 1")),
    "a low load within the scale-down cooldown holds": (
        observe(4, 4, **QUIET, since=100), POLICY,
        Steady, (4, 4), ("held at 4, though the load fits 1: the last change was 100 s ago (cooldown 300 s)",
                         "cooldown 300 s")),
    "a latency between the band and its target keeps that role from shrinking": (
        observe(4, 4, **{**QUIET, "ttft": 800}), POLICY,
        Rescale, (4, 3), ("steady at 4: TTFT p90 800 ms (target 1000 ms) (shrinking needs 0.7 x target or less)",
                          "4 → 3")),
    "each role shrinks only as far as the band allows with the engines left": (
        observe(4, 4, rps=1, isl=3000, osl=100, ttft=200, tpot=30), replace(POLICY, down_max_step=3),
        Rescale, (3, 1), ("4 → 3: the load fits 3", "4 → 1: the load fits 1")),
    "shrinking stops at minReplicas": (
        observe(1, 1, **QUIET), POLICY,
        Steady, (1, 1), ("steady at minReplicas 1", "steady at minReplicas 1")),
    "requests that reached no first token keep the roles from shrinking": (
        observe(4, 4, rps=0.1), NO_THROUGHPUT,
        Steady, (4, 4), ("no TTFT sample from 6 arrivals", "no TPOT sample from 6 arrivals")),
    "while engines of the last decision start, nothing changes, however hot the load": (
        observe(3, 2, rps=10, isl=2000, ttft=3000, tpot=300, starting=(1, 0)), POLICY,
        Waiting, (3, 2), ("waiting for 1 prefill engines of the last decision to be advertised", "waiting for 1")),
    "a count outside the range is brought inside even while engines start": (
        observe(10, 2, starting=(1, 0)), POLICY,
        Rescale, (8, 2), ("brought inside [minReplicas, maxReplicas]", "waiting for 1 prefill")),
    "idle past the idle window: both roles to zero together": (
        observe(2, 2, idle=700), POLICY,
        Rescale, (0, 0), ("no request for 700 s (scale to zero after 600 s) and none in the engines: both roles "
                          "to 0", "both roles to 0")),
    "idle, but a decode still has a request: no zero": (
        observe(2, 2, idle=700, running=(0, 1)), POLICY,
        Rescale, (1, 1), ("2 → 1", "2 → 1")),
    "idle for less than the idle window: no zero": (
        observe(2, 2, idle=500), POLICY,
        Rescale, (1, 1), ("2 → 1", "2 → 1")),
    "idle with scale to zero off: the minimum stays": (
        observe(1, 1, idle=7000), NO_ZERO,
        Steady, (1, 1), ("steady at minReplicas 1", "steady at minReplicas 1")),
    "at zero, a request arrives: both roles wake to their minimum": (
        observe(0, 0, rps=1 / 60), replace(POLICY, prefill=RolePolicy(2, 8, 2000)),
        Rescale, (2, 1), ("at zero, 1 requests arrived: waking both roles to minReplicas", "waking")),
    "at zero, a request held since before the window wakes both roles": (
        observe(0, 0, queued=1, idle=700), POLICY,
        Rescale, (1, 1), ("at zero, 0 requests arrived, 1 held", "waking")),
    "at zero and quiet: both stay at zero": (
        observe(0, 0, idle=7000), POLICY,
        Steady, (0, 0), ("idle at zero for 7000 s", "idle at zero")),
    "at zero with scale to zero turned off: both roles to their minimum": (
        observe(0, 0, idle=7000), NO_ZERO,
        Rescale, (1, 1), ("scale to zero off", "scale to zero off")),
    "a count above a lowered maximum comes down at once, cooldown or not": (
        observe(10, 2, rps=1, ttft=1500, tpot=80, since=1), NO_THROUGHPUT,
        Rescale, (8, 2), ("10 brought inside [1, 8] as 8; held at maxReplicas 8", "steady at 2")),
    "a role left at zero alone is brought to its minimum": (
        observe(0, 2, rps=1, ttft=800, tpot=80), NO_THROUGHPUT,
        Rescale, (1, 2), ("0 brought inside [1, 8] as 1; steady at 1", "steady at 2")),
}


@pytest.mark.parametrize("name", SITUATIONS)
def test_situation(name):
    observed, policy, kind, counts, (prefill_says, decode_says) = SITUATIONS[name]
    decision = decide(observed, policy)
    assert (type(decision), decision.counts) == (kind, counts), decision
    assert prefill_says in decision.prefill.reason, decision.prefill.reason
    assert decode_says in decision.decode.reason, decision.decode.reason
    assert decide(observed, policy) == decision, "deterministic"


def test_the_estimates_behind_a_decision_are_what_the_metrics_export():
    decision = decide(observe(1, 1, rps=5, isl=1600, osl=200, ttft=300, tpot=40, kv=(0.2, 0.4), waiting=(1, 0),
                              running=(2, 9)), POLICY)
    p, d = decision.prefill.estimate, decision.decode.estimate
    # the floor is the offered load's; what prefill needs adds the waiting request's 1600 tokens within 1 s
    assert (p.demand_tokens_per_second, p.throughput_floor, p.latency_ms, p.needed) == (8000, 4, 300, 5)
    assert (p.kv_usage, p.waiting, p.running) == (0.2, 1, 2)
    assert (d.demand_tokens_per_second, d.throughput_floor, d.latency_ms, d.needed) == (1000, 2, 40, 2)
    without = decide(observe(1, 1, rps=5, isl=1600, ttft=300, tpot=40), NO_THROUGHPUT)
    assert without.prefill.estimate.throughput_floor is None
    # What the load calls for before cooldown, step and range: the quiet load would fit 1, the cooldown holds 4.
    held = decide(observe(4, 4, **QUIET, since=100), POLICY)
    assert held.counts == (4, 4) and held.prefill.estimate.needed == 1


def test_the_window_must_be_at_the_policys_percentile():
    with pytest.raises(ValueError, match="p99.*p90"):
        decide(replace(observe(), window=replace(observe().window, percentile=99)), POLICY)


@pytest.mark.parametrize(("total", "per_engine", "engines"), [
    (0, 1, 0), (1, 1, 1), (1.01, 1, 2), (4000, 2000, 2), (2.1 * 0.8, 0.7 * 0.8 * 3, 1),
    (0.56 * 3, 0.8 * 0.7, 3),  # 1.68 / 0.56 is 3.0000000000000004 in floating point: still 3 engines
])
def test_engines_for_rounds_up_but_not_on_floating_point_noise(total, per_engine, engines):
    assert engines_for(total, per_engine) == engines
