"""The rollout planner, case by case: whole rollouts as literal step sequences (the world settling after each
step), the measures it keeps (pairs, floors, skew), and the ways a rollout stops: new engines starting
(Waiting), failing (Blocked, the old revision untouched), and a rollback converging."""
from __future__ import annotations

from dataclasses import replace

import pytest

from disagg.operator.rollout.planner import floors, pairs, plan, skew
from disagg.operator.rollout.simulate import RolloutStuck, apply, compute_all_steps, settle
from disagg.operator.rollout.state import Observed, RevisionState, RoleState, RolloutPolicy, Target
from disagg.operator.rollout.steps import Blocked, Complete, Drain, Progress, Retire, ScaleDown, ScaleUp, Waiting
from support.rollout import NEW_KEY, OLD_KEY, checked_steps, rev, rollout, scaling, violations


def swap(p: int, d: int) -> list:
    """One matched swap of the old revision `a` for the new `b`: surge b, withdraw a, delete a's drained."""
    return [Drain("a", p, d), ScaleDown("a", p, d)]


SEQUENCES = {
    "1P1D": (rollout((1, 1), (1, 1)), RolloutPolicy(), [
        ScaleUp("b", 1, 1), *swap(0, 0), Retire("a")]),
    "1P1D surge 2": (rollout((1, 1), (1, 1)), RolloutPolicy(max_surge=2), [
        ScaleUp("b", 1, 1), *swap(0, 0), Retire("a")]),
    "2P1D": (rollout((2, 1), (2, 1)), RolloutPolicy(), [
        ScaleUp("b", 1, 1), *swap(1, 1),
        ScaleUp("b", 2, 1), *swap(0, 0), Retire("a")]),
    "2P1D surge 2": (rollout((2, 1), (2, 1)), RolloutPolicy(max_surge=2), [
        ScaleUp("b", 2, 1), *swap(0, 0), Retire("a")]),
    "4P4D": (rollout((4, 4), (4, 4)), RolloutPolicy(), [
        ScaleUp("b", 1, 1), *swap(3, 3),
        ScaleUp("b", 2, 2), *swap(2, 2),
        ScaleUp("b", 3, 3), *swap(1, 1),
        ScaleUp("b", 4, 4), *swap(0, 0), Retire("a")]),
    "4P4D surge 2": (rollout((4, 4), (4, 4)), RolloutPolicy(max_surge=2), [
        ScaleUp("b", 2, 2), *swap(2, 2),
        ScaleUp("b", 4, 4), *swap(0, 0), Retire("a")]),
    # One pair may be down: once b's first pair serves, a gives up two.
    "4P4D unavailable 1": (rollout((4, 4), (4, 4)), RolloutPolicy(max_unavailable=1), [
        ScaleUp("b", 1, 1), *swap(2, 2),
        ScaleUp("b", 3, 3), *swap(0, 0), Retire("a"),
        ScaleUp("b", 4, 4)]),
    "4P4D surge 2 unavailable 2": (rollout((4, 4), (4, 4)), RolloutPolicy(max_surge=2, max_unavailable=2), [
        ScaleUp("b", 2, 2), *swap(0, 0), Retire("a"),
        ScaleUp("b", 4, 4)]),
    "4P4D at least 2 pairs": (rollout((4, 4), (4, 4)), RolloutPolicy(min_available_pairs=2), [
        ScaleUp("b", 1, 1), *swap(1, 1),
        ScaleUp("b", 4, 4), *swap(0, 0), Retire("a")]),
    # Equal layout keys: a and b pair across revisions; with the default policy the steps are the same.
    "4P4D same layout": (rollout((4, 4), (4, 4), key=OLD_KEY), RolloutPolicy(), [
        ScaleUp("b", 1, 1), *swap(3, 3),
        ScaleUp("b", 2, 2), *swap(2, 2),
        ScaleUp("b", 3, 3), *swap(1, 1),
        ScaleUp("b", 4, 4), *swap(0, 0), Retire("a")]),
    # A prefill-heavy ratio: the 4 prefills are replaced one by one, a's decode goes last, so neither role ever
    # has less than it had.
    "4P1D": (rollout((4, 1), (4, 1)), RolloutPolicy(), [
        ScaleUp("b", 1, 1), *swap(3, 1),
        ScaleUp("b", 2, 1), *swap(2, 1),
        ScaleUp("b", 3, 1), *swap(1, 1),
        ScaleUp("b", 4, 1), *swap(0, 0), Retire("a")]),
    # Growing through a rollout: room for all of b at once (4 = 1 old + 4 new - max_surge).
    "1P1D to 4P4D": (rollout((1, 1), (4, 4)), RolloutPolicy(), [
        ScaleUp("b", 4, 4), *swap(0, 0), Retire("a")]),
    # Shrinking through a rollout: a first gives up what the target does not want, then swaps.
    "4P4D to 2P2D": (rollout((4, 4), (2, 2)), RolloutPolicy(), [
        *swap(2, 2),
        ScaleUp("b", 1, 1), *swap(1, 1),
        ScaleUp("b", 2, 2), *swap(0, 0), Retire("a")]),
    "first deployment": (Observed(Target("a", OLD_KEY, 4, 4)), RolloutPolicy(), [
        ScaleUp("a", 4, 4)]),
    "scale up": (scaling((2, 2), (4, 4)), RolloutPolicy(), [
        ScaleUp("a", 4, 4)]),
    "scale down": (scaling((4, 4), (2, 2)), RolloutPolicy(), [
        Drain("a", 2, 2), ScaleDown("a", 2, 2)]),
    "scale to zero": (scaling((4, 4), (0, 0)), RolloutPolicy(), [
        Drain("a", 0, 0), ScaleDown("a", 0, 0)]),
    # A new ratio in place: decodes are added before prefills go, so capacity never dips.
    "scale to 2P6D": (scaling((4, 4), (2, 6)), RolloutPolicy(), [
        ScaleUp("a", 4, 6), Drain("a", 2, 6), ScaleDown("a", 2, 6)]),
}


