"""Rollout planner test helpers: observed states from counts, and the planner's invariants checked against a
step, written out again here from their definitions (not imported from the planner), so a planner bug cannot
hide behind its own helpers."""
from __future__ import annotations

from collections.abc import Iterator

from disagg.operator.rollout.planner import plan
from disagg.operator.rollout.simulate import apply, compute_all_steps, settle
from disagg.operator.rollout.state import ROLES, Observed, RevisionState, RoleState, RolloutPolicy, Target
from disagg.operator.rollout.steps import Drain, Progress, Retire, ScaleDown, ScaleUp, Step

OLD_KEY, NEW_KEY = "layout-1", "layout-2"


def rev(name: str, prefill: int | RoleState, decode: int | RoleState, key: str = OLD_KEY) -> RevisionState:
    """A revision; a count means that many engines, all ready and advertised."""
    p = prefill if isinstance(prefill, RoleState) else RoleState.counted(prefill)
    d = decode if isinstance(decode, RoleState) else RoleState.counted(decode)
    return RevisionState(name, key, p, d)


def rollout(old: tuple[int, int], new: tuple[int, int], key: str = NEW_KEY) -> Observed:
    """Revision `a` serving `old`, target revision `b` wanting `new`, with layout `key`."""
    return Observed(Target("b", key, *new), (rev("a", *old),))


def scaling(old: tuple[int, int], new: tuple[int, int]) -> Observed:
    """Revision `a` serving `old`, the spec asking `a` for `new`."""
    return Observed(Target("a", OLD_KEY, *new), (rev("a", *old),))


def _serving(revisions: tuple[RevisionState, ...], paired: bool) -> tuple[int, int, int]:
    """(pairs, prefill, decode) over live, advertised engines; `paired`: only engines with a compatible peer."""
    per_key: dict[str, tuple[int, int]] = {}
    for r in revisions:
        p = len([o for o in r.prefill.advertised if o < r.prefill.replicas - r.prefill.draining - r.prefill.drained])
        d = len([o for o in r.decode.advertised if o < r.decode.replicas - r.decode.draining - r.decode.drained])
        kp, kd = per_key.get(r.layout_key, (0, 0))
        per_key[r.layout_key] = (kp + p, kd + d)
    return (sum(min(p, d) for p, d in per_key.values()), sum(p for p, d in per_key.values() if d or not paired),
            sum(d for p, d in per_key.values() if p or not paired))


