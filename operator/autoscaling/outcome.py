"""What one planner decision means for a CR: the role counts to write, the status to publish and the events to
emit. Pure: the executor reads the roles' counts and the CR's status, calls `decide` and then `outcome`, and applies
what comes back (it writes the counts into the roles' DisaggregatedRole objects, conditionally, like any scaler).

Invariants (tests/unit/test_autoscaling_outcome.py):
- a count is written only for a role whose decided count differs from the one it runs; nothing else writes;
- a role's last_scale_time moves exactly when its count changes: written by the planner, or found different from
  the count the role ran after the previous decision (`current`: kubectl scale, an HPA); so the planner's cooldowns
  (fed by `seconds_since_scale`) count from the last real change, whoever made it, and a recommendation that nobody
  follows does not restart them;
- not `apply` (spec.autoscaling.mode Recommend): nothing is written and no event is posted; the status and the
  cooldown clocks are kept as above;
- the status is published when what a reader acts on changed (the decision's kind, a role's count, need or scale
  time), and otherwise at most every STATUS_REFRESH_SECONDS;
- events mark transitions, never a repeat: one `Scaled` per count written (with the reason), `ScaledToZero` and
  `WokeFromZero` when both roles go to 0 or leave it, and one `ScaleLimited` warning when a role first hits its
  maximum (or its reason changes while held there), so a steady load adds no event.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from ..api import AutoscalingStatus, RoleAutoscalingStatus
from ..rollout.state import ROLES, Role
from .decision import Decision, Limited


@dataclass(frozen=True, slots=True)
class Event:
    type: str
    """Normal or Warning."""
    reason: str
    message: str


STATUS_REFRESH_SECONDS = 60.0
"""status.autoscaling is written again at least this often while nothing in it but the reasons' readings moves."""


@dataclass(frozen=True, slots=True)
class Outcome:
    writes: dict[Role, int]
    """The count to write per role whose count changes (through its DisaggregatedRole's /scale)."""
    status: AutoscalingStatus
    """status.autoscaling after the decision."""
    events: tuple[Event, ...]
    publish: bool = True
    """Whether to write `status`: its decision, counts, needs or scale times changed, or the one stored is
    STATUS_REFRESH_SECONDS old. The reasons quote the window's readings, which move at every tick; writing them
    each time would be a status write per CR per tick."""


def _stamp(t: datetime) -> str:
    return t.isoformat().replace("+00:00", "Z")


def _of(status: AutoscalingStatus | None, role: Role) -> RoleAutoscalingStatus | None:
    return None if status is None else status.prefill if role == "prefill" else status.decode


def seconds_since_scale(status: AutoscalingStatus | None, role: Role, now: datetime) -> float | None:
    """Seconds since `role`'s count last changed, for the planner's cooldowns; None when it never has."""
    rs = _of(status, role)
    if rs is None or rs.last_scale_time is None:
        return None
    return max(0.0, (now - datetime.fromisoformat(rs.last_scale_time.replace("Z", "+00:00"))).total_seconds())


def _changed_since(before: RoleAutoscalingStatus | None, running: int) -> bool:
    """Whether the role's count moved since the previous decision, by someone else's hand."""
    if before is None:
        return False
    seen = before.current if before.current is not None else before.desired  # a status from before `current`
    return seen != running


def outcome(decision: Decision, running: dict[Role, int], previous: AutoscalingStatus | None,
            now: datetime, apply: bool = True) -> Outcome:
    """`running`: each role's count as its DisaggregatedRole says now (what the planner observed as desired).
    `now`: timezone-aware. Not `apply` (spec.autoscaling.mode Recommend): nothing is written and no scaling event
    is posted; the status and the cooldown clocks follow the counts someone else sets."""
    at = _stamp(now)
    writes = {role: decision.role(role).desired for role in ROLES
              if decision.role(role).desired != running[role]} if apply else {}
    events: list[Event] = []
    roles: dict[Role, RoleAutoscalingStatus] = {}
    for role in ROLES:
        d = decision.role(role)
        before = _of(previous, role)
        moved = role in writes or _changed_since(before, running[role])
        last = at if moved else None if before is None else before.last_scale_time
        roles[role] = RoleAutoscalingStatus(desired=d.desired, needed=d.estimate.needed, reason=d.reason,
                                            last_scale_time=last, current=writes.get(role, running[role]))
        if role in writes:
            events.append(Event("Normal", "Scaled", f"{role} {running[role]} → {d.desired}: {d.reason}"))
    at_zero_before = all(running[r] == 0 for r in ROLES)
    at_zero_after = all(decision.role(r).desired == 0 for r in ROLES)
    if writes and at_zero_after and not at_zero_before:
        events.append(Event("Normal", "ScaledToZero", "both roles scaled to 0 after the idle window; the router holds "
                            "the next request until a pair is up"))
    if writes and at_zero_before and not at_zero_after:
        events.append(Event("Normal", "WokeFromZero", f"a request came: prefill → {decision.prefill.desired}, "
                            f"decode → {decision.decode.desired}"))
    if isinstance(decision, Limited) and apply:
        for role in ROLES:
            d, before = decision.role(role), _of(previous, role)
            held = d.estimate.needed > d.desired
            if held and (previous is None or previous.decision != "Limited" or before is None
                         or before.reason != d.reason):
                events.append(Event("Warning", "ScaleLimited", f"{role}: {d.reason}"))
    status = AutoscalingStatus(decision=type(decision).__name__, last_decision_time=at, prefill=roles["prefill"],
                               decode=roles["decode"])
    return Outcome(writes, status, tuple(events), _publish(previous, status, now))


def _moved(status: AutoscalingStatus) -> tuple[object, ...]:
    """What a reader acts on: all but the time and the reasons."""
    return (status.decision,
            *((r.desired, r.needed, r.last_scale_time, r.current) for r in (status.prefill, status.decode)))


def _publish(previous: AutoscalingStatus | None, status: AutoscalingStatus, now: datetime) -> bool:
    if previous is None or previous.last_decision_time is None or _moved(previous) != _moved(status):
        return True
    written = datetime.fromisoformat(previous.last_decision_time.replace("Z", "+00:00"))
    return (now - written).total_seconds() >= STATUS_REFRESH_SECONDS
