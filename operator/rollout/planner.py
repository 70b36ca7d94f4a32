"""The rollout planner: from one observation of a deployment's revisions, the one next step that moves it toward
the target safely, or why there is none. Pure and deterministic: the same observation gives the same plan, and
nothing is remembered between calls (the executor observes again after each step).

Every pod-template change is a new revision with StatefulSets of its own, whether or not it changes the KV
layout: that is the simpler rule, and always safe. Revisions with equal layout keys are compatible, so their
engines pair across revisions and count together. Scaling (a new `replicas` on either role) is the same
machinery with the target revision already present.

Terms. Per role, a revision's *live* engines are its ordinals not withdrawn; *serving* ones are live and
advertised in the rendezvous: the router pairs only advertised engines, so Ready alone counts for nothing here.
For a layout key k, let P_k and D_k be the serving prefill and decode engines over all revisions with key k.
- pairs = sum over k of min(P_k, D_k): ready, compatible pairs;
- paired prefill = sum of P_k over keys with D_k > 0, paired decode likewise: engines with a compatible peer,
  the ones that add capacity.

Floors (`floors`). With T the target's pairs (min of its desired prefill and decode): the pair floor is
`min_available_pairs`, by default T - `max_unavailable` but at least 1, never above T, 0 when T is 0. Each
role's floor is its desired count scaled as the pair floor scales T (rounded up), so a 4P1D deployment keeps 4
serving prefills, not just one pair's worth.

Skew (`skew`). For desired (P*, D*), a revision's live (p, d) has skew max(0, p - ceil(d·P*/D*),
d - ceil(p·D*/P*)) (a term is 0 when its divisor is), in engines: how many engines of one role run ahead of
what the other role's count calls for. All revisions are measured against the target's ratio.

The algorithm, first match wins:
1. Blocked when the target revision has failed engines among those it keeps (ordinals below the desired count).
2. Delete drained engines (ScaleDown), then retire older revisions with no replicas (Retire).
3. Grow the target revision (ScaleUp) toward the desired counts. Per role, all revisions' replicas together
   stay within desired + `max_surge`; roles with withdrawn engines do not grow. Engines are added one at a
   time, the lagging role first, for as long as every limit holds, so one step adds all that is allowed.
4. Drain (Drain): first the target's engines above the desired counts, then each older revision in turn,
   removing one engine at a time, the leading role first, for as long as every limit holds. A role already
   draining is not drained further until its batch is drained and deleted.
5. Complete when only the target revision is left at exactly the desired replicas, all advertised; Waiting when
   engines are starting or draining (the world will move); Blocked otherwise, with the obstacle.

Invariants (the tests check each against every step returned):
- Floors: a Drain leaves pairs >= min(pair floor, pairs now) and each role's paired engines >= min(role
  floor, paired now), counting the withdrawn ordinals as gone at once. So at least `min_available_pairs`
  ready, compatible pairs serve at every step, and a deployment below its floor (engines crashed) never loses
  more. No other step changes what serves. One exception, for the role floors only: when no drain keeps them
  and nothing is in motion, they count every advertised engine of the role, paired or not. Without it a
  rollout whose older decodes are each the last peer of some prefill (two older revisions, one of the
  target's layout) could never free room for the target's first decode.
- Skew: after a ScaleUp or Drain, the revision it touches has skew <= max(`max_skew`, its skew before): within
  `max_skew` of the spec's ratio, and never further off when it already was (a revision observed off ratio,
  e.g. after a ratio change, only moves back).
- Replacement: an older revision's engines of a role are drained only after the target revision has an advertised
  engine of that role, unless the role's desired count is 0, or only engines above it are drained (older live
  engines of the role stay >= desired), which a scale-down through a rollout needs before it can surge.
- Removal: a pod is deleted (ScaleDown) only when drained: withdrawn from the rendezvous and past its drain.
  Retire only removes an older revision without replicas. The target is never drained below the desired counts.
- Progress: each step only grows the target toward the desired counts, or shrinks a revision toward its end
  (the target to the desired, an older one to nothing), or deletes what was drained. None undoes another, so
  the planner never loops: in a healthy world it reaches Complete.
- Failure: new engines that fail (the executor marks them: not Ready within `startup_seconds`, or Degraded)
  block the rollout before any step, so the older revisions serve on as they are. Until a target engine of a
  role serves, older engines of that role are drained only above the desired count: a rollout whose first new
  engines fail leaves the old revision serving in full. Rolling back is a spec change like any other: the target
  names the older revision again, and the failed one, now older, is drained.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .state import ROLES, Observed, RevisionState, Role, RoleState, RolloutPolicy, Target
from .steps import Blocked, Complete, Drain, Plan, Progress, Retire, ScaleDown, ScaleUp, Waiting

Counts = tuple[int, int]  # (prefill, decode)


@dataclass(frozen=True, slots=True)
class Serving:
    """What the router can use: compatible pairs, and per role the engines that count toward the role floor."""

    pairs: int
    prefill: int
    decode: int

    def role(self, role: Role) -> int:
        return self.prefill if role == "prefill" else self.decode


@dataclass(frozen=True, slots=True)
class Floors:
    pairs: int
    prefill: int
    decode: int

    def role(self, role: Role) -> int:
        return self.prefill if role == "prefill" else self.decode


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def serving(revisions: Iterable[RevisionState], after: Drain | None = None, paired: bool = True) -> Serving:
    """What serves across `revisions`; with `after`, what would serve once that drain withdrew its engines.
    Per role it counts engines with a compatible peer, or with `paired` False every advertised one."""
    by_key: dict[str, list[int]] = {}
    for r in revisions:
        if after is not None and after.revision == r.name:
            p, d = r.prefill.serving_below(after.prefill), r.decode.serving_below(after.decode)
        else:
            p, d = r.prefill.serving, r.decode.serving
        acc = by_key.setdefault(r.layout_key, [0, 0])
        acc[0] += p
        acc[1] += d
    return Serving(pairs=sum(min(p, d) for p, d in by_key.values()),
                   prefill=sum(p for p, d in by_key.values() if d > 0 or not paired),
                   decode=sum(d for p, d in by_key.values() if p > 0 or not paired))


def pairs(revisions: Iterable[RevisionState]) -> int:
    """Ready, compatible pairs: per layout key, the fewer of its advertised prefills and decodes."""
    return serving(revisions).pairs


def floors(target: Target, policy: RolloutPolicy) -> Floors:
    """The least that must serve while moving to `target` (see the module docstring)."""
    total = target.pairs
    if total == 0:
        return Floors(0, 0, 0)
    wanted = policy.min_available_pairs
    floor = min(total, max(total - policy.max_unavailable, 1) if wanted is None else wanted)
    return Floors(floor, _ceil_div(floor * target.prefill, total), _ceil_div(floor * target.decode, total))


def _leads(prefill: int, decode: int, target: Target) -> Counts:
    """How many engines each role runs ahead of what the other role's count calls for at the target's ratio."""
    p_star, d_star = target.prefill, target.decode
    return (prefill - _ceil_div(decode * p_star, d_star) if d_star else 0,
            decode - _ceil_div(prefill * d_star, p_star) if p_star else 0)


def skew(prefill: int, decode: int, target: Target) -> int:
    """How far live (prefill, decode) strays from the target's ratio, in engines (0 on it)."""
    return max(0, *_leads(prefill, decode, target))