@pytest.mark.parametrize("name", SEQUENCES)
def test_whole_rollout_step_by_step(name):
    initial, policy, expected = SEQUENCES[name]
    assert checked_steps(initial, policy) == expected


def test_max_unavailable_never_takes_a_serving_deployment_to_zero_pairs():
    one_pair = rollout((2, 1), (2, 1))
    assert compute_all_steps(one_pair, RolloutPolicy(max_unavailable=1)) == SEQUENCES["2P1D"][2]
    assert floors(one_pair.target, RolloutPolicy(max_unavailable=5)).pairs == 1
    assert floors(one_pair.target, RolloutPolicy(min_available_pairs=0)).pairs == 0, "said explicitly, it may"


def test_floors_default_scale_and_cap():
    four = Target("b", NEW_KEY, 4, 4)
    assert floors(four, RolloutPolicy()) == type(floors(four, RolloutPolicy()))(4, 4, 4)
    assert floors(four, RolloutPolicy(max_unavailable=1)).pairs == 3
    assert floors(four, RolloutPolicy(min_available_pairs=9)).pairs == 4, "never above the target's pairs"
    ratio = floors(Target("b", NEW_KEY, 2, 6), RolloutPolicy(max_unavailable=1))
    assert (ratio.pairs, ratio.prefill, ratio.decode) == (1, 1, 3), "roles keep the pair floor's share"
    assert floors(Target("b", NEW_KEY, 3, 0), RolloutPolicy()).pairs == 0


def test_pairs_count_across_revisions_of_one_layout_only():
    half = RoleState.counted(2)
    prefill_only = RevisionState("a", OLD_KEY, half, RoleState())
    decode_same = RevisionState("b", OLD_KEY, RoleState(), half)
    decode_other = RevisionState("c", NEW_KEY, RoleState(), half)
    assert pairs([prefill_only, decode_same]) == 2
    assert pairs([prefill_only, decode_other]) == 0
    starting = RevisionState("d", OLD_KEY, RoleState.counted(2, ready=2, advertised=1), half)
    assert pairs([starting]) == 1, "Ready is not enough: the router pairs advertised engines"
    withdrawn = RevisionState("e", OLD_KEY, RoleState.counted(2, draining=1), half)
    assert pairs([withdrawn]) == 1, "a draining engine no longer serves"


