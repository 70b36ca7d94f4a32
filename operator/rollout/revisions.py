"""From a deployment's engine StatefulSets, pods and rendezvous to what the planner reads. Pure.

A revision is the set of engine StatefulSets (one per role) that carry the same `serving.disagg.io/revision`
label; its layout key is their `serving.disagg.io/layout-key` annotation. StatefulSets an operator release before
revisions made (`<cr>-<role>`, without the label) form one revision named LEGACY, whose layout key is the
DISAGG_LAYOUT_KEY its engine container was given: a deployment made by that release rolls onto revisions like
any other change, and keeps serving while it does.

Older revisions drain oldest first (by their StatefulSets' creation, then name).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from disagg.connector.wire import env as wire_env

from .. import names
from ..api import DisaggregatedInferenceSpec
from ..engine_builders import plugin_image_of
from ..meta import timestamp
from .observe import Advertised, revision_state
from .state import Observed, RevisionState, Role, RolloutPolicy, Target

LEGACY = "legacy"
"""The revision of StatefulSets made before revisions existed."""


def policy(spec: DisaggregatedInferenceSpec) -> RolloutPolicy:
    r = spec.rollout
    return RolloutPolicy(max_surge=r.max_surge, max_unavailable=r.max_unavailable, max_skew=r.max_skew,
                         min_available_pairs=r.min_available_pairs, drain_seconds=spec.engine.drain_seconds,
                         startup_seconds=r.startup_seconds or spec.profile.startup_seconds)


def target(spec: DisaggregatedInferenceSpec, revision: str, desired: tuple[int, int] | None = None) -> Target:
    """The spec's revision at `desired` (prefill, decode): the roles' counts (scale/counts.py). Without them, the
    counts a new deployment starts at (what `disagg render` shows)."""
    if desired is None:
        desired = (spec.prefill.initial_replicas, spec.decode.initial_replicas)
    return Target(revision, names.layout_key(spec), *desired)


def _revision_of(sts: Mapping[str, Any]) -> str:
    labels = (sts.get("metadata") or {}).get("labels") or {}
    return str(labels.get(names.LABEL_REVISION) or LEGACY)


def _role_of(sts: Mapping[str, Any]) -> Role | None:
    role = ((sts.get("metadata") or {}).get("labels") or {}).get(names.LABEL_COMPONENT)
    return role if role in ("prefill", "decode") else None


def _layout_of(sts: Mapping[str, Any]) -> str:
    annotated = ((sts.get("metadata") or {}).get("annotations") or {}).get(names.LAYOUT_KEY_ANNOTATION)
    if annotated:
        return str(annotated)
    containers = (((sts.get("spec") or {}).get("template") or {}).get("spec") or {}).get("containers") or []
    for c in containers:
        for e in c.get("env") or []:
            if e.get("name") == wire_env.LAYOUT_KEY and e.get("value"):
                return str(e["value"])
    return ""


@dataclass(frozen=True)
class RevisionSets:
    """One revision's StatefulSets, by role (a role may have none)."""

    name: str
    layout_key: str
    statefulsets: Mapping[Role, Mapping[str, Any]]
    created: float

    def statefulset_name(self, role: Role) -> str | None:
        sts = self.statefulsets.get(role)
        return str(sts["metadata"]["name"]) if sts else None


def group(statefulsets: Iterable[Mapping[str, Any]]) -> list[RevisionSets]:
    """The StatefulSets by revision, oldest revision first."""
    by_rev: dict[str, dict[Role, Mapping[str, Any]]] = {}
    for sts in statefulsets:
        role = _role_of(sts)
        if role is not None:
            by_rev.setdefault(_revision_of(sts), {})[role] = sts
    out = []
    for rev, roles in by_rev.items():
        created = min((timestamp((s.get("metadata") or {}).get("creationTimestamp")) or 0.0) for s in roles.values())
        layout = next((k for k in (_layout_of(s) for s in roles.values()) if k), "")
        out.append(RevisionSets(rev, layout, roles, created))
    return sorted(out, key=lambda r: (r.created, r.name))


def plugin_images(sets: Iterable[RevisionSets]) -> list[tuple[str, str]]:
    """(revision, the plugin image its engines run) of each revision with a plugin init container, newest first:
    what `engine_builders.pinned_revision` matches the spec against."""
    out = []
    for rs in reversed(list(sets)):
        image = next((i for i in map(plugin_image_of, rs.statefulsets.values()) if i), None)
        if image is not None:
            out.append((rs.name, image))
    return out


def observe(spec: DisaggregatedInferenceSpec, revision: str, statefulsets: Iterable[Mapping[str, Any]],
            pods: Iterable[Mapping[str, Any]], advertised: Advertised | None, now: float,
            rollout_policy: RolloutPolicy,
            desired: tuple[int, int] | None = None) -> tuple[Observed, list[RevisionSets]]:
    """The planner's input, and the revisions it names. `desired`: the roles' counts (`target`). `advertised`
    None: the engines never advertise (a vendor connector without the plugin), so Ready counts as advertised. The
    target's revision keeps the target's layout key whatever its StatefulSets say: they are about to be applied
    with it."""
    pods = list(pods)
    sets = group(statefulsets)
    states: list[RevisionState] = []
    for rs in sets:
        layout = names.layout_key(spec) if rs.name == revision else rs.layout_key
        listed = advertised if advertised is not None else _ready_pods(pods)
        states.append(revision_state(rs.name, layout, rs.statefulsets.get("prefill"), rs.statefulsets.get("decode"),
                                     pods, listed, now, rollout_policy.startup_seconds))
    return Observed(target(spec, revision, desired), tuple(states)), sets


def _ready_pods(pods: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """Every pod as if advertised (role_state counts only the Ready ones)."""
    return {str((p.get("metadata") or {}).get("name")): str((p.get("metadata") or {}).get("uid"))
            for p in pods}