def _moves(at: Counts, sign: int, target: Target) -> list[Counts]:
    """Single-engine moves in preference order: growing, the lagging role first; shrinking, the leading one."""
    lead_p, lead_d = _leads(*at, target)
    if lead_p == lead_d:
        order = [(1, 1), (1, 0), (0, 1)]
    elif (lead_p < lead_d) == (sign > 0):
        order = [(1, 0), (1, 1), (0, 1)]
    else:
        order = [(0, 1), (1, 1), (1, 0)]
    return [(sign * dp, sign * dd) for dp, dd in order]


def _walk(start: Counts, sign: int, bound: Counts, target: Target,
          check: Callable[[Counts], str | None]) -> tuple[Counts, str | None]:
    """Move from `start` one engine (or one of each) at a time while `check` passes and `bound` (the most when
    growing, the least when shrinking) holds. Returns where it stopped and, when it could not move at all, why."""
    at = start
    first_obstacle: str | None = None
    while True:
        for move in _moves(at, sign, target):
            nxt = (at[0] + move[0], at[1] + move[1])
            if any(sign * (n - b) > 0 for n, b in zip(nxt, bound, strict=True)):
                continue
            obstacle = check(nxt)
            if obstacle is None:
                at = nxt
                break
            if at == start and first_obstacle is None:
                first_obstacle = obstacle
        else:
            return at, (first_obstacle if at == start else None)


def _live(rev: RevisionState | None) -> Counts:
    return (rev.prefill.live, rev.decode.live) if rev is not None else (0, 0)


def _change(old: Counts, new: Counts) -> str:
    return ", ".join(f"{role} {a}→{b}" for role, a, b in zip(ROLES, old, new, strict=True) if a != b)


def _grow(observed: Observed, policy: RolloutPolicy) -> Progress | None:
    target, current = observed.target, observed.current
    start = _live(current)
    bound: list[int] = []
    for role in ROLES:
        state = current.role(role) if current is not None else RoleState()
        desired = target.desired(role)
        others = sum(r.role(role).replicas for r in observed.older)
        room = desired + policy.max_surge - others
        if state.draining or state.drained or state.live >= desired:
            bound.append(state.live)
        else:
            bound.append(max(state.live, min(desired, room)))
    limit = max(policy.max_skew, skew(*start, target))

    def check(at: Counts) -> str | None:
        s = skew(*at, target)
        return None if s <= limit else f"{target.name} at prefill {at[0]}, decode {at[1]} would be {s} off ratio"

    end, _ = _walk(start, +1, (bound[0], bound[1]), target, check)
    if end == start:
        return None
    replicas = [(current.role(role).replicas if current is not None else 0) + (e - s)
                for role, e, s in zip(ROLES, end, start, strict=True)]
    verb = "scale up" if current is not None else "create"
    return Progress(ScaleUp(target.name, replicas[0], replicas[1]),
                    f"{verb} {target.name} ({_change(start, end)}; desired {target.prefill}P{target.decode}D)")