def test_skew_is_in_engines_against_the_target_ratio():
    assert [skew(p, d, Target("b", NEW_KEY, 1, 1)) for p, d in [(1, 1), (2, 1), (1, 3), (0, 0)]] == [0, 1, 2, 0]
    four_to_one = Target("b", NEW_KEY, 4, 1)
    assert [skew(p, d, four_to_one) for p, d in [(1, 0), (1, 1), (4, 1), (6, 1), (0, 1), (0, 2)]] == \
        [1, 0, 0, 2, 1, 2]
    assert skew(3, 3, Target("b", NEW_KEY, 4, 0)) == 3, "no decode wanted: every decode is off ratio"


def test_states_refuse_inconsistency():
    with pytest.raises(ValueError, match="not ready"):
        RoleState(2, ready=frozenset({0}), advertised=frozenset({1}))
    with pytest.raises(ValueError, match="outside"):
        RoleState(2, failed=frozenset({2}))
    with pytest.raises(ValueError, match="exceed"):
        RoleState(2, draining=2, drained=1)
    with pytest.raises(ValueError, match="layout"):
        Observed(Target("a", NEW_KEY, 1, 1), (rev("a", 1, 1),))
    with pytest.raises(ValueError, match="repeat"):
        Observed(Target("b", NEW_KEY, 1, 1), (rev("a", 1, 1), rev("a", 1, 1)))
    for bad in ({"max_surge": 0}, {"max_skew": 0}, {"max_unavailable": -1}, {"min_available_pairs": -1}):
        with pytest.raises(ValueError):
            RolloutPolicy(**bad)


def test_the_invariant_checker_catches_bad_steps():
    """The exhaustive and property tests are only as good as `violations`: it must flag each kind of breach."""
    policy = RolloutPolicy()
    mid = settle(apply(rollout((4, 4), (4, 4)), ScaleUp("b", 1, 1)))
    assert violations(mid, policy, Drain("a", 3, 3)) == []
    assert violations(mid, policy, Drain("a", 2, 2)), "pairs below the floor"
    assert violations(mid, policy, Drain("a", 3, 2)) and violations(mid, policy, Drain("a", 4, 2)), \
        "decode below its floor"
    assert violations(mid, policy, ScaleUp("b", 2, 2)), "past max_surge"
    assert violations(mid, policy, ScaleDown("a", 3, 3)), "deleting engines that were never drained"
    assert violations(mid, policy, Retire("a")), "retiring a revision with engines"
    assert violations(mid, policy, ScaleUp("a", 5, 5)), "growing an older revision"
    fresh = rollout((4, 4), (4, 4))
    assert violations(fresh, RolloutPolicy(max_unavailable=1), Drain("a", 3, 3)), \
        "draining the old revision before a new engine serves"
    assert violations(scaling((4, 4), (2, 2)), policy, Drain("a", 1, 1)), "target below the desired"
    assert violations(scaling((4, 4), (4, 4)), RolloutPolicy(max_skew=2), Drain("a", 4, 1)), "off ratio"


def test_new_engines_starting_wait_and_the_old_revision_stays_whole():
    started = apply(rollout((4, 4), (4, 4)), ScaleUp("b", 1, 1))
    waiting = plan(started, RolloutPolicy(max_unavailable=1))
    assert isinstance(waiting, Waiting), waiting
    assert "engines of b to be advertised" in waiting.reason
    ready_not_advertised = replace(started, revisions=(started.revisions[0], rev(
        "b", RoleState(1, ready=frozenset({0})), RoleState(1, ready=frozenset({0})), key=NEW_KEY)))
    assert isinstance(plan(ready_not_advertised, RolloutPolicy()), Waiting), "Ready alone does not replace"


def failed_revision(name: str, prefill: int, decode: int, *, working: int, key: str = NEW_KEY) -> RevisionState:
    """A revision whose ordinals from `working` up never become Ready."""
    def role(n: int) -> RoleState:
        return RoleState.counted(n, ready=min(n, working), failed=max(0, n - working))
    return RevisionState(name, key, role(prefill), role(decode))


