"""Property tests of the autoscaling planner (hypothesis) over arbitrary policies, loads and counts: it stays inside
each role's range (or at zero, both roles), more load never gets fewer engines, a steady load settles without
turning back, nothing changes while engines of an earlier decision start, and zero comes only to both roles
together after the idle window."""
from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from disagg.operator.autoscaling.decision import Limited, Rescale, Steady, Waiting
from disagg.operator.autoscaling.observed import EngineLoad, Observed, RoleObserved, RouterWindow
from disagg.operator.autoscaling.planner import decide
from disagg.operator.autoscaling.policy import AutoscalingPolicy, RolePolicy
from disagg.operator.rollout.state import ROLES
from support.autoscaling import run_steady


def often_zero(values: st.SearchStrategy[float]) -> st.SearchStrategy[float]:
    """A reading that is 0 as often as not: idle engines and empty windows are where zero-scaling lives."""
    return st.one_of(st.just(0.0), values)


role_policies = st.builds(lambda low, span, per_engine: RolePolicy(low, low + span, per_engine),
                          st.integers(1, 3), st.integers(0, 6), st.none() | st.floats(100, 5000))
policies = st.builds(AutoscalingPolicy, prefill=role_policies, decode=role_policies,
                     ttft_ms=st.sampled_from([300.0, 1000.0]), tpot_ms=st.sampled_from([30.0, 100.0]),
                     up_max_step=st.integers(1, 4), up_cooldown_seconds=st.sampled_from([0.0, 30.0, 120.0]),
                     down_max_step=st.integers(1, 3), down_cooldown_seconds=st.sampled_from([0.0, 60.0, 300.0]),
                     down_band=st.floats(0.5, 0.9), idle_seconds=st.none() | st.sampled_from([60.0, 600.0]))
latencies = st.none() | st.floats(0, 3000)


@st.composite
def loads(draw: st.DrawFn, quiet: bool = False) -> EngineLoad:
    """What a role's engines export; with `quiet`, no request in them (their KV may still hold cached prefixes)."""
    kv = draw(often_zero(st.floats(0, 8)))
    if quiet:
        return EngineLoad(kv_usage=kv)
    return EngineLoad(draw(often_zero(st.floats(0, 40))), draw(often_zero(st.floats(0, 60))), kv)


@st.composite
def windows(draw: st.DrawFn, quiet: bool = False) -> RouterWindow:
    """A window of load; with `quiet`, no arrival in it, idle for at least its length (often around the policies'
    idle windows of 60 and 600 s), a request held now and then."""
    seconds = draw(st.sampled_from([30.0, 60.0]))
    if quiet:
        idle = draw(st.sampled_from([seconds, 59.0, 60.0, 599.0, 600.0, 601.0]) | st.floats(seconds, 2000))
        return RouterWindow(seconds=seconds, arrivals=0, queued=draw(st.sampled_from([0, 0, 0, 1])),
                            ttft_ms=None, tpot_ms=None, idle_seconds=idle)
    arrivals = draw(st.one_of(st.just(0), st.integers(1, 600)))
    return RouterWindow(
        seconds=seconds, arrivals=arrivals, rejected=draw(st.one_of(st.just(0), st.integers(0, arrivals))),
        queued=draw(st.one_of(st.just(0), st.integers(0, 3))), mean_input_tokens=draw(often_zero(st.floats(0, 4000))),
        mean_output_tokens=draw(often_zero(st.floats(0, 1000))), ttft_ms=draw(latencies), tpot_ms=draw(latencies),
        handoff_ms=draw(latencies),
        idle_seconds=draw(st.floats(0, seconds) if arrivals else st.floats(seconds, 2000)))


@st.composite
def roles(draw: st.DrawFn, desired: int | None = None, starting: bool | None = None, quiet: bool = False,
          within: RolePolicy | None = None) -> RoleObserved:
    """One role; `desired` None: inside `within`'s range three times in four, else anything up to 10; `starting`
    None: engines starting one time in four."""
    if desired is None:
        inside = within is not None and draw(st.integers(0, 3)) > 0
        desired = draw(st.integers(within.min_replicas, within.max_replicas) if within is not None and inside
                       else st.integers(0, 10))
    if starting is None:
        starting = desired > 0 and draw(st.integers(0, 3)) == 0
    start = draw(st.integers(1, desired)) if starting else 0
    return RoleObserved(desired, draw(st.integers(0, desired - start)), start,
                        draw(st.none() | st.floats(0, 400)), draw(loads(quiet)))


