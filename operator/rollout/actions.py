"""A planned step as the writes that make it true. Pure: the executor (rollout_executor.py) performs them.

- ScaleUp: the target revision's StatefulSets are server-side applied whole at the planned replicas (this also
  creates them), so the operator owns every field of the revision it is rolling to.
- Drain, ScaleDown: only `spec.replicas` changes, through the scale subresource, on whichever revision: an older
  revision's pod template cannot be rebuilt from today's spec, and must not change. Lowering replicas is the
  withdrawal (observe.py): the StatefulSet controller deletes the top ordinals, which leave the rendezvous and
  drain on SIGTERM.
- Retire: the revision's StatefulSets and its launch ConfigMap are deleted (their pods are already gone).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .. import names
from .revisions import LEGACY, RevisionSets
from .state import ROLES, Role
from .steps import Drain, Retire, ScaleDown, ScaleUp, Step


@dataclass(frozen=True)
class Apply:
    obj: dict[str, Any]


@dataclass(frozen=True)
class Scale:
    statefulset: str
    replicas: int


@dataclass(frozen=True)
class Delete:
    kind: str  # StatefulSet or ConfigMap
    name: str


Action = Apply | Scale | Delete
BuildStatefulSet = Callable[[Role, int], dict[str, Any]]
"""The target revision's StatefulSet of a role at some replicas (engine_builders.engine_statefulset)."""


def _spec_replicas(sts: Mapping[str, Any] | None) -> int:
    return int(((sts or {}).get("spec") or {}).get("replicas") or 0)


def actions(step: Step, cr: str, sets: list[RevisionSets], build: BuildStatefulSet) -> list[Action]:
    """The writes for `step` on CR `cr`, whose revisions' StatefulSets are `sets`. A role already at its count is
    left alone."""
    rev = next((r for r in sets if r.name == step.revision), None)
    if isinstance(step, ScaleUp):
        out: list[Action] = []
        for role in ROLES:
            want = step.prefill if role == "prefill" else step.decode
            have = rev.statefulsets.get(role) if rev else None
            if have is None or _spec_replicas(have) != want:
                out.append(Apply(build(role, want)))
        return out
    if isinstance(step, (Drain, ScaleDown)):
        if rev is None:
            raise ValueError(f"no StatefulSets of revision {step.revision}")
        out = []
        for role in ROLES:
            want = step.prefill if role == "prefill" else step.decode
            sts = rev.statefulsets.get(role)
            if sts is not None and _spec_replicas(sts) != want:
                out.append(Scale(str(sts["metadata"]["name"]), want))
        return out
    assert isinstance(step, Retire)
    if rev is None:
        return []
    deletes: list[Action] = [Delete("StatefulSet", str(s["metadata"]["name"])) for s in rev.statefulsets.values()]
    launch = f"{cr}-launch" if rev.name == LEGACY else names.launch_configmap_name(cr, rev.name)
    return [*deletes, Delete("ConfigMap", launch)]


def describe(step: Step) -> str:
    """One line for an Event."""
    if isinstance(step, Retire):
        return f"retire revision {step.revision}"
    verb = {ScaleUp: "scale up", Drain: "drain", ScaleDown: "scale down"}[type(step)]
    return f"{verb} revision {step.revision} to {step.prefill}P{step.decode}D"
