"""Autoscaling planner test helpers: observations from a few numbers, and a steady world that applies each decision
(the new engines come up at once) while the load stays the same."""
from __future__ import annotations

from dataclasses import replace

from disagg.operator.autoscaling.decision import Decision
from disagg.operator.autoscaling.observed import EngineLoad, Observed, RoleObserved, RouterWindow
from disagg.operator.autoscaling.planner import decide
from disagg.operator.autoscaling.policy import AutoscalingPolicy, RolePolicy

# One prefill engine computes 2000 prompt tokens/s at the TTFT target, one decode engine 500 output tokens/s at the
# TPOT target; each role between 1 and 8 engines; scale to zero after 10 minutes idle.
POLICY = AutoscalingPolicy(prefill=RolePolicy(1, 8, 2000), decode=RolePolicy(1, 8, 500), idle_seconds=600)
NO_THROUGHPUT = replace(POLICY, prefill=RolePolicy(1, 8), decode=RolePolicy(1, 8))
LONG_AGO = 10_000.0


def observe(prefill: int = 2, decode: int = 2, *, seconds: float = 60, rps: float = 0, isl: float = 0,
            osl: float = 0, ttft: float | None = None, tpot: float | None = None, rejected: int = 0, queued: int = 0,
            idle: float | None = None, since: float | tuple[float | None, float | None] | None = LONG_AGO,
            starting: tuple[int, int] = (0, 0), kv: tuple[float, float] = (0, 0),
            waiting: tuple[float, float] = (0, 0), running: tuple[float, float] = (0, 0)) -> Observed:
    """Both roles at `prefill` and `decode` engines (all ready but `starting`), a window of `rps` requests per second
    of `isl` prompt and `osl` output tokens, and the engines' totals. Idle for the whole window when nothing
    arrived, else for one second, unless `idle` says otherwise."""
    arrivals = round(rps * seconds)
    window = RouterWindow(seconds=seconds, arrivals=arrivals, rejected=rejected, queued=queued,
                          mean_input_tokens=isl, mean_output_tokens=osl, ttft_ms=ttft, tpot_ms=tpot,
                          idle_seconds=idle if idle is not None else (1.0 if arrivals else seconds))
    since_p, since_d = since if isinstance(since, tuple) else (since, since)
    return Observed(window,
                    RoleObserved(prefill, prefill - starting[0], starting[0], since_p,
                                 EngineLoad(waiting[0], running[0], kv[0])),
                    RoleObserved(decode, decode - starting[1], starting[1], since_d,
                                 EngineLoad(waiting[1], running[1], kv[1])))


def applied(observed: Observed, decision: Decision, elapsed: float) -> Observed:
    """The next observation `elapsed` seconds later, in a world where the decided engines are up at once and the load
    is unchanged: a changed role's clock restarts, an unchanged one's runs on."""
    def role(now: RoleObserved, desired: int) -> RoleObserved:
        if desired != now.desired:
            since: float | None = elapsed
        else:
            since = None if now.seconds_since_scale is None else now.seconds_since_scale + elapsed
        return replace(now, desired=desired, ready=desired, starting=0, seconds_since_scale=since)
    return replace(observed, prefill=role(observed.prefill, decision.prefill.desired),
                   decode=role(observed.decode, decision.decode.desired))


def run_steady(observed: Observed, policy: AutoscalingPolicy, elapsed: float,
               decisions: int) -> tuple[list[tuple[int, int]], Observed]:
    """The counts after each of `decisions` decisions on the same load, `elapsed` seconds apart, and the observation
    after the last one."""
    counts = []
    for _ in range(decisions):
        decision = decide(observed, policy)
        counts.append(decision.counts)
        observed = applied(observed, decision, elapsed)
    return counts, observed