@st.composite
def situations(draw: st.DrawFn) -> tuple[Observed, AutoscalingPolicy]:
    """Any policy and observation: scaled to zero one time in four, and quiet (nothing arriving or running) one time
    in three."""
    policy = draw(policies)
    quiet = draw(st.integers(0, 2)) == 0
    if draw(st.integers(0, 3)) == 0:
        return Observed(draw(windows(quiet)), draw(roles(0, quiet=quiet)), draw(roles(0, quiet=quiet))), policy
    return Observed(draw(windows(quiet)), draw(roles(quiet=quiet, within=policy.prefill)),
                    draw(roles(quiet=quiet, within=policy.decode))), policy


def in_range(observed: Observed, policy: AutoscalingPolicy) -> Observed:
    """`observed` with each role's count brought inside the policy's range (its ready and starting engines with it)."""
    def fit(role: RoleObserved, rp: RolePolicy) -> RoleObserved:
        desired = rp.clamp(role.desired)
        starting = min(role.starting, desired)
        return replace(role, desired=desired, starting=starting, ready=min(role.ready, desired - starting))
    return replace(observed, prefill=fit(observed.prefill, policy.prefill), decode=fit(observed.decode, policy.decode))


def idle(observed: Observed, policy: AutoscalingPolicy) -> bool:
    """Scale to zero's conditions, written out again from the policy's definition."""
    w = observed.window
    return (policy.idle_seconds is not None and w.arrivals == 0 and w.queued == 0
            and w.idle_seconds >= policy.idle_seconds
            and all(observed.role(r).load.waiting == observed.role(r).load.running == 0 for r in ROLES))


@given(situations())
def test_counts_stay_inside_each_roles_range_or_both_at_zero(situation):
    observed, policy = situation
    decision = decide(observed, policy)
    if decision.counts == (0, 0):
        assert policy.idle_seconds is not None, "zero with scale to zero off"
        return
    for role in ROLES:
        rp = policy.role(role)
        assert rp.min_replicas <= decision.role(role).desired <= rp.max_replicas, decision.role(role).reason


@given(situations())
def test_every_decision_is_well_formed_and_deterministic(situation):
    observed, policy = situation
    decision = decide(observed, policy)
    assert decide(observed, policy) == decision
    assert decision.prefill.reason and decision.decode.reason
    changed = decision.counts != (observed.prefill.desired, observed.decode.desired)
    assert isinstance(decision, Rescale) == changed
    if isinstance(decision, Waiting):
        assert any(observed.role(role).starting for role in ROLES)
    if isinstance(decision, Limited):
        assert any(decision.role(role).desired == policy.role(role).max_replicas for role in ROLES)
    for role in ROLES:
        estimate = decision.role(role).estimate
        assert estimate.needed >= 0 and estimate.demand_tokens_per_second >= 0


@st.composite
def heavier(draw: st.DrawFn, observed: Observed) -> Observed:
    """`observed` with at least as much load in every reading: more arrivals, refusals and requests held, larger
    requests, higher latencies (a latency with no sample stays without one), fuller engines, less idle. Each reading
    is as it was as often as not, so the readings are also tried one at a time."""
    def more(top: float) -> float:
        return draw(often_zero(st.floats(0, top)))

    def more_int(top: int) -> int:
        return draw(st.one_of(st.just(0), st.integers(0, top)))

    w = observed.window
    arrivals = w.arrivals + more_int(300)
    window = replace(
        w, arrivals=arrivals, rejected=min(arrivals, w.rejected + more_int(50)), queued=w.queued + more_int(3),
        mean_input_tokens=w.mean_input_tokens + more(1000), mean_output_tokens=w.mean_output_tokens + more(1000),
        ttft_ms=None if w.ttft_ms is None else w.ttft_ms + more(1000),
        tpot_ms=None if w.tpot_ms is None else w.tpot_ms + more(1000),
        idle_seconds=min(w.idle_seconds, w.seconds) if arrivals else w.idle_seconds - more(w.idle_seconds))

    def load(role: RoleObserved) -> RoleObserved:
        now = role.load
        return replace(role, load=EngineLoad(now.waiting + more(20), now.running + more(20), now.kv_usage + more(4)))
    return Observed(window, load(observed.prefill), load(observed.decode))