def test_new_engines_that_fail_block_and_leave_the_old_revision_in_full():
    old = rev("a", 4, 4)
    for policy in (RolloutPolicy(), RolloutPolicy(max_unavailable=3), RolloutPolicy(max_surge=4)):
        first = compute_all_steps(rollout((4, 4), (4, 4)), policy)[0]
        assert isinstance(first, ScaleUp)
        failed = Observed(Target("b", NEW_KEY, 4, 4),
                          (old, failed_revision("b", first.prefill, first.decode, working=0)))
        blocked = plan(failed, policy)
        assert isinstance(blocked, Blocked), blocked
        assert "engines of b failed" in blocked.reason and "prefill [0" in blocked.reason
    one_role = Observed(Target("b", NEW_KEY, 4, 4), (old, rev(
        "b", RoleState.counted(1), RoleState.counted(1, ready=0, failed=1), key=NEW_KEY)))
    assert isinstance(plan(one_role, RolloutPolicy()), Blocked), "one failed role is enough"
    # Even a drain that finished before the failure waits: nothing of the old revision moves while blocked.
    drained_old = RevisionState("a", OLD_KEY, RoleState.counted(4, drained=1), RoleState.counted(4, drained=1))
    mid = Observed(Target("b", NEW_KEY, 4, 4), (drained_old, failed_revision("b", 2, 2, working=1)))
    assert isinstance(plan(mid, RolloutPolicy()), Blocked)


def test_failed_engines_of_an_older_revision_or_above_the_desired_do_not_block():
    broken_old = Observed(Target("b", NEW_KEY, 2, 2), (failed_revision("a", 2, 2, working=1, key=OLD_KEY),))
    result = plan(broken_old, RolloutPolicy())
    assert isinstance(result, Progress) and result.step == ScaleUp("b", 1, 1), "failed pods still take room"
    surged = settle(apply(broken_old, result.step))
    surged = replace(surged, revisions=(broken_old.revisions[0], surged.revisions[1]))
    result = plan(surged, RolloutPolicy())
    assert isinstance(result, Progress) and result.step == Drain("a", 1, 1), "a's failed top ordinal costs nothing"
    # The user scales back down to get rid of pods that never started.
    over = Observed(Target("a", OLD_KEY, 2, 2), (failed_revision("a", 4, 4, working=2, key=OLD_KEY),))
    result = plan(over, RolloutPolicy())
    assert isinstance(result, Progress) and result.step == Drain("a", 2, 2), result
    assert isinstance(plan(Observed(over.target, (failed_revision("a", 4, 4, working=1, key=OLD_KEY),)),
                           RolloutPolicy()), Blocked), "a failed engine the target keeps still blocks"


def _broken(state: RoleState, working: int) -> RoleState:
    never = frozenset(range(working, state.live))
    return replace(state, ready=state.ready - never, advertised=state.advertised - never, failed=state.failed | never)


def run(observed: Observed, policy: RolloutPolicy, broken: str, working: int, cap: int = 50) -> list:
    """Steps until the plan is not Progress (its last item) or Complete (left out), in a world where revision
    `broken`'s live ordinals from `working` up never start."""
    steps: list = []
    for _ in range(cap):
        result = plan(observed, policy)
        if isinstance(result, Complete):
            return steps
        if not isinstance(result, Progress):
            return [*steps, result]
        steps.append(result.step)
        observed = settle(apply(observed, result.step))
        observed = replace(observed, revisions=tuple(
            replace(r, prefill=_broken(r.prefill, working), decode=_broken(r.decode, working))
            if r.name == broken else r for r in observed.revisions))
    raise AssertionError(f"no end after {cap} steps: {steps}")


def test_a_rollout_that_fails_halfway_blocks_then_rolls_back():
    policy = RolloutPolicy()
    forward = run(rollout((4, 4), (4, 4)), policy, broken="b", working=2)
    assert forward[:-1] == SEQUENCES["4P4D"][2][:7], "two pairs of b serve, then its third fails to start"
    assert isinstance(forward[-1], Blocked) and "ordinals: prefill [2], decode [2]" in forward[-1].reason
    # The world at that point: a at 2P2D, b's third engines failed. The spec goes back to a.
    stuck = rollout((4, 4), (4, 4))
    for step in forward[:-1]:
        stuck = settle(apply(stuck, step))
    stuck = replace(stuck, revisions=(stuck.revisions[0], failed_revision("b", 3, 3, working=2)))
    back = replace(stuck, target=Target("a", OLD_KEY, 4, 4))
    steps = run(back, policy, broken="b", working=2)
    assert steps == [
        Drain("b", 2, 2),  # b's failed engines serve nothing: gone without a floor to keep
        ScaleDown("b", 2, 2),
        ScaleUp("a", 3, 3), Drain("b", 1, 1), ScaleDown("b", 1, 1),
        ScaleUp("a", 4, 4), Drain("b", 0, 0), ScaleDown("b", 0, 0), Retire("b")]