def _floors(target: Target, policy: RolloutPolicy) -> tuple[int, int, int]:
    total = min(target.prefill, target.decode)
    if total == 0:
        return 0, 0, 0
    floor = policy.min_available_pairs if policy.min_available_pairs is not None else \
        max(1, total - policy.max_unavailable)
    floor = min(floor, total)
    return floor, -(-floor * target.prefill // total), -(-floor * target.decode // total)


def _skew(p: int, d: int, target: Target) -> int:
    worst = 0
    if target.decode:
        worst = max(worst, p - -(-d * target.prefill // target.decode))
    if target.prefill:
        worst = max(worst, d - -(-p * target.decode // target.prefill))
    return worst


def _live(r: RevisionState | None) -> tuple[int, int]:
    if r is None:
        return 0, 0
    return tuple(s.replicas - s.draining - s.drained for s in (r.prefill, r.decode))  # type: ignore[return-value]


def _in_motion(observed: Observed) -> bool:
    for r in observed.revisions:
        for s in (r.prefill, r.decode):
            live = s.replicas - s.draining - s.drained
            if s.draining or any(o not in s.advertised and o not in s.failed for o in range(live)):
                return True
    return False


def violations(observed: Observed, policy: RolloutPolicy, step: Step, paired_only: bool = False) -> list[str]:
    """Every invariant `step` breaks when taken from `observed`. `paired_only`: the role floors count only
    engines with a compatible peer, even where the planner may fall back to counting every advertised one."""
    out: list[str] = []
    target = observed.target
    by_name = {r.name: r for r in observed.revisions}
    current = by_name.get(target.name)
    if current is not None and any(o < min(target.desired(role), _live(current)[i])
                                   for i, role in enumerate(ROLES) for o in current.role(role).failed):
        out.append("a step while target engines failed")
    if isinstance(step, Retire):
        r = by_name.get(step.revision)
        if r is None or r.name == target.name or r.prefill.replicas or r.decode.replicas:
            out.append(f"retire of {step.revision}, which is missing, the target or has replicas")
        return out
    counts = (step.prefill, step.decode)
    r = by_name.get(step.revision)
    if r is None:
        if not (isinstance(step, ScaleUp) and step.revision == target.name):
            out.append(f"{type(step).__name__} of missing revision {step.revision}")
            return out
        r = RevisionState(target.name, target.layout_key)
    states = (r.prefill, r.decode)
    if isinstance(step, ScaleDown):
        if not all(s.replicas - s.drained <= c <= s.replicas for s, c in zip(states, counts, strict=True)):
            out.append(f"scale-down of {step.revision} removes ordinals that are not drained")
        if counts == tuple(s.replicas for s in states):
            out.append("scale-down that changes nothing")
        return out
    before_live = _live(r)
    if isinstance(step, ScaleUp):
        if step.revision != target.name:
            out.append(f"scale-up of {step.revision}, not the target")
        if any(c < s.replicas for s, c in zip(states, counts, strict=True)) or \
                counts == tuple(s.replicas for s in states):
            out.append("scale-up that shrinks or changes nothing")
        after_live = tuple(c - s.draining - s.drained for s, c in zip(states, counts, strict=True))
        for i, role in enumerate(ROLES):
            s = states[i]
            if counts[i] > s.replicas:
                if s.draining or s.drained:
                    out.append(f"{role} grown while it has withdrawn ordinals")
                if counts[i] > target.desired(role):
                    out.append(f"{role} grown past the desired {target.desired(role)}")
                others = sum(o.role(role).replicas for o in observed.revisions if o.name != target.name)
                if others + counts[i] > target.desired(role) + policy.max_surge:
                    out.append(f"{role}: {others} older + {counts[i]} replicas exceed desired + max_surge")
    else:
        assert isinstance(step, Drain)
        after_live = counts
        if any(c > live for c, live in zip(counts, before_live, strict=True)) or counts == before_live:
            out.append("drain that grows or changes nothing")
        for i, role in enumerate(ROLES):
            if counts[i] >= before_live[i]:
                continue
            if states[i].draining or states[i].drained:
                out.append(f"{role} of {r.name} drained again before its last batch was deleted")
            if r.name == target.name and counts[i] < target.desired(role):
                out.append(f"target {role} drained below the desired {target.desired(role)}")
            if r.name != target.name and target.desired(role) > 0:
                new_serving = 0 if current is None else len(
                    [o for o in current.role(role).advertised if o < _live(current)[i]])
                older_live = sum(_live(o)[i] for o in observed.revisions if o.name != target.name) \
                    - (before_live[i] - counts[i])
                if new_serving == 0 and older_live < target.desired(role):
                    out.append(f"older {role} drained below the desired before a target {role} serves")
        after = apply(observed, step)
        floors = _floors(target, policy)

        def below(paired: bool) -> list[str]:
            now, then = _serving(observed.revisions, paired), _serving(after.revisions, paired)
            return [f"{what} serving {a} -> {b}, floor {f}" for what, f, a, b
                    in zip(("pairs", "prefill", "decode"), floors, now, then, strict=True) if b < min(f, a)]

        # Unpaired engines count toward the role floors only when nothing is in motion (the planner's fallback).
        if below(paired=True) and (paired_only or _in_motion(observed) or below(paired=False)):
            out.extend(below(paired=True))
    limit = max(policy.max_skew, _skew(*before_live, target))
    if _skew(*after_live, target) > limit:
        out.append(f"{r.name} skew {_skew(*after_live, target)} > {limit} at {after_live}")
    return out


def checked_steps(initial: Observed, policy: RolloutPolicy, paired_only: bool = True,
                  deletes_withdrawn: bool = False) -> list[Step]:
    """`compute_all_steps`, with every step checked against the state it was planned from, and the plan of
    each state the world passes through before it settles (engines starting, drains running) checked too.
    `deletes_withdrawn`: the operator's world, where a drain's pods are deleted (simulate.settle)."""
    steps = compute_all_steps(initial, policy, deletes_withdrawn=deletes_withdrawn)
    observed = settle(initial, deletes_withdrawn)
    for step in steps:
        bad = violations(observed, policy, step, paired_only)
        assert not bad, f"{step} from {observed}: {bad}"
        unsettled = apply(observed, step)
        early = plan(unsettled, policy)
        if isinstance(early, Progress):
            bad = violations(unsettled, policy, early.step, paired_only)
            assert not bad, f"{early.step} from {unsettled}: {bad}"
        observed = settle(unsettled, deletes_withdrawn)
    final = observed
    assert [r.name for r in final.revisions] in ([final.target.name], []), final
    for r in final.revisions:
        assert (len(r.prefill.advertised), len(r.decode.advertised)) == (final.target.prefill, final.target.decode)
    return steps


def sizes(top: int = 5) -> Iterator[tuple[int, int]]:
    return ((p, d) for p in range(top + 1) for d in range(top + 1))
