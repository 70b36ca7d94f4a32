"""The autoscaling planner: from one observation (the router's window, each role's engines and counts), both roles'
desired engine counts, each with its reason. Pure and deterministic: the same observation gives the same decision,
and nothing is remembered between calls (the caller passes the time since each role last changed).

Signals. Each role reads its load as signals; each says what count it calls for (`grow_to`, 0 for none) and the
fewest engines that would keep it under the band (`shrink_to`, None when it forbids shrinking):
- throughput (when the policy gives one engine's tokens per second): demand = arrivals per second x mean prompt
  tokens (prefill) or mean output tokens (decode); grow_to = ceil(low / per-engine), shrink_to =
  ceil(high / (per-engine x band)), where low and high are the demand of the window's arrivals less and plus one
  Poisson standard deviation (their square root): a few requests more or fewer than the rate in a short window
  neither add an engine nor take one away, while a step in load soon shows in more arrivals than the deviation.
  Arrivals include refused requests, so the floor counts what was offered.
  Prefill's demand also has its backlog: the requests waiting (in its engines and in the router) x mean prompt
  tokens, to be computed within the TTFT target, so a step in load that built a queue before the planner saw it
  is met with the engines that clear the queue in time, not only those that keep up from then on;
- KV usage and waiting requests, totals over the role's engines against a per-engine level (0.8 of the cache, 5
  waiting): grow_to = ceil(total / level), shrink_to = ceil(total / (level x band)), as the load would spread over
  that many engines (the workload-variant-autoscaler's N-1 check);
- the role's SLO latency (prefill TTFT, decode TPOT) at the policy's percentile: over the target, grow_to = n + 1;
  over band x target, it only forbids shrinking (as do arrivals with no sample: nothing reached that point);
- requests refused by the router (429): grow_to = n + 1 for both roles, and no shrinking.
Latency and refusals step one engine at a time because they do not say by how much the load exceeds the fleet.

The algorithm, first match wins:
1. At zero (both roles 0): a request arriving or held wakes both roles to their minReplicas; with scale to zero off,
   both go to their minReplicas anyway; else both stay at 0.
2. Waiting while engines of an earlier decision are starting: the window does not show their capacity yet. Counts
   outside [min, max] are still brought inside.
3. Both roles to 0 together when scale to zero is on, the router has received nothing for the idle window, holds
   nothing, and no engine has a request.
4. Per role, from n = the current count brought inside [min, max]: if a signal calls for more than n, grow to the
   most any calls for, at most `up_max_step` more and at most maxReplicas, unless the up cooldown holds. Else, if
   every signal allows shrinking and they all fit fewer engines (not fewer than minReplicas), shrink toward that, at
   most `down_max_step` fewer, unless the down cooldown holds. Else stay.

Invariants (tests/unit/test_autoscaling_*.py check each):
- Bounds: each desired count is inside [minReplicas, maxReplicas], or both are 0 (only with scale to zero on).
- Together: a role is 0 only with the other; both go to 0 only after the idle window with nothing arriving, held or
  running.
- Monotone: at equal state, more load (more arrivals, larger requests, higher latencies, more KV, waiting,
  refusals) never gives a role fewer engines, nor a lower estimate of what it needs. Every signal's grow_to and
  shrink_to rise with load, and a role only shrinks when no signal calls for growth.
- Hysteresis: a count reached by growing is not shrunk on the same load, nor the other way round. Growing stops at
  the count where every proportional signal is at or below its level (1); shrinking needs them at or below the band
  (< 1) with the engines that remain, and no step signal over the band. So on a steady load the counts settle and
  never turn back.
- Waiting: while engines of an earlier decision are starting, no count changes (other than into [min, max]).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..rollout.state import ROLES, Role
from .decision import Decision, Limited, Rescale, RoleDecision, RoleEstimate, Steady, Waiting
from .observed import Observed
from .policy import AutoscalingPolicy

_EPSILON = 1e-9  # so 2.0000000000000004 engines is 2, not 3


@dataclass(frozen=True, slots=True)
class Signal:
    """One reading of a role's load and the counts it calls for (see the module docstring)."""

    grow_to: int
    shrink_to: int | None
    reading: str


def engines_for(total: float, per_engine: float) -> int:
    """Fewest engines that carry `total` with at most `per_engine` each."""
    return max(0, math.ceil(total / per_engine - _EPSILON))


def _tokens(role: Role, observed: Observed) -> float:
    w = observed.window
    return w.mean_input_tokens if role == "prefill" else w.mean_output_tokens


def demand(role: Role, observed: Observed) -> float:
    """Offered load in the role's tokens per second."""
    return observed.window.arrival_rate * _tokens(role, observed)


def demand_bounds(role: Role, observed: Observed) -> tuple[float, float]:
    """The offered load the window proves and the load it allows, in the role's tokens per second: its arrivals
    less and plus one Poisson standard deviation (observed.RouterWindow.arrival_rate_bounds)."""
    low, high = observed.window.arrival_rate_bounds()
    return low * _tokens(role, observed), high * _tokens(role, observed)


