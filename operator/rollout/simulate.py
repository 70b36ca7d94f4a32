"""A healthy world for the planner: steps applied as the executor would apply them, then engines starting and
drains finishing as they would when nothing goes wrong. Tests read whole rollouts through it
(`compute_all_steps`); it is also how to see a rollout's steps before running it.
"""
from __future__ import annotations

from dataclasses import replace

from .planner import plan
from .state import Observed, RevisionState, RoleState, RolloutPolicy
from .steps import Blocked, Complete, Drain, Progress, Retire, ScaleDown, ScaleUp, Step, Waiting


class RolloutStuck(RuntimeError):
    """The planner stopped short of Complete in a healthy world, or kept going past the step cap."""


def _role_scaled(state: RoleState, replicas: int) -> RoleState:
    keep = frozenset(range(replicas))
    return replace(state, replicas=replicas, ready=state.ready & keep, advertised=state.advertised & keep,
                   failed=state.failed & keep)


def _role_drained(state: RoleState, keep: int) -> RoleState:
    gone = frozenset(range(keep, state.live))
    return replace(state, draining=state.draining + len(gone), advertised=state.advertised - gone)


def _revision(observed: Observed, name: str) -> RevisionState:
    for rev in observed.revisions:
        if rev.name == name:
            return rev
    raise ValueError(f"no revision {name}")


def _with(observed: Observed, rev: RevisionState) -> Observed:
    return replace(observed, revisions=tuple(rev if r.name == rev.name else r for r in observed.revisions))


def apply(observed: Observed, step: Step) -> Observed:
    """The world right after the executor applied `step`: StatefulSets resized (new pods not Ready yet),
    withdrawn engines out of the rendezvous and draining, retired revisions gone."""
    if isinstance(step, ScaleUp):
        if observed.current is None and step.revision == observed.target.name:
            new = RevisionState(step.revision, observed.target.layout_key)
            observed = replace(observed, revisions=(*observed.revisions, new))
        rev = _revision(observed, step.revision)
        return _with(observed, replace(rev, prefill=_role_scaled(rev.prefill, step.prefill),
                                       decode=_role_scaled(rev.decode, step.decode)))
    if isinstance(step, Drain):
        rev = _revision(observed, step.revision)
        return _with(observed, replace(rev, prefill=_role_drained(rev.prefill, step.prefill),
                                       decode=_role_drained(rev.decode, step.decode)))
    if isinstance(step, ScaleDown):
        rev = _revision(observed, step.revision)
        prefill, decode = (replace(state, drained=state.drained - (state.replicas - replicas))
                           for state, replicas in ((rev.prefill, step.prefill), (rev.decode, step.decode)))
        return _with(observed, replace(rev, prefill=_role_scaled(prefill, step.prefill),
                                       decode=_role_scaled(decode, step.decode)))
    assert isinstance(step, Retire)
    _revision(observed, step.revision)
    return replace(observed, revisions=tuple(r for r in observed.revisions if r.name != step.revision))


def _role_settled(state: RoleState, deletes_withdrawn: bool) -> RoleState:
    live = frozenset(range(state.live))
    settled = replace(state, ready=state.ready | live, advertised=state.advertised | live,
                      failed=state.failed - live, draining=0, drained=state.drained + state.draining)
    if deletes_withdrawn:
        return replace(settled, replicas=state.live, drained=0, ready=settled.ready & live,
                       advertised=settled.advertised & live, failed=settled.failed & live)
    return settled


def settle(observed: Observed, deletes_withdrawn: bool = False) -> Observed:
    """The world once it has caught up: every live engine Ready and advertised, every drain over. With
    `deletes_withdrawn`, the operator's world (observe.py): a drain lowers the StatefulSet's replicas, so a drained
    engine's pod is gone rather than waiting for a ScaleDown."""
    return replace(observed, revisions=tuple(
        replace(r, prefill=_role_settled(r.prefill, deletes_withdrawn),
                decode=_role_settled(r.decode, deletes_withdrawn)) for r in observed.revisions))


def compute_all_steps(initial: Observed, policy: RolloutPolicy, *, max_steps: int | None = None,
                      deletes_withdrawn: bool = False) -> list[Step]:
    """The steps the planner takes from `initial` to Complete, the world settling after each (`settle`). Raises
    RolloutStuck when it waits or blocks in this healthy world, or takes more than `max_steps` (by default
    enough for any rollout that never undoes a step)."""
    if max_steps is None:
        engines = sum(r.role(role).replicas for r in initial.revisions for role in ("prefill", "decode"))
        max_steps = 4 * (engines + initial.target.prefill + initial.target.decode) + 2 * len(initial.revisions) + 4
    observed, steps = settle(initial, deletes_withdrawn), list[Step]()
    while True:
        result = plan(observed, policy)
        if isinstance(result, Complete):
            return steps
        if isinstance(result, (Waiting, Blocked)):
            raise RolloutStuck(f"{type(result).__name__} after {steps}: {result.reason}")
        assert isinstance(result, Progress)
        steps.append(result.step)
        if len(steps) > max_steps:
            raise RolloutStuck(f"more than {max_steps} steps: {steps}")
        observed = settle(apply(observed, result.step), deletes_withdrawn)