def _replaced(observed: Observed, rev: RevisionState, keep: Counts) -> str | None:
    """Why draining the older `rev` down to `keep` would remove engines nothing has replaced yet, if it would."""
    current = observed.current
    for role, k in zip(ROLES, keep, strict=True):
        state = rev.role(role)
        desired = observed.target.desired(role)
        if k >= state.live or desired == 0:
            continue
        if current is not None and current.role(role).serving > 0:
            continue
        older_live = sum(r.role(role).live for r in observed.older) - (state.live - k)
        if older_live < desired:
            return f"no {role} engine of {observed.target.name} is advertised yet to replace {rev.name}'s"
    return None


def _drain(observed: Observed, policy: RolloutPolicy, rev: RevisionState, paired: bool) -> Progress | str | None:
    """The drain of `rev` to take now, else why none (None: nothing of it to drain). `paired`: see `serving`."""
    target = observed.target
    is_target = rev.name == target.name
    start = _live(rev)
    least: list[int] = []
    for role in ROLES:
        state = rev.role(role)
        if state.draining:
            least.append(state.live)
        else:
            least.append(min(state.live, target.desired(role)) if is_target else 0)
    if tuple(least) == start:
        return None
    limit = max(policy.max_skew, skew(*start, target))
    now = serving(observed.revisions, paired=paired)
    floor = floors(target, policy)

    def check(at: Counts) -> str | None:
        s = skew(*at, target)
        if s > limit:
            return f"{rev.name} at prefill {at[0]}, decode {at[1]} would be {s} off ratio"
        if not is_target and (why := _replaced(observed, rev, at)) is not None:
            return why
        after = serving(observed.revisions, Drain(rev.name, *at), paired)
        if after.pairs < min(floor.pairs, now.pairs):
            return (f"withdrawing {rev.name}'s {_change(start, at)} would leave {after.pairs} pairs serving, "
                    f"below {min(floor.pairs, now.pairs)}")
        for role in ROLES:
            if after.role(role) < min(floor.role(role), now.role(role)):
                return (f"withdrawing {rev.name}'s {_change(start, at)} would leave {after.role(role)} {role} "
                        f"engines serving, below {min(floor.role(role), now.role(role))}")
        return None

    end, obstacle = _walk(start, -1, (least[0], least[1]), target, check)
    if end == start:
        return obstacle
    why = "above the desired counts" if is_target else f"{target.name} serves in their place"
    if not paired:
        why += ", though some engines are left without a compatible peer"
    return Progress(Drain(rev.name, *end), f"withdraw {rev.name} engines ({_change(start, end)}): {why}")


def _in_motion(observed: Observed) -> list[str]:
    """What the world is still doing that could make a step safe."""
    out = []
    for rev in observed.revisions:
        for role in ROLES:
            state = rev.role(role)
            if state.starting:
                out.append(f"{state.starting} {role} engines of {rev.name} to be advertised")
            if state.draining:
                out.append(f"{state.draining} {role} engines of {rev.name} to drain")
    return out


def _complete(observed: Observed) -> bool:
    target, current = observed.target, observed.current
    if observed.older:
        return False
    if current is None:
        return target.prefill == target.decode == 0
    return all(current.role(role).replicas == current.role(role).live == current.role(role).serving
               == target.desired(role) for role in ROLES)


def plan(observed: Observed, policy: RolloutPolicy) -> Plan:
    """The next step from `observed` toward its target under `policy` (see the module docstring)."""
    target, current = observed.target, observed.current
    if current is not None:
        failed = {role: current.role(role).failed_below(target.desired(role)) for role in ROLES}
        if any(failed.values()):
            names = ", ".join(f"{role} {ordinals}" for role, ordinals in failed.items() if ordinals)
            return Blocked(f"engines of {target.name} failed (ordinals: {names}); older revisions are left serving "
                           "until the spec changes (a fix or a rollback)")
    if _complete(observed):
        return Complete()
    for rev in observed.revisions:
        if rev.prefill.drained or rev.decode.drained:
            keep = (rev.prefill.replicas - rev.prefill.drained, rev.decode.replicas - rev.decode.drained)
            change = _change((rev.prefill.replicas, rev.decode.replicas), keep)
            return Progress(ScaleDown(rev.name, *keep), f"delete {rev.name}'s drained engines ({change})")
    for rev in observed.older:
        if rev.empty:
            return Progress(Retire(rev.name), f"retire {rev.name}: no engines left")
    grow = _grow(observed, policy)
    if grow is not None:
        return grow
    moving = _in_motion(observed)
    obstacles = []
    for paired in (True, False) if not moving else (True,):
        for rev in ([current] if current is not None else []) + list(observed.older):
            drain = _drain(observed, policy, rev, paired)
            if isinstance(drain, Progress):
                return drain
            if drain is not None and paired:
                obstacles.append(drain)
    if moving:
        return Waiting("waiting for " + "; ".join(moving))
    return Blocked("; ".join(obstacles) or "no step is safe")