def backlog(role: Role, observed: Observed, policy: AutoscalingPolicy) -> float:
    """Prefill: the tokens per second that compute the waiting requests' prompts within the TTFT target; decode: 0
    (its waiting requests are mostly legs whose KV is on its way, which more decode engines would not hasten)."""
    if role != "prefill":
        return 0.0
    w = observed.window
    return (observed.role(role).load.waiting + w.queued) * w.mean_input_tokens / (policy.ttft_ms / 1000)


def _proportional(total: float, level: float, band: float, reading: str) -> Signal:
    return Signal(engines_for(total, level), engines_for(total, level * band), reading)


def signals(role: Role, observed: Observed, policy: AutoscalingPolicy, n: int) -> list[Signal]:
    """What the role's load calls for, from `n` engines (see the module docstring)."""
    window, load, band = observed.window, observed.role(role).load, policy.down_band
    out = []
    per_engine = policy.role(role).tokens_per_second
    if per_engine is not None:
        unit = "prompt" if role == "prefill" else "output"
        offered, queue = demand(role, observed), backlog(role, observed, policy)
        low, high = demand_bounds(role, observed)
        reading = (f"{offered:.0f} {unit} tokens/s ({low:.0f}-{high:.0f} by the window's "
                   f"{window.arrivals} arrivals)")
        if queue:
            reading += f" and {queue:.0f} to clear the waiting requests within the TTFT target"
        out.append(Signal(engines_for(low + queue, per_engine), engines_for(high + queue, per_engine * band),
                          f"{reading} at {per_engine:g} per engine"))
    out.append(_proportional(load.kv_usage, policy.kv_usage_high, band,
                             f"KV usage {load.kv_usage:.2f} engines' worth (level {policy.kv_usage_high:g})"))
    out.append(_proportional(load.waiting, policy.waiting_high, band,
                             f"{load.waiting:g} requests waiting (level {policy.waiting_high:g} per engine)"))
    name = "TTFT" if role == "prefill" else "TPOT"
    latency = window.ttft_ms if role == "prefill" else window.tpot_ms
    target = policy.latency_target_ms(role)
    if latency is None:
        reading = f"no {name} sample from {window.arrivals} arrivals"
        out.append(Signal(0, None if window.arrivals else 0, reading))
    else:
        reading = f"{name} p{window.percentile:g} {latency:.0f} ms (target {target:g} ms)"
        if latency > target:
            out.append(Signal(n + 1, None, reading))
        else:
            out.append(Signal(0, None if latency > policy.down_band * target else 0, reading))
    if window.rejected:
        out.append(Signal(n + 1, None,
                          f"the router refused {window.rejected} of {window.arrivals} requests (429)"))
    return out


def _needed(found: list[Signal], n: int) -> int:
    """What `found` calls for from `n`, before cooldowns, steps and the range (RoleEstimate.needed)."""
    grow = max(s.grow_to for s in found)
    if grow > n:
        return grow
    shrinks = [s.shrink_to for s in found]
    if all(s is not None for s in shrinks):
        return min(n, max(s for s in shrinks if s is not None))
    return n


def _estimate(role: Role, observed: Observed, policy: AutoscalingPolicy, found: list[Signal], n: int) -> RoleEstimate:
    load, per_engine = observed.role(role).load, policy.role(role).tokens_per_second
    offered = demand(role, observed)
    return RoleEstimate(
        demand_tokens_per_second=offered,
        throughput_floor=engines_for(offered, per_engine) if per_engine is not None else None,
        latency_ms=observed.window.ttft_ms if role == "prefill" else observed.window.tpot_ms,
        kv_usage=load.kv_usage, waiting=load.waiting, running=load.running, needed=_needed(found, n))


def _cooling(since: float | None, cooldown: float) -> str | None:
    if since is not None and since < cooldown:
        return f"the last change was {since:.0f} s ago (cooldown {cooldown:g} s)"
    return None