@given(st.data())
def test_more_load_never_means_fewer_engines(data):
    observed, policy = data.draw(situations())
    more = data.draw(heavier(observed))
    light, heavy = decide(observed, policy), decide(more, policy)
    for role in ROLES:
        assert heavy.role(role).desired >= light.role(role).desired, (light.role(role).reason,
                                                                      heavy.role(role).reason)
        # So is what an HPA or KEDA would scale on, before the planner's own cooldowns, steps and range.
        before, after = light.role(role).estimate, heavy.role(role).estimate
        assert after.needed >= before.needed, (light.role(role).reason, heavy.role(role).reason)
        assert after.demand_tokens_per_second >= before.demand_tokens_per_second
        assert (after.throughput_floor or 0) >= (before.throughput_floor or 0)


@given(situations(), st.sampled_from([45.0, 150.0, 400.0]))
def test_a_steady_load_settles_and_never_turns_back(situation, elapsed):
    observed, policy = situation
    observed = replace(observed, prefill=replace(observed.prefill, ready=observed.prefill.desired, starting=0),
                       decode=replace(observed.decode, ready=observed.decode.desired, starting=0))
    # Each move waits out a cooldown of at most 300 s (7 decisions 45 s apart), and there are at most 12 of them:
    # into the range, through it, to zero.
    decided, last = run_steady(observed, policy, elapsed, 100)
    counts = [(observed.prefill.desired, observed.decode.desired), *decided]
    for i, role in enumerate(ROLES):
        moves = {(b[i] > a[i]) - (b[i] < a[i]) for a, b in zip(counts, counts[1:], strict=False)} - {0}
        assert len(moves) <= 1, f"{role} turned back on a steady load: {[c[i] for c in counts]}"
    # Settled: with every cooldown over, the same load asks for the same counts again.
    rested = replace(last, prefill=replace(last.prefill, seconds_since_scale=None),
                     decode=replace(last.decode, seconds_since_scale=None))
    assert decide(rested, policy).counts == counts[-1]


@st.composite
def starting_situations(draw: st.DrawFn) -> tuple[Observed, AutoscalingPolicy]:
    """Counts inside the range with engines of the last decision still starting in at least one role."""
    policy = draw(policies)
    first = draw(st.sampled_from(ROLES))
    counts = {role: draw(st.integers(policy.role(role).min_replicas, policy.role(role).max_replicas))
              for role in ROLES}
    prefill = draw(roles(counts["prefill"], starting=True if first == "prefill" else None))
    decode = draw(roles(counts["decode"], starting=True if first == "decode" else None))
    return Observed(draw(windows()), prefill, decode), policy


@given(starting_situations())
def test_nothing_changes_while_engines_of_an_earlier_decision_start(situation):
    observed, policy = situation
    decision = decide(observed, policy)
    assert isinstance(decision, Waiting)
    assert decision.counts == (observed.prefill.desired, observed.decode.desired)


@given(situations())
def test_zero_comes_only_to_both_roles_together_and_only_after_the_idle_window(situation):
    observed, policy = situation
    decision = decide(observed, policy)
    prefill, decode = decision.counts
    assert (prefill == 0) == (decode == 0), decision
    starting = any(observed.role(role).starting for role in ROLES)
    if not observed.at_zero:
        assert (decision.counts == (0, 0)) == (idle(observed, policy) and not starting), decision
    else:
        w = observed.window
        stays = policy.idle_seconds is not None and w.arrivals == 0 and w.queued == 0
        assert (decision.counts == (0, 0)) == stays
        assert isinstance(decision, Steady if stays else Rescale)


@given(situations())
def test_a_count_brought_inside_the_range_is_decided_as_if_it_had_been_there(situation):
    """Out-of-range counts (a policy changed under them) move into the range and then on exactly as in-range ones."""
    observed, policy = situation
    if observed.at_zero:
        return
    inside = in_range(observed, policy)
    assert decide(observed, policy).counts == decide(inside, policy).counts