def test_rolling_back_while_the_old_revision_drains_waits_for_the_drain():
    """Withdrawn engines are not taken back: the drain finishes, they are deleted, and the rollback regrows."""
    mid = settle(apply(rollout((4, 4), (4, 4)), ScaleUp("b", 1, 1)))
    draining = apply(mid, Drain("a", 3, 3))
    back = replace(draining, target=Target("a", OLD_KEY, 4, 4))
    waiting = plan(back, RolloutPolicy())
    assert isinstance(waiting, Waiting) and "engines of a to drain" in waiting.reason
    assert compute_all_steps(back, RolloutPolicy()) == [
        ScaleDown("a", 3, 3), ScaleUp("a", 4, 4), Drain("b", 0, 0), ScaleDown("b", 0, 0), Retire("b")]


def test_rolling_forward_again_over_a_half_done_rollout_drains_both_older_revisions():
    policy = RolloutPolicy()
    half = rollout((4, 4), (4, 4))
    for step in SEQUENCES["4P4D"][2][:6]:
        half = settle(apply(half, step))
    third = replace(half, target=Target("c", "layout-3", 4, 4))
    steps = checked_steps(third, policy)
    assert steps[-1] in (Retire("a"), Retire("b")) and Retire("a") in steps and Retire("b") in steps
    assert [s for s in steps if isinstance(s, ScaleUp)][-1] == ScaleUp("c", 4, 4)


def test_the_step_cap_fails_loudly():
    with pytest.raises(RolloutStuck, match="more than 2 steps"):
        compute_all_steps(rollout((4, 4), (4, 4)), RolloutPolicy(), max_steps=2)


def test_the_plan_is_complete_only_at_the_target():
    assert isinstance(plan(scaling((2, 1), (2, 1)), RolloutPolicy()), Complete)
    assert isinstance(plan(Observed(Target("a", OLD_KEY, 0, 0)), RolloutPolicy()), Complete)
    one_down = Observed(Target("a", OLD_KEY, 2, 1), (rev("a", RoleState.counted(2, ready=1), 1),))
    assert isinstance(plan(one_down, RolloutPolicy()), Waiting), "an engine restarting is not the target yet"


def test_older_decodes_that_are_each_the_last_peer_of_a_prefill_still_make_room():
    """Every decode is some prefill's only peer and they fill decode's surge room: no drain keeps each role's
    paired engines, so once nothing is in motion the role floors count unpaired engines too (found by the
    property tests)."""
    observed = Observed(Target("b", NEW_KEY, 2, 1), (rev("a", 1, 1, key=OLD_KEY), rev("c", 0, 1, key=NEW_KEY)))
    assert checked_steps(observed, RolloutPolicy(), paired_only=False) == [
        ScaleUp("b", 1, 0),  # pairs with c's decode, same layout
        Drain("a", 1, 0), ScaleDown("a", 1, 0),  # a's prefill is left without a peer for one swap
        ScaleUp("b", 2, 1), *swap(0, 0), Retire("a"),
        Drain("c", 0, 0), ScaleDown("c", 0, 0), Retire("c")]
    stuck = settle(apply(observed, ScaleUp("b", 1, 0)))
    result = plan(stuck, RolloutPolicy())
    assert isinstance(result, Progress) and "without a compatible peer" in result.reason
    a, c, b = stuck.revisions
    moving = replace(stuck, revisions=(a, replace(c, prefill=RoleState(1, draining=1)), b))
    assert isinstance(plan(moving, RolloutPolicy()), Waiting), "no fallback while anything is in motion"