def _role(role: Role, observed: Observed, policy: AutoscalingPolicy) -> tuple[RoleDecision, bool]:
    """One role's count by step 4 of the module docstring, and whether its load calls for more than its maximum."""
    rp, since = policy.role(role), observed.role(role).seconds_since_scale
    n = rp.clamp(observed.role(role).desired)
    found = signals(role, observed, policy, n)
    estimate = _estimate(role, observed, policy, found, n)

    def decided(desired: int, reason: str, limited: bool = False) -> tuple[RoleDecision, bool]:
        if n != observed.role(role).desired:
            reason = (f"{observed.role(role).desired} brought inside [{rp.min_replicas}, {rp.max_replicas}] as {n}; "
                      + reason)
        return RoleDecision(desired, reason, estimate), limited

    grow = max(s.grow_to for s in found)
    if grow > n:
        why = "; ".join(f"{s.reading} calls for {s.grow_to}" for s in found if s.grow_to > n)
        if n == rp.max_replicas:
            return decided(n, f"held at maxReplicas {n}: {why}", limited=True)
        if (cooling := _cooling(since, policy.up_cooldown_seconds)) is not None:
            return decided(n, f"held at {n}: {why}; {cooling}", limited=grow > rp.max_replicas)
        to = min(grow, n + policy.up_max_step, rp.max_replicas)
        notes = [f"at most {policy.up_max_step} more per decision"] if grow > n + policy.up_max_step else []
        notes += [f"maxReplicas {rp.max_replicas}"] if grow > rp.max_replicas else []
        return decided(to, f"{n} → {to}" + (f" ({', '.join(notes)})" if notes else "") + f": {why}",
                       limited=grow > rp.max_replicas)
    blockers = [s for s in found if s.shrink_to is None]
    if blockers:
        return decided(n, f"steady at {n}: " + "; ".join(s.reading for s in blockers)
                       + f" (shrinking needs {policy.down_band:g} x target or less)")
    shrink = max(rp.min_replicas, *(s.shrink_to for s in found if s.shrink_to is not None))
    if shrink >= n:
        if n == rp.min_replicas:
            return decided(n, f"steady at minReplicas {n}")
        limiting = [s.reading for s in found if s.shrink_to is not None and s.shrink_to >= n]
        return decided(n, f"steady at {n}: " + "; ".join(limiting) + f" would be above {policy.down_band:g} of "
                       "its level with fewer")
    readings = "; ".join(s.reading for s in found)
    if (cooling := _cooling(since, policy.down_cooldown_seconds)) is not None:
        return decided(n, f"held at {n}, though the load fits {shrink}: {cooling}; {readings}")
    to = max(shrink, n - policy.down_max_step)
    return decided(to, f"{n} → {to}: the load fits {shrink} under the band ({policy.down_band:g}): {readings}")


def _idle(observed: Observed, policy: AutoscalingPolicy) -> bool:
    w = observed.window
    return (policy.idle_seconds is not None and w.arrivals == 0 and w.queued == 0
            and w.idle_seconds >= policy.idle_seconds
            and not any(observed.role(role).load.busy for role in ROLES))


def _both(observed: Observed, policy: AutoscalingPolicy, counts: dict[Role, int],
          reason: str) -> dict[Role, RoleDecision]:
    """Both roles set to `counts` for one shared reason, with their estimates."""
    out = {}
    for role in ROLES:
        n = counts[role]
        found = signals(role, observed, policy, n)
        out[role] = RoleDecision(n, reason, _estimate(role, observed, policy, found, n))
    return out


def decide(observed: Observed, policy: AutoscalingPolicy) -> Decision:
    """Both roles' desired counts from `observed` under `policy` (see the module docstring)."""
    w = observed.window
    if w.percentile != policy.percentile:
        raise ValueError(f"the window's latencies are at p{w.percentile:g}, the policy's SLO at "
                         f"p{policy.percentile:g}")
    mins: dict[Role, int] = {role: policy.role(role).min_replicas for role in ROLES}
    if observed.at_zero:
        if w.arrivals or w.queued:
            held = f", {w.queued} held" if w.queued else ""
            d = _both(observed, policy, mins,
                      f"at zero, {w.arrivals} requests arrived{held}: waking both roles to minReplicas")
            return Rescale(d["prefill"], d["decode"])
        if policy.idle_seconds is None:
            d = _both(observed, policy, mins, "at zero with scale to zero off: both roles to minReplicas")
            return Rescale(d["prefill"], d["decode"])
        zero: dict[Role, int] = {"prefill": 0, "decode": 0}
        d = _both(observed, policy, zero, f"idle at zero for {w.idle_seconds:.0f} s")
        return Steady(d["prefill"], d["decode"])
    starting = [f"{observed.role(role).starting} {role}" for role in ROLES if observed.role(role).starting]
    if starting:
        clamped = {role: policy.role(role).clamp(observed.role(role).desired) for role in ROLES}
        moved = any(clamped[role] != observed.role(role).desired for role in ROLES)
        why = f"waiting for {' and '.join(starting)} engines of the last decision to be advertised"
        d = _both(observed, policy, clamped, why + ("; brought inside [minReplicas, maxReplicas]" if moved else ""))
        return (Rescale if moved else Waiting)(d["prefill"], d["decode"])
    if _idle(observed, policy):
        d = _both(observed, policy, {"prefill": 0, "decode": 0},
                  f"no request for {w.idle_seconds:.0f} s (scale to zero after {policy.idle_seconds:g} s) and none "
                  "in the engines: both roles to 0")
        return Rescale(d["prefill"], d["decode"])
    (prefill, limit_p), (decode, limit_d) = (_role(role, observed, policy) for role in ROLES)
    if (prefill.desired, decode.desired) != (observed.prefill.desired, observed.decode.desired):
        return Rescale(prefill, decode)
    return (Limited if limit_p or limit_d else Steady)(prefill, decode)
