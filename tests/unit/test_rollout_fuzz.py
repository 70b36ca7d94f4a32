"""Property tests of the rollout planner (hypothesis) over arbitrary observed states: several revisions of one
or two layouts, engines at any stage (starting, ready, advertised, failed, draining, drained) and any policy.
The planner never raises, answers the same twice, returns a well-formed plan whose step breaks no invariant,
says Waiting only while something is in motion, and from any state a healthy world reaches Complete."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from disagg.operator.rollout.planner import plan
from disagg.operator.rollout.simulate import settle
from disagg.operator.rollout.state import ROLES, Observed, RevisionState, RoleState, RolloutPolicy, Target
from disagg.operator.rollout.steps import Blocked, Complete, Progress, Waiting
from support.rollout import _in_motion, checked_steps, violations

KEYS = ["layout-1", "layout-2"]


@st.composite
def role_states(draw: st.DrawFn) -> RoleState:
    replicas = draw(st.integers(0, 6))
    withdrawn = draw(st.integers(0, replicas))
    draining = draw(st.integers(0, withdrawn))
    ordinals = st.frozensets(st.integers(0, replicas - 1)) if replicas else st.just(frozenset[int]())
    ready = draw(ordinals)
    advertised = draw(st.frozensets(st.sampled_from(sorted(ready)))) if ready else frozenset[int]()
    return RoleState(replicas, ready, advertised, draining, withdrawn - draining, draw(ordinals))


@st.composite
def observed_states(draw: st.DrawFn) -> Observed:
    target = Target(draw(st.sampled_from("abc")), draw(st.sampled_from(KEYS)), draw(st.integers(0, 6)),
                    draw(st.integers(0, 6)))
    names = draw(st.lists(st.sampled_from("abc"), unique=True, max_size=3))
    return Observed(target, tuple(
        RevisionState(n, target.layout_key if n == target.name else draw(st.sampled_from(KEYS)),
                      draw(role_states()), draw(role_states())) for n in names))


policies = st.builds(RolloutPolicy, max_surge=st.integers(1, 3), max_unavailable=st.integers(0, 3),
                     max_skew=st.integers(1, 3), min_available_pairs=st.none() | st.integers(0, 4))


def target_failed(observed: Observed) -> bool:
    current = observed.current
    return current is not None and any(
        o < min(observed.target.desired(role), current.role(role).live)
        for role in ROLES for o in current.role(role).failed)


@settings(max_examples=1500)
@given(observed_states(), policies)
def test_any_state_gets_a_well_formed_plan_that_keeps_the_invariants(observed, policy):
    result = plan(observed, policy)
    assert result == plan(observed, policy), "deterministic"
    assert isinstance(result, (Progress, Waiting, Blocked, Complete))
    if isinstance(result, Progress):
        assert result.reason
        assert violations(observed, policy, result.step) == []
    elif isinstance(result, Waiting):
        assert result.reason and _in_motion(observed)
    elif isinstance(result, Blocked):
        assert result.reason
        assert target_failed(observed) or not _in_motion(observed), "blocked although the world is moving"
    else:
        assert [r.name for r in observed.revisions] in ([observed.target.name], [])
    if target_failed(observed):
        assert isinstance(result, Blocked) and "failed" in result.reason


@settings(max_examples=300)
@given(observed_states(), policies)
def test_a_healthy_world_completes_from_any_state(observed, policy):
    checked_steps(settle(observed), policy, paired_only=False)
