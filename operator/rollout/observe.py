"""What the cluster shows, as the planner reads it: one revision's StatefulSets, their pods and the rendezvous'
engines become a `state.RevisionState`. Pure: objects in (as the apiserver returns them), state out.

Withdrawing engines is lowering a StatefulSet's replicas. The StatefulSet controller then deletes the top
ordinals; each pod gets SIGTERM, its engine leaves the rendezvous at once (the plugin's SIGTERM handler) and vLLM
finishes what it has for `drainSeconds` (`--shutdown-timeout`) before it exits. So a withdrawn engine is a pod at
or above `spec.replicas` that still exists: it is `draining` until it is gone, its own termination being its
drain clock, and nothing is ever `drained` (waiting to be deleted) here.

Per role:
- `replicas`: `spec.replicas`, or one above the highest ordinal that still has a pod if that is more;
- `ready`: ordinals below `spec.replicas` whose pod is Ready and not terminating;
- `advertised`: those of them whose pod the rendezvous lists (by pod name and UID: an entry of an earlier pod of
  the same name does not count);
- `failed`: ordinals below `spec.replicas` whose engine failed (a preflight failure, a crash loop: what
  `status.pod_problems` calls a problem, apart from Unschedulable), or whose pod is older than `startup_seconds`
  and not Ready yet (an unschedulable pod among them).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..meta import timestamp
from ..status import UNSCHEDULABLE, pod_problems
from .state import RevisionState, RoleState

Advertised = Mapping[str, str]
"""Pod name -> pod UID of every engine the rendezvous lists."""


def ordinal(pod_name: str, statefulset: str) -> int | None:
    """A StatefulSet pod's ordinal from its name (`<statefulset>-<ordinal>`), None for any other name."""
    prefix = statefulset + "-"
    if not pod_name.startswith(prefix) or not pod_name[len(prefix):].isdigit():
        return None
    return int(pod_name[len(prefix):])


def pod_ready(pod: Mapping[str, Any]) -> bool:
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in ((pod.get("status") or {}).get("conditions") or []))


def role_state(statefulset: Mapping[str, Any] | None, pods: Iterable[Mapping[str, Any]], advertised: Advertised,
               now: float, startup_seconds: int) -> RoleState:
    """One role of one revision (see the module docstring). `pods` may include other StatefulSets' pods: only
    this one's, by name, count. A StatefulSet that does not exist is a role with nothing."""
    if not statefulset:
        return RoleState()
    name = statefulset["metadata"]["name"]
    spec_replicas = int((statefulset.get("spec") or {}).get("replicas") or 0)
    by_ordinal: dict[int, Mapping[str, Any]] = {}
    for pod in pods:
        o = ordinal((pod.get("metadata") or {}).get("name", ""), name)
        if o is not None:
            by_ordinal[o] = pod
    replicas = max(spec_replicas, max(by_ordinal, default=-1) + 1)
    ready, listed, failed = set(), set(), set()
    for o, pod in by_ordinal.items():
        if o >= spec_replicas:
            continue  # withdrawn: draining until it is gone
        meta = pod.get("metadata") or {}
        if pod_ready(pod):
            ready.add(o)
            if advertised.get(meta.get("name", "")) == meta.get("uid"):
                listed.add(o)
            continue
        created = timestamp(meta.get("creationTimestamp"))
        broken = any(p.reason != UNSCHEDULABLE for p in pod_problems(dict(pod)))
        if broken or (created is not None and now - created > startup_seconds):
            failed.add(o)
    return RoleState(replicas=replicas, ready=frozenset(ready), advertised=frozenset(listed),
                     draining=replicas - spec_replicas, failed=frozenset(failed))


def revision_state(name: str, layout_key: str, prefill: Mapping[str, Any] | None, decode: Mapping[str, Any] | None,
                   pods: Iterable[Mapping[str, Any]], advertised: Advertised, now: float,
                   startup_seconds: int) -> RevisionState:
    pods = list(pods)
    return RevisionState(name, layout_key,
                         prefill=role_state(prefill, pods, advertised, now, startup_seconds),
                         decode=role_state(decode, pods, advertised, now, startup_seconds))
