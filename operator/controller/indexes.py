"""kopf's indexes of what the operator watches: every pass and loop reads the cluster from them, never with a list
call. kopf keeps them current from its watches.

Every kind indexed here is namespaced. kopf types `namespace` as str | None for any resource; an object without one
(never seen: it would be cluster-scoped) is left out of the indexes.
"""
from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import kopf
from pydantic import ValidationError

from .. import api, names, role_api
from ..meta import timestamp
from ..names import Key
from ..rollout.state import Role
from ..scale.counts import LiveRole
from ..scale.objects import live_role
from ..status import (
    FAILED_CREATE,
    FAILED_MOUNT,
    SUCCESSFUL_CREATE,
    PodCreateEvent,
    PodEvent,
    PodProblem,
    WorkloadState,
    pod_problems,
    workload_state,
)

MANAGED = {names.LABEL_MANAGED_BY: names.MANAGED_BY}
CR = (api.GROUP, api.VERSION, api.PLURAL)
ROLE_OBJECTS = (api.GROUP, api.VERSION, role_api.PLURAL)
WorkloadKey = tuple[str, str, str]  # (namespace, CR name, component) of a StatefulSet or Deployment


@dataclass(frozen=True)
class IndexedCR:
    """A DisaggregatedInference as the watch last saw it: parsed once per change, so every pass and loop reads
    the typed spec. `cr` is None exactly when the stored object does not parse (`error` says why)."""

    body: kopf.Body  # a snapshot; what Events are posted against
    cr: api.DisaggregatedInference | None
    error: str | None = None

    @property
    def deleting(self) -> bool:
        return bool(self.body.metadata.get("deletionTimestamp"))


def parse_cr(raw: kopf.RawBody) -> IndexedCR:
    try:
        return IndexedCR(kopf.Body(raw), api.DisaggregatedInference.model_validate(raw))
    except ValidationError as e:
        return IndexedCR(kopf.Body(raw), None, _first_error(e))


DinfIndex = kopf.Index[Key, IndexedCR]
StsIndex = kopf.Index[Key, dict[str, Any]]  # (namespace, CR name): its engine StatefulSets (statefulset_view)
PodIndex = kopf.Index[Key, dict[str, Any]]  # (namespace, CR name): its engine pods
WorkloadIndex = kopf.Index[WorkloadKey, WorkloadState]
PodProblemIndex = kopf.Index[Key, tuple[PodProblem, ...]]  # (namespace, CR name): one tuple per pod with problems
StsEventIndex = kopf.Index[Key, PodCreateEvent]  # (namespace, StatefulSet name)
PodEventIndex = kopf.Index[Key, PodEvent]  # (namespace, engine pod name)
RoleIndex = kopf.Index[Key, tuple[Role, LiveRole]]  # (namespace, CR name): its DisaggregatedRole objects


