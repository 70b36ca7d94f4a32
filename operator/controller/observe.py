"""What status reads of a CR's children, gathered from the indexes: a pure function of what the watches show."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import names
from ..names import Key
from ..rollout.state import Role
from ..scale.counts import RoleScale
from ..status import (
    CreateFailure,
    Observed,
    RolloutView,
    TransportReport,
    create_failure,
    mount_failure,
    ready_may_flip,
    workload_state,
)
from .indexes import Indexes


def _current(statefulsets: list[dict[str, Any]], revision: str | None, role: str) -> dict[str, Any] | None:
    for sts in statefulsets:
        labels = sts["metadata"].get("labels") or {}
        if labels.get(names.LABEL_COMPONENT) == role and labels.get(names.LABEL_REVISION) == revision:
            return sts
    return None


def observe(indexes: Indexes, key: Key, revision: str, statefulsets: list[dict[str, Any]],
            transport: TransportReport | None = None, apply_error: str | None = None,
            rollout: RolloutView | None = None, engine_pods: list[dict[str, Any]] | None = None,
            scales: Mapping[Role, RoleScale] | None = None) -> Observed:
    """Status' view of a CR's children; `prefill` and `decode` are those of `revision`, the current one. A pod's
    problems are what its status shows and, for engine pods, a volume the kubelet cannot mount (its FailedMount
    Events)."""
    namespace = key[0]
    problems = tuple(p for group in (indexes.pod_problem_index.get(key) or ()) for p in group)
    for pod in engine_pods or ():
        seen = indexes.pod_event_index.get((namespace, str((pod.get("metadata") or {}).get("name") or "")))
        if seen and (mount := mount_failure(pod, tuple(seen))) is not None:
            problems += (mount,)
    current = {role: _current(statefulsets, revision, role) for role in names.ENGINE_ROLES}
    roles = {role: workload_state(sts) for role, sts in current.items()}
    failures: list[CreateFailure] = []
    for role, state in roles.items():
        sts = current[role]
        events = tuple(indexes.sts_event_index.get((namespace, sts["metadata"]["name"])) or ()) if sts else ()
        if (message := create_failure(state, events)) is not None:
            failures.append(CreateFailure(role, message))
    return Observed(prefill=roles["prefill"], decode=roles["decode"], router=indexes.workload(key, names.ROUTER),
                    problems=problems, transport=transport, create_failures=tuple(failures), apply_error=apply_error,
                    rollout=rollout, scales={str(role): scale for role, scale in (scales or {}).items()})


def may_turn_ready(indexes: Indexes, key: Key) -> bool:
    """Whether a status pass of this CR may flip Ready (status.ready_may_flip): such a pass is urgent."""
    entry = indexes.entry(key)
    if entry is None or entry.cr is None:
        return False
    engines = [workload_state(sts) for sts in indexes.statefulsets(key)]
    router = indexes.workload(key, names.ROUTER) if entry.cr.spec.router.replicas else None
    return ready_may_flip(entry.cr.status, engines, router)
