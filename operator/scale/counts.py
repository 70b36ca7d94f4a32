"""Which count each role runs: its DisaggregatedInference's spec.<role>.replicas, or its DisaggregatedRole's
spec.replicas (what /scale writes). Pure.

spec.<role>.replicas is the count the user asked for. It is copied into the role object when it is set and differs
from the value last copied; otherwise the role keeps the role object's count. So applying the same manifest
again (kubectl apply, a GitOps sync), or one without replicas, keeps a count an autoscaler set, and an edit of
replicas in the manifest wins, once.

The value last copied is recorded twice: on the role object (annotation role_api.SPEC_REPLICAS_ANNOTATION, written
in the same request as the count it came with) and in the CR's status.<role>.specReplicas (published after each
pass), which outlives a role object someone deleted. A missing role object is created at the count the role last
ran (status.<role>.desired), or for a CR never reconciled, at spec.<role>.replicas (DEFAULT_ROLE_REPLICAS when unset).

Invariants (tests/unit/test_scale_counts.py):
- a role object's count is kept unless spec.<role>.replicas is set to a value other than the one last copied;
- such a change is the role's count at once, in the same pass that copies it;
- a role object owned by another object (an earlier CR of the same name, being garbage-collected) is never
  written: the role waits for it to go;
- every write is conditional on the object decided from: a create fails if the object exists, an update if it
  changed since (the executor reads it again and decides again), so no scaler's write is overwritten unseen.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..api import DEFAULT_ROLE_REPLICAS, DisaggregatedInferenceStatus
from ..role_api import DisaggregatedRoleStatus
from ..rollout.state import Role


@dataclass(frozen=True)
class LiveRole:
    """A DisaggregatedRole as the apiserver last showed it."""

    name: str
    replicas: int
    spec_replicas: int | None
    """Its record of the spec value last copied (role_api.SPEC_REPLICAS_ANNOTATION); None when it has none."""
    resource_version: str
    generation: int
    owner_uid: str | None
    """The uid of its controller (an owner reference with controller: true), None when nothing controls it."""
    status: DisaggregatedRoleStatus | None = None


@dataclass(frozen=True)
class Remembered:
    """What the CR's status says of a role: the count it last ran and the spec value last copied."""

    desired: int
    spec_replicas: int | None


def remembered(status: DisaggregatedInferenceStatus | None, role: Role) -> Remembered | None:
    """The role as the CR's published status remembers it; None for a CR the operator never reconciled."""
    if status is None or status.observed_generation is None:
        return None
    rs = status.prefill if role == "prefill" else status.decode
    return Remembered(rs.desired, rs.spec_replicas)


@dataclass(frozen=True)
class RoleWrite:
    """Create the role object (`resource_version` None) or update it, only if it is still at `resource_version`:
    its count, its record of the spec value, and the CR as its controller."""

    replicas: int
    spec_replicas: int | None
    resource_version: str | None = None


@dataclass(frozen=True)
class RoleScale:
    """What one role runs, the spec value recorded as last copied, and the write that makes the role object say so
    (None: it already does)."""

    role: Role
    desired: int
    spec_replicas: int | None
    write: RoleWrite | None = None
    reason: str = ""
    """Why the write, in a few words (for the Event)."""


def decide(role: Role, asked: int | None, live: LiveRole | None, memory: Remembered | None,
           owner_uid: str) -> RoleScale:
    """The count role `role` runs, given spec.<role>.replicas (`asked`), its role object as last seen (`live`),
    what the CR's status remembers (`memory`) and the CR's uid."""
    foreign = live is not None and live.owner_uid not in (None, owner_uid)
    seen = None if foreign else live
    record = seen.spec_replicas if seen is not None and seen.spec_replicas is not None else \
        (memory.spec_replicas if memory is not None else None)
    if seen is not None:
        current = seen.replicas
    elif memory is not None:
        current = memory.desired
    else:
        current = DEFAULT_ROLE_REPLICAS
    copy = asked is not None and asked != record
    desired = asked if copy and asked is not None else current
    now_recorded = asked if copy else record
    field = f"spec.{role}.replicas"
    if foreign:
        assert live is not None
        return RoleScale(role, desired, now_recorded, None,
                         f"waiting for {live.name}, controlled by another object, to be deleted")
    if seen is None:
        if copy:
            why = f"at {field} {asked}"
        elif memory is not None:
            why = f"at {desired}, the count the role last ran"
        else:
            why = f"at {desired} ({field} unset)"
        return RoleScale(role, desired, now_recorded, RoleWrite(desired, now_recorded), why)
    if copy:
        was = "unset" if record is None else str(record)
        return RoleScale(role, desired, now_recorded, RoleWrite(desired, now_recorded, seen.resource_version),
                         f"{field} changed from {was} to {asked}")
    if seen.owner_uid is None or seen.spec_replicas != now_recorded:
        return RoleScale(role, desired, now_recorded, RoleWrite(desired, now_recorded, seen.resource_version),
                         f"adopted at its count, {desired}" if seen.owner_uid is None else
                         f"recorded {field} {now_recorded}")
    return RoleScale(role, desired, now_recorded)


def kept(scale: RoleScale, live: LiveRole | None, memory: Remembered | None) -> RoleScale:
    """What the role runs when `scale`'s write was refused: a role object that exists keeps its count and its
    record (the copy is tried again next pass); one that could not be created (its CRD missing, a quota) runs what
    was decided, so the role still follows spec.<role>.replicas."""
    if live is None:
        return RoleScale(scale.role, scale.desired, scale.spec_replicas)
    record = live.spec_replicas if live.spec_replicas is not None else \
        (memory.spec_replicas if memory is not None else None)
    return RoleScale(scale.role, live.replicas, record)