def dinf_index(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict[Key, IndexedCR] | None:
    if namespace is None:
        return None
    # A shallow copy of the watched object, which kopf replaces in place, without its managedFields: nothing
    # reads them, and the index keeps one copy per CR for as long as the operator runs. The cast: RawBody is
    # kopf's type for an object as the apiserver sends it (its RawMeta names only the metadata fields kopf reads).
    metadata = {k: v for k, v in body.metadata.items() if k != "managedFields"}
    raw = cast(kopf.RawBody, {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
                              "metadata": metadata, "spec": dict(body.spec),
                              "status": dict(body.get("status") or {})})
    return {(namespace, name): parse_cr(raw)}


def sts_index(namespace: str | None, labels: kopf.Labels, body: kopf.Body,
              **_: Any) -> dict[Key, dict[str, Any]] | None:
    """Every engine StatefulSet of a CR, every revision's, as the rollout and status read them."""
    if namespace is None or labels.get(names.LABEL_COMPONENT) not in names.ENGINE_ROLES:
        return None
    return {(namespace, labels.get(names.LABEL_INSTANCE, "")): statefulset_view(body)}


def _copied(meta: Mapping[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {k: copy.deepcopy(meta.get(k)) for k in keys}


def statefulset_view(body: Mapping[str, Any]) -> dict[str, Any]:
    """What the rollout and status read of a StatefulSet (a copy: kopf updates its bodies in place). Of the pod
    template only the containers' env (the layout key of a StatefulSet made before revisions) and the init
    containers' images (the plugin a revision runs, which an upgraded operator keeps)."""
    meta, spec = body.get("metadata") or {}, body.get("spec") or {}
    pod_spec = (spec.get("template") or {}).get("spec") or {}
    return {
        "metadata": _copied(meta, ("name", "uid", "generation", "labels", "annotations", "creationTimestamp")),
        "spec": {"replicas": spec.get("replicas"), "template": {"spec": {
            "initContainers": [{"name": c.get("name"), "image": c.get("image")}
                               for c in pod_spec.get("initContainers") or []],
            "containers": [{"name": c.get("name"), "env": copy.deepcopy(c.get("env") or [])}
                           for c in pod_spec.get("containers") or []]}}},
        "status": copy.deepcopy(dict(body.get("status") or {})),
    }


def engine_pod_index(namespace: str | None, labels: kopf.Labels, body: kopf.Body,
                     **_: Any) -> dict[Key, dict[str, Any]] | None:
    """Every engine pod of a CR: the rollout reads readiness, age and failures per ordinal."""
    if namespace is None or labels.get(names.LABEL_COMPONENT) not in names.ENGINE_ROLES:
        return None
    meta = body.get("metadata") or {}
    return {(namespace, labels.get(names.LABEL_INSTANCE, "")): {
        "metadata": _copied(meta, ("name", "uid", "labels", "creationTimestamp", "deletionTimestamp")),
        "status": copy.deepcopy(dict(body.get("status") or {})),
    }}


def deploy_index(namespace: str | None, labels: kopf.Labels, body: kopf.Body,
                 **_: Any) -> dict[WorkloadKey, WorkloadState] | None:
    if namespace is None:
        return None
    key = (namespace, labels.get(names.LABEL_INSTANCE, ""), labels.get(names.LABEL_COMPONENT, ""))
    return {key: workload_state(dict(body))}


def pod_problem_index(namespace: str | None, labels: kopf.Labels, body: kopf.Body,
                      **_: Any) -> dict[Key, tuple[PodProblem, ...]] | None:
    """A pod's problems while it has some. A pod without (any more) is `{}`: kopf keeps what an indexer returned
    for an object before when it returns None, so a pod that recovered would stay failed."""
    if namespace is None:
        return None
    problems = pod_problems(dict(body))
    return {(namespace, labels.get(names.LABEL_INSTANCE, "")): tuple(problems)} if problems else {}


def _event_time(body: Mapping[str, Any]) -> float:
    """When an Event last happened: its series' last observation, else lastTimestamp (events.k8s.io:
    deprecatedLastTimestamp), else eventTime, else its creation."""
    stamp = ((body.get("series") or {}).get("lastObservedTime") or body.get("lastTimestamp")
             or body.get("deprecatedLastTimestamp") or body.get("eventTime")
             or (body.get("metadata") or {}).get("creationTimestamp"))
    return timestamp(stamp) or 0.0


def sts_event_index(namespace: str | None, body: kopf.Body, **_: Any) -> dict[Key, PodCreateEvent] | None:
    """The StatefulSet controller's pod-creation Events, by (namespace, StatefulSet name)."""
    if namespace is None or body.get("reason") not in (FAILED_CREATE, SUCCESSFUL_CREATE):
        return None
    involved = body.get("involvedObject") or {}
    return {(namespace, involved.get("name", "")): PodCreateEvent(
        str(involved.get("uid") or ""), str(body.get("reason")), str(body.get("message") or ""), _event_time(body))}


# The kubelet's FailedMount Events, read through the events.k8s.io API: the same Event objects as core/v1's, which
# the operator already watches with the field selector involvedObject.kind=StatefulSet. kopf watches a resource
# once, with one selector, and a field selector cannot say "StatefulSet, or a Pod's FailedMount"; another API
# group is another watch with its own server-side selector, reason=FailedMount (only pods have volumes to mount).
# So the operator receives no other pod Event of the cluster, and of FailedMounts keeps its engine pods'.
def pod_event_index(namespace: str | None, body: kopf.Body, **_: Any) -> dict[Key, PodEvent] | None:
    """FailedMount Events of engine pods, by (namespace, pod name)."""
    regarding = body.get("regarding") or {}
    pod = str(regarding.get("name") or "")
    if namespace is None or regarding.get("kind") != "Pod" or names.engine_pod_owner(pod) is None:
        return None
    return {(namespace, pod): PodEvent(str(regarding.get("uid") or ""), str(body.get("reason")),
                                       str(body.get("note") or ""), _event_time(body))}


def role_of(body: Mapping[str, Any]) -> tuple[str, Role] | None:
    """(CR name, role) a role object says it belongs to (its spec; the CRD holds its name to them)."""
    spec = body.get("spec") or {}
    deployment, role = spec.get("deployment"), spec.get("role")
    if not deployment or role not in names.ENGINE_ROLES:
        return None
    return str(deployment), cast(Role, role)


def role_index(namespace: str | None, body: kopf.Body, **_: Any) -> dict[Key, tuple[Role, LiveRole]] | None:
    """Every DisaggregatedRole, by its CR: the role objects whose counts the roles run. Not filtered by label: a
    role object someone else made for a CR is adopted (scale/counts.py)."""
    owner = role_of(body)
    if namespace is None or owner is None:
        return None
    return {(namespace, owner[0]): (owner[1], live_role(body))}


def register(registry: kopf.OperatorRegistry) -> None:
    """Register the indexing functions; kopf passes each index to handlers by the function's name (`Indexes`)."""
    kopf.index(*CR, registry=registry)(dinf_index)
    kopf.index("apps", "v1", "statefulsets", labels=MANAGED, registry=registry)(sts_index)
    kopf.index("", "v1", "pods", labels=MANAGED, registry=registry)(engine_pod_index)
    kopf.index("apps", "v1", "deployments", labels=MANAGED, registry=registry)(deploy_index)
    kopf.index("", "v1", "pods", labels=MANAGED, registry=registry)(pod_problem_index)
    kopf.index("", "v1", "events", field="involvedObject.kind", value="StatefulSet", registry=registry)(sts_event_index)
    kopf.index("events.k8s.io", "v1", "events", field="reason", value=FAILED_MOUNT, registry=registry)(pod_event_index)
    kopf.index(*ROLE_OBJECTS, registry=registry)(role_index)


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    return f"spec.{'.'.join(str(p) for p in err['loc'] if p != 'spec')}: {err['msg']}"


@dataclass(frozen=True)
class Indexes:
    """kopf's indexes, live views (kopf updates them in place), read through what the operator asks of them."""

    dinf_index: DinfIndex
    sts_index: StsIndex
    engine_pod_index: PodIndex
    deploy_index: WorkloadIndex
    pod_problem_index: PodProblemIndex
    sts_event_index: StsEventIndex
    pod_event_index: PodEventIndex
    role_index: RoleIndex

    @classmethod
    def of(cls, kwargs: Mapping[str, Any]) -> Indexes:
        """From the keyword arguments kopf passes a handler (startup handlers too: kopf makes the indexes
        first)."""
        return cls(**{f: kwargs[f] for f in cls.__dataclass_fields__})

    def keys(self) -> list[Key]:
        return list(self.dinf_index.keys())

    def __contains__(self, key: Key) -> bool:
        return key in self.dinf_index

    def entry(self, key: Key) -> IndexedCR | None:
        store = self.dinf_index.get(key)
        return next(iter(store), None) if store else None

    def statefulsets(self, key: Key) -> list[dict[str, Any]]:
        return list(self.sts_index.get(key) or ())

    def engine_pods(self, key: Key) -> list[dict[str, Any]]:
        return list(self.engine_pod_index.get(key) or ())

    def workload(self, key: Key, component: str) -> WorkloadState:
        store = self.deploy_index.get((*key, component))
        return next(iter(store), WorkloadState()) if store else WorkloadState()

    def live_roles(self, key: Key) -> dict[Role, LiveRole]:
        """The CR's role objects, by the name the operator gives them (another object naming the CR is not one)."""
        return {role: live for role, live in self.role_index.get(key) or ()
                if live.name == names.role_object_name(key[1], role)}
