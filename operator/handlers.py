"""Thin kopf handlers: turn watch events into reconcile passes. All decisions live in builders, status and
reconciler; nothing here builds objects.

Triggers:
- the CR is created, its spec changed, or it is found at start-up (resume) → full pass (apply children, then
  status), retried after a refusal. Decided from the CR's own watch events and its generation
  (generations.py), not kopf's change detection, which would write a copy of each spec into an annotation;
- a child changed and it is not the echo of our own apply (a hand edit, a deletion) → full pass;
- a child's status changed, or an engine pod's state changed → status pass;
- the StatefulSet controller failed to create an engine pod (a FailedCreate Event on an engine StatefulSet) →
  status pass. StatefulSet status has no condition for that, so the operator watches the Events involving
  StatefulSets (a server-side field selector, set in run.py) and keeps the pod-creation ones in an index;
- the kubelet cannot mount an engine pod's volume (a FailedMount Event on the pod) → status pass. The pod's
  status does not show it; the operator watches the Events with reason FailedMount (server-side) and keeps its
  engine pods' in an index;
- a role object (DisaggregatedRole, the /scale of one role) got a new spec (`kubectl scale`, an HPA, KEDA) or was
  deleted → status pass: every pass decides each role's count and (re)writes the role objects (scale_executor.py)
  before the rollout moves toward it; the echoes of the operator's own writes are not news (RoleScaler.changed);
- a periodic resync → thorough full pass (drift correction; writes nothing when nothing drifted), once the
  passes waiting for a slot have gone (resync_forever);
- the autoscaling planner (autoscale_forever, every --autoscale-seconds, for each CR with spec.autoscaling) wrote a
  role object's count → the role object's event, as for any scaler;
- the engines' reported transport changed in the deployment's rendezvous → status pass. A poll loop reads
  every deployment's rendezvous in the background (transport.py); passes only read its cached answers.

The resync is a plain asyncio loop, not a kopf timer: kopf timers put a finalizer on every CR, and a CR
must stay deletable when the operator is not running (owner references do the cleanup).

The one child owner references cannot clean up is the rendezvous' ClusterRoleBinding (auth kubernetes; it is
cluster-scoped). Without a finalizer: a CR's DELETED watch event removes its binding at once, best effort, and
every resync round removes any binding whose CR is gone (deleted while the operator was down, or an event
missed). kopf's @on.delete(optional=True) would not do: without a finalizer kopf sees only the object gone,
and it calls deletion handlers only for an object that still exists with a deletionTimestamp.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import copy
import logging
import os
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypedDict, cast

import kopf
from pydantic import ValidationError

from . import api, metrics, names, role_api
from .autoscale_executor import Autoscaler
from .generations import Generations
from .meta import timestamp
from .names import Key
from .reconciler import ApplyFailed, Reconciler
from .rollout.state import Role
from .scale.counts import LiveRole, RoleScale
from .scale.objects import live_role
from .scale_executor import RoleSync
from .slots import Slots
from .status import (
    FAILED_CREATE,
    FAILED_MOUNT,
    SUCCESSFUL_CREATE,
    CreateFailure,
    Observed,
    PodCreateEvent,
    PodEvent,
    PodProblem,
    RolloutView,
    TransportReport,
    WorkloadState,
    create_failure,
    mount_failure,
    pod_problems,
    ready_may_flip,
    transport_behind,
    workload_state,
)
from .transport import TransportPoller

INSTANCE = "app.kubernetes.io/instance"
COMPONENT = "app.kubernetes.io/component"
MANAGED = {names.LABEL_MANAGED_BY: names.MANAGED_BY}
CR = (api.GROUP, api.VERSION, api.PLURAL)
CHILD_KINDS = {
    "StatefulSet": ("apps", "v1", "statefulsets"),
    "Deployment": ("apps", "v1", "deployments"),
    "Service": ("", "v1", "services"),
    "ConfigMap": ("", "v1", "configmaps"),
    "PodDisruptionBudget": ("policy", "v1", "poddisruptionbudgets"),
}
RESYNC_SECONDS = float(os.environ.get("DISAGG_RESYNC_SECONDS", "300"))


# -- indexes: kopf keeps these current from its watches, so status needs no list calls ----------------------
# Every kind indexed and watched here is namespaced. kopf types `namespace` as str | None for any resource; an
# object without one (never seen: it would be cluster-scoped) is left out of the indexes and ignored by handlers.
# Event handlers take `type: str | None`: kopf passes None for objects from a listing (its RawEventType), though
# its WatchingFn protocol says str (a wider parameter type still satisfies the protocol).
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


class Indexes(TypedDict):
    """kopf's indexes, as it passes them to handlers (keyword arguments named after the indexing functions)."""

    dinf_index: DinfIndex
    sts_index: StsIndex
    engine_pod_index: PodIndex
    deploy_index: WorkloadIndex
    pod_problem_index: PodProblemIndex
    sts_event_index: StsEventIndex
    pod_event_index: PodEventIndex
    role_index: RoleIndex


@kopf.index(*CR)
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


@kopf.index("apps", "v1", "statefulsets", labels=MANAGED)
def sts_index(namespace: str | None, labels: kopf.Labels, body: kopf.Body,
              **_: Any) -> dict[Key, dict[str, Any]] | None:
    """Every engine StatefulSet of a CR, every revision's, as the rollout and status read them."""
    if namespace is None or labels.get(COMPONENT) not in names.ENGINE_ROLES:
        return None
    return {(namespace, labels.get(INSTANCE, "")): statefulset_view(body)}


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


@kopf.index("", "v1", "pods", labels=MANAGED)
def engine_pod_index(namespace: str | None, labels: kopf.Labels, body: kopf.Body,
                     **_: Any) -> dict[Key, dict[str, Any]] | None:
    """Every engine pod of a CR: the rollout reads readiness, age and failures per ordinal."""
    if namespace is None or labels.get(COMPONENT) not in names.ENGINE_ROLES:
        return None
    meta = body.get("metadata") or {}
    return {(namespace, labels.get(INSTANCE, "")): {
        "metadata": _copied(meta, ("name", "uid", "labels", "creationTimestamp", "deletionTimestamp")),
        "status": copy.deepcopy(dict(body.get("status") or {})),
    }}


@kopf.index("apps", "v1", "deployments", labels=MANAGED)
def deploy_index(namespace: str | None, labels: kopf.Labels, body: kopf.Body,
                 **_: Any) -> dict[WorkloadKey, WorkloadState] | None:
    if namespace is None:
        return None
    return {(namespace, labels.get(INSTANCE, ""), labels.get(COMPONENT, "")): workload_state(dict(body))}


@kopf.index("", "v1", "pods", labels=MANAGED)
def pod_problem_index(namespace: str | None, labels: kopf.Labels, body: kopf.Body,
                      **_: Any) -> dict[Key, tuple[PodProblem, ...]] | None:
    """A pod's problems while it has some. A pod without (any more) is `{}`: kopf keeps what an indexer returned
    for an object before when it returns None, so a pod that recovered would stay failed."""
    if namespace is None:
        return None
    problems = pod_problems(dict(body))
    return {(namespace, labels.get(INSTANCE, "")): tuple(problems)} if problems else {}


def _event_time(body: Mapping[str, Any]) -> float:
    """When an Event last happened: its series' last observation, else lastTimestamp (events.k8s.io:
    deprecatedLastTimestamp), else eventTime, else its creation."""
    stamp = ((body.get("series") or {}).get("lastObservedTime") or body.get("lastTimestamp")
             or body.get("deprecatedLastTimestamp") or body.get("eventTime")
             or (body.get("metadata") or {}).get("creationTimestamp"))
    return timestamp(stamp) or 0.0


@kopf.index("", "v1", "events", field="involvedObject.kind", value="StatefulSet")
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
@kopf.index("events.k8s.io", "v1", "events", field="reason", value=FAILED_MOUNT)
def pod_event_index(namespace: str | None, body: kopf.Body, **_: Any) -> dict[Key, PodEvent] | None:
    """FailedMount Events of engine pods, by (namespace, pod name)."""
    regarding = body.get("regarding") or {}
    pod = str(regarding.get("name") or "")
    if namespace is None or regarding.get("kind") != "Pod" or names.engine_pod_owner(pod) is None:
        return None
    return {(namespace, pod): PodEvent(str(regarding.get("uid") or ""), str(body.get("reason")),
                                       str(body.get("note") or ""), _event_time(body))}


ROLE_OBJECTS = (api.GROUP, api.VERSION, role_api.PLURAL)


def _role_of(body: Mapping[str, Any]) -> tuple[str, Role] | None:
    """(CR name, role) a role object says it belongs to (its spec; the CRD holds its name to them)."""
    spec = body.get("spec") or {}
    deployment, role = spec.get("deployment"), spec.get("role")
    if not deployment or role not in names.ENGINE_ROLES:
        return None
    return str(deployment), cast(Role, role)


@kopf.index(*ROLE_OBJECTS)
def role_index(namespace: str | None, body: kopf.Body, **_: Any) -> dict[Key, tuple[Role, LiveRole]] | None:
    """Every DisaggregatedRole, by its CR: the role objects whose counts the roles run. Not filtered by label: a
    role object someone else made for a CR is adopted (scale/counts.py)."""
    owner = _role_of(body)
    if namespace is None or owner is None:
        return None
    return {(namespace, owner[0]): (owner[1], live_role(body))}


def _live_roles(index: RoleIndex, key: Key) -> dict[Role, LiveRole | None]:
    found: dict[Role, LiveRole | None] = {}
    for role, live in index.get(key) or ():
        if live.name == names.role_object_name(key[1], role):
            found[role] = live
    return found


def _one(index: WorkloadIndex, key: WorkloadKey) -> WorkloadState:
    store = index.get(key)
    return next(iter(store), WorkloadState()) if store else WorkloadState()


def _current(statefulsets: list[dict[str, Any]], revision: str | None, role: str) -> dict[str, Any] | None:
    for sts in statefulsets:
        labels = sts["metadata"].get("labels") or {}
        if labels.get(COMPONENT) == role and labels.get(names.LABEL_REVISION) == revision:
            return sts
    return None


def observe(namespace: str, name: str, revision: str, statefulsets: list[dict[str, Any]], deploys: WorkloadIndex,
            pods: PodProblemIndex, transport: TransportReport | None = None, sts_events: StsEventIndex | None = None,
            apply_error: str | None = None, rollout: RolloutView | None = None,
            engine_pods: list[dict[str, Any]] | None = None, pod_events: PodEventIndex | None = None,
            scales: Mapping[Role, RoleScale] | None = None) -> Observed:
    """Status' view of a CR's children; `prefill` and `decode` are those of `revision`, the current one. A pod's
    problems are what its status shows (`pods`) and, for engine pods, a volume the kubelet cannot mount (its
    FailedMount Events)."""
    problems = tuple(p for group in (pods.get((namespace, name)) or ()) for p in group)
    if pod_events is not None:
        for pod in engine_pods or ():
            seen = pod_events.get((namespace, str((pod.get("metadata") or {}).get("name") or "")))
            if seen and (mount := mount_failure(pod, tuple(seen))) is not None:
                problems += (mount,)
    current = {role: _current(statefulsets, revision, role) for role in names.ENGINE_ROLES}
    roles = {role: workload_state(sts) for role, sts in current.items()}
    failures: list[CreateFailure] = []
    for role, state in roles.items():
        sts = current[role]
        store = sts_events.get((namespace, sts["metadata"]["name"])) if sts_events is not None and sts else None
        events = tuple(store or ())
        if (message := create_failure(state, events)) is not None:
            failures.append(CreateFailure(role, message))
    return Observed(prefill=roles["prefill"], decode=roles["decode"], router=_one(deploys, (namespace, name, "router")),
                    problems=problems, transport=transport, create_failures=tuple(failures), apply_error=apply_error,
                    rollout=rollout, scales={str(role): scale for role, scale in (scales or {}).items()})


# -- the passes -----------------------------------------------------------------------------------------
async def run_pass(memo: kopf.Memo, namespace: str, name: str, *, full: bool, trigger: str,
                   dinf_index: DinfIndex, sts_index: StsIndex, engine_pod_index: PodIndex, deploy_index: WorkloadIndex,
                   pod_problem_index: PodProblemIndex, sts_event_index: StsEventIndex, pod_event_index: PodEventIndex,
                   role_index: RoleIndex, logger: kopf.Logger) -> None:
    reconciler: Reconciler = memo.reconciler
    transports: TransportPoller = memo.transports
    key = (namespace, name)

    passes = 0

    async def one_pass(full: bool) -> None:
        # Passes the coalescer runs again for triggers that arrived meanwhile are counted as "coalesced".
        nonlocal passes
        label = trigger if passes == 0 else "coalesced"
        passes += 1
        entry = _entry(dinf_index, key)
        if entry is None or entry.deleting:
            transports.forget(key)
            reconciler.forget(key)
            return  # deleted: owner references make the garbage collector remove the children
        t0 = time.monotonic()
        body, cr = entry.body, entry.cr
        thorough = reconciler.take_verify(key)
        full = full or thorough or reconciler.drift_pending(key)
        if cr is None:
            metrics.RECONCILES.labels(trigger=label, result="invalid").inc()
            post_event(memo, kopf.warn, body, "InvalidSpec", str(entry.error))
            raise kopf.PermanentError(f"invalid spec: {entry.error}")
        # Asked of the apiserver once, before this pass's first write, if it makes one (reconciler.StillThere).
        still_there = reconciler.still_there(namespace, name)
        failed: ApplyFailed | None = None
        if full:
            try:
                outcome = await reconciler.apply_children(cr, list(sts_index.get(key) or ()), thorough=thorough,
                                                          still_there=still_there)
            except ApplyFailed as e:
                if e.code == 403 and "being terminated" in str(e):
                    return  # the namespace is going away with the CR in it; nothing to converge to
                failed = e
            else:
                if outcome.gone:
                    return
                for ref in outcome.created:
                    metrics.CHILD_WRITES.labels(kind=ref.split("/")[0], change="created").inc()
                for ref in outcome.updated:
                    metrics.CHILD_WRITES.labels(kind=ref.split("/")[0], change="updated").inc()
                if outcome.created:
                    post_event(memo, kopf.info, body, "Created", "created " + ", ".join(outcome.created))
                if outcome.updated:
                    post_event(memo, kopf.info, body, "Updated", "updated " + ", ".join(outcome.updated))
        report: TransportReport | None = None
        if cr.spec.advertises:
            transports.request(key)  # in the background, when the cached answer is old or missing
            report = transports.report(key)
        # Every pass, status passes too: each role's count (what /scale set, or a changed spec.<role>.replicas),
        # then the rollout toward it; engines becoming Ready or leaving are what move a rollout on.
        roles = await reconciler.scale.sync(cr, _live_roles(role_index, key), still_there)
        if roles.gone:
            return
        _post_role_writes(memo, body, roles)
        statefulsets = list(sts_index.get(key) or ())
        engine_pods = list(engine_pod_index.get(key) or ())
        rollout: RolloutView | None = None
        if failed is None:
            def post(kind: str, reason: str, message: str) -> None:
                post_event(memo, kopf.warn if kind == "Warning" else kopf.info, body, reason, message)

            try:
                rollout = await reconciler.advance_rollout(cr, statefulsets, engine_pods, report, post,
                                                           thorough=thorough,
                                                           still_there=still_there, desired=roles.desired())
            except ApplyFailed as e:
                if e.code == 403 and "being terminated" in str(e):
                    return
                failed = e
            else:
                if rollout is None:
                    return  # deleted meanwhile
        # A refused child stays in Degraded (reconciler.apply_error) until a full pass applies every child.
        # (rendering both templates costs: the rollout's revision when it has one)
        revision = rollout.revision if rollout else reconciler.revision(cr, statefulsets).revision
        # A refused role object is reported like a refused child; only a full pass is retried for it (the rollout
        # moved anyway, on the counts the roles run).
        if full and failed is None and roles.error is not None:
            failed = ApplyFailed(roles.error, roles.code)
        refusal = reconciler.apply_error(key) or (str(failed) if failed else None) or roles.error
        observed = observe(namespace, name, revision, statefulsets, deploy_index, pod_problem_index, report,
                           sts_event_index, refusal, rollout, engine_pods, pod_event_index, roles.scales)
        # Read the rendezvous again now, not at the next poll, when it lags the pods: its answer, if it changed,
        # triggers a status pass (transport_changed), which is also what moves a rollout waiting for engines.
        behind = transport_behind(observed.prefill.ready + observed.decode.ready, report)
        if cr.spec.advertises and (behind or (rollout is not None and rollout.unlisted)):
            transports.request(key, force=True)
        status = await reconciler.publish_status(cr, observed)
        if rollout is not None:
            await reconciler.scale.publish(cr, roles, list(rollout.revisions))
        event = reconciler.transport_event(key, cr.status, status) if status is not None else None
        if event is not None:
            kind, reason, message = event
            post_event(memo, kopf.warn if kind == "Warning" else kopf.info, body, reason, message)
        if failed is not None:
            metrics.RECONCILES.labels(trigger=label, result="error").inc()
            post_event(memo, kopf.exception, body, "ApplyFailed", str(failed))
            raise kopf.TemporaryError(str(failed), delay=10 if failed.code != 403 else 60)
        metrics.RECONCILES.labels(trigger=label, result="ok").inc()
        metrics.RECONCILE_SECONDS.observe(time.monotonic() - t0)

    if trigger == "resync":
        # Whichever pass of this CR runs next verifies its children, also when this trigger joins a pass already
        # waiting or queues behind a running one.
        reconciler.verify_next(key)
    await reconciler.coalescer.run(key, full, one_pass, urgent=not full and _ready_may_flip(
        dinf_index, sts_index, deploy_index, key))


def _entry(dinf_index: DinfIndex, key: Key) -> IndexedCR | None:
    store = dinf_index.get(key)
    return next(iter(store), None) if store else None


def _ready_may_flip(dinf_index: DinfIndex, sts_index: StsIndex, deploy_index: WorkloadIndex, key: Key) -> bool:
    entry = _entry(dinf_index, key)
    if entry is None or entry.cr is None:
        return False
    engines = [workload_state(sts) for sts in sts_index.get(key) or ()]
    router = _one(deploy_index, (*key, "router")) if entry.cr.spec.router.replicas else None
    return ready_may_flip(entry.cr.status, engines, router)


class PostFn(Protocol):
    """kopf.info, kopf.warn: post an Event about an object."""

    def __call__(self, objs: kopf.Body, *, reason: str, message: str = ...) -> None: ...


def post_event(memo: kopf.Memo, post: PostFn, body: kopf.Body, reason: str, message: str) -> None:
    """kopf.info/warn from any task. kopf finds its event queue through context variables that only its handler
    tasks carry; the resync and transport-poll loops run outside them, so they post through the context of
    the latest handler call (saved by _indexes)."""
    try:
        post(body, reason=reason, message=message)
    except LookupError:
        context: contextvars.Context | None = memo.shared.get("context")
        if context is None:
            logging.getLogger("disagg.operator").warning("event %s not posted (no handler context yet): %s",
                                                         reason, message)
            return
        context.run(post, body, reason=reason, message=message)


def _post_role_writes(memo: kopf.Memo, body: kopf.Body, roles: RoleSync) -> None:
    if roles.created:
        post_event(memo, kopf.info, body, "Created", "created " + ", ".join(roles.created))
    if roles.updated:
        post_event(memo, kopf.info, body, "Updated", "updated " + ", ".join(roles.updated))


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    return f"spec.{'.'.join(str(p) for p in err['loc'] if p != 'spec')}: {err['msg']}"


@kopf.on.event(*CR, id="dinf")
async def dinf_event(type: str | None, namespace: str | None, name: str, body: kopf.Body, memo: kopf.Memo,
                     logger: kopf.Logger, **kw: Any) -> None:
    """A full pass for each generation of a CR (generations.py); its DELETED event removes its binding."""
    if namespace is None:
        return
    key = (namespace, name)
    generations: Generations = memo.generations
    if type == "DELETED":
        generations.forget(key)
        memo.retries.cancel(key)
        await collect_bindings(memo, logger, only=key)
        return
    meta = body.metadata
    trigger = generations.trigger(key, type, str(meta.get("uid") or ""), int(meta.get("generation") or 0))
    if trigger is not None:
        await full_pass(memo, key, trigger, logger, _indexes(memo, kw))


async def full_pass(memo: kopf.Memo, key: Key, trigger: str, logger: kopf.Logger, indexes: Indexes) -> None:
    """A full pass for the CR's own change, retried after a refusal (10 s; 60 s when forbidden) until one
    succeeds or a later change or the CR's deletion supersedes it. An invalid spec is not retried: its next
    generation is."""
    retries: Retries = memo.retries
    retries.cancel(key)
    try:
        await run_pass(memo, *key, full=True, trigger=trigger, logger=logger, **indexes)
    except kopf.TemporaryError as e:
        logger.warning(f"{key[0]}/{key[1]}: {e}; retrying in {e.delay:.0f}s")
        retries.later(key, e.delay or 10, lambda: full_pass(memo, key, "retry", logger, indexes))
    except kopf.PermanentError as e:
        logger.error(f"{key[0]}/{key[1]}: {e}")


class Retries:
    """At most one pending retry per CR: scheduling one cancels the one before."""

    def __init__(self) -> None:
        self._timers: dict[Key, asyncio.TimerHandle] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # running retries (the loop keeps only weak references)

    def later(self, key: Key, delay: float, retry: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self.cancel(key)
        loop = asyncio.get_running_loop()

        def start() -> None:
            self._timers.pop(key, None)
            task = loop.create_task(retry())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        self._timers[key] = loop.call_later(delay, start)

    def cancel(self, key: Key) -> None:
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()

    def pending(self) -> set[Key]:
        return set(self._timers)


def _indexes(memo: kopf.Memo, kw: dict[str, Any]) -> Indexes:
    # Index objects are live views; the resync loop keeps a reference to reach them between events. kopf
    # hands each object a shallow copy of the memo, so the reference goes into a dict they all share.
    indexes = Indexes(dinf_index=kw["dinf_index"], sts_index=kw["sts_index"], engine_pod_index=kw["engine_pod_index"],
                      deploy_index=kw["deploy_index"],
                      pod_problem_index=kw["pod_problem_index"], sts_event_index=kw["sts_event_index"],
                      pod_event_index=kw["pod_event_index"], role_index=kw["role_index"])
    memo.shared["indexes"] = indexes
    memo.shared["context"] = contextvars.copy_context()  # for post_event outside handlers
    return indexes


def _saved_indexes(memo: kopf.Memo) -> Indexes | None:
    """The indexes the latest handler call saved (_indexes), for the loops that run outside handlers."""
    indexes: Indexes | None = memo.shared.get("indexes")
    return indexes


def _needs_binding(index: DinfIndex) -> set[Key]:
    """CRs the watch index knows with auth kubernetes (the default). One that does not parse keeps its binding:
    nothing proves it does not need one."""
    return {key for key, store in index.items() for entry in store
            if entry.cr is None or entry.cr.spec.rendezvous.auth == "kubernetes"}


async def collect_bindings(memo: kopf.Memo, logger: kopf.Logger, only: Key | None = None) -> None:
    """Remove rendezvous ClusterRoleBindings whose CR is gone; a failure waits for the next round."""
    indexes = _saved_indexes(memo)
    needed = _needs_binding(indexes["dinf_index"]) if indexes and only is None else set()
    reconciler: Reconciler = memo.reconciler
    try:
        await reconciler.collect_bindings(only=only, needed=needed)
    except Exception as e:  # never ends the resync loop; the next round retries
        logger.warning(f"removing rendezvous ClusterRoleBindings of deleted CRs failed: {e}")


async def resync_forever(memo: kopf.Memo, logger: kopf.Logger) -> None:
    """Every RESYNC_SECONDS, a thorough full pass of every known CR, one at a time. A round, and each of its
    passes, first lets the passes waiting for a slot go (a burst of creates: its CRs were just applied, and a
    resync pass there only competes with the burst for the apiserver), waiting at most RESYNC_SECONDS per round
    in all, so a fleet that is never quiet is still resynced."""
    slots: Slots = memo.reconciler.coalescer.slots
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(RESYNC_SECONDS)
        patience = loop.time() + RESYNC_SECONDS
        await _drained(slots, patience - loop.time())
        await collect_bindings(memo, logger)
        try:
            await memo.reconciler.observe_unwatched()
        except Exception as e:  # then the passes verify those children by applying them, as without a listing
            logger.warning(f"listing the rendezvous' ServiceAccounts and ClusterRoleBindings failed: {e}")
        indexes = _saved_indexes(memo)
        if not indexes:
            metrics.RESYNC_ROUNDS.inc()
            continue
        metrics.MANAGED.set(len(indexes["dinf_index"]))
        for namespace, name in list(indexes["dinf_index"].keys()):
            await _drained(slots, patience - loop.time())
            try:
                await run_pass(memo, namespace, name, full=True, trigger="resync", logger=logger, **indexes)
            except (kopf.TemporaryError, kopf.PermanentError) as e:
                logger.warning(f"resync of {namespace}/{name} failed: {e}")
            except Exception:  # one CR's failure (an API error, a timeout) must never end the resync loop
                metrics.RECONCILES.labels(trigger="resync", result="error").inc()
                logger.exception(f"resync of {namespace}/{name} failed")
        metrics.RESYNC_ROUNDS.inc()


async def _drained(slots: Slots, timeout: float) -> None:
    """Return once no pass waits for a slot, or after `timeout` seconds (at once when it is not positive)."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(slots.drained(), max(0.0, timeout))


async def transport_changed(memo: kopf.Memo, key: Key, logger: kopf.Logger) -> None:
    """A deployment's rendezvous answered differently than before: refresh its status."""
    indexes = _saved_indexes(memo)
    if not indexes or key not in indexes["dinf_index"]:
        return
    try:
        await run_pass(memo, *key, full=False, trigger="transport", logger=logger, **indexes)
    except (kopf.TemporaryError, kopf.PermanentError) as e:
        logger.warning(f"status pass of {key[0]}/{key[1]} failed: {e}")
    except Exception:
        metrics.RECONCILES.labels(trigger="transport", result="error").inc()
        logger.exception(f"status pass of {key[0]}/{key[1]} failed")


async def poll_transports_forever(memo: kopf.Memo, interval: float) -> None:
    """Every `interval`, re-read every deployment's rendezvous in the background; answers that changed
    trigger status passes (transport_changed). Deployments that left the index are forgotten."""
    transports: TransportPoller = memo.transports
    while True:
        await asyncio.sleep(interval)
        indexes = _saved_indexes(memo)
        if not indexes:
            continue
        for key in transports.keys() - set(indexes["dinf_index"].keys()):
            transports.forget(key)
        for key, store in list(indexes["dinf_index"].items()):
            entry: IndexedCR | None = next(iter(store), None)
            if entry is None or entry.cr is None or not entry.cr.spec.advertises:
                continue  # unparsable, or a vendor connector: its engines never report a transport
            transports.request(key, force=True)


async def autoscale_forever(memo: kopf.Memo, interval: float) -> None:
    """Every `interval`, one autoscaling tick for each CR with spec.autoscaling, all at once
    (autoscale_executor.py). CRs that left the index, or dropped spec.autoscaling, are forgotten."""
    autoscaler: Autoscaler = memo.autoscaler
    log = logging.getLogger("disagg.autoscale")
    while True:
        await asyncio.sleep(interval)
        indexes = _saved_indexes(memo)
        if not indexes:
            continue
        ticks: dict[Key, Coroutine[Any, Any, None]] = {}
        for key, store in list(indexes["dinf_index"].items()):
            entry: IndexedCR | None = next(iter(store), None)
            if entry is None or entry.cr is None or entry.deleting or entry.cr.spec.autoscaling is None:
                continue
            live = {role: r for role, r in _live_roles(indexes["role_index"], key).items() if r is not None}
            ticks[key] = autoscaler.tick(entry.cr, live, _poster(memo, entry.body))
        for key in autoscaler.keys() - set(ticks):
            autoscaler.forget(key)
        for key, result in zip(ticks, await asyncio.gather(*ticks.values(), return_exceptions=True), strict=True):
            if isinstance(result, Exception):
                metrics.AUTOSCALE_TICKS.labels(result="error").inc()
                log.error("%s/%s: autoscaling tick failed: %r", *key, result)


def _poster(memo: kopf.Memo, body: kopf.Body) -> Callable[[str, str, str], None]:
    def post(kind: str, reason: str, message: str) -> None:
        post_event(memo, kopf.warn if kind == "Warning" else kopf.info, body, reason, message)
    return post


STATUS_KINDS = frozenset({"StatefulSet", "Deployment"})  # the children whose state status reads (observe)


def child_event_pass(kind: str, changed: bool) -> bool | None:
    """The pass a child's watch event asks for: full when the child changed under us (a hand edit, a deletion:
    the plan puts it back); a status pass for our own echo or a status-only change of a kind status reads;
    otherwise none (a Service's echo, a PodDisruptionBudget's status: nothing the CR reports moved)."""
    if changed:
        return True
    return False if kind in STATUS_KINDS else None


def _register_child(kind: str, group: str, version: str, plural: str) -> None:
    @kopf.on.event(group, version, plural, labels=MANAGED, id=f"child-{plural}")
    async def child_event(type: str | None, body: kopf.Body, namespace: str | None, labels: kopf.Labels,
                          memo: kopf.Memo, logger: kopf.Logger, **kw: Any) -> None:
        owner = labels.get(INSTANCE)
        if namespace is None or not owner or (namespace, owner) not in kw["dinf_index"]:
            return
        reconciler: Reconciler = memo.reconciler
        if type == "DELETED" and not await reconciler.exists(namespace, owner):
            return  # the garbage collector is removing the children of a deleted CR: do not recreate them
        full = child_event_pass(kind, reconciler.child_changed(kind, dict(body), deleted=type == "DELETED"))
        if full is not None:
            await run_pass(memo, namespace, owner, full=full, trigger=f"{kind}-event", logger=logger,
                           **_indexes(memo, kw))


for _kind, (_g, _v, _p) in CHILD_KINDS.items():
    _register_child(_kind, _g, _v, _p)


@kopf.on.event("", "v1", "events", field="involvedObject.kind", value="StatefulSet", id="statefulset-events")
async def statefulset_event(type: str | None, body: kopf.Body, namespace: str | None, memo: kopf.Memo,
                            logger: kopf.Logger, **kw: Any) -> None:
    """A failed pod creation changes Degraded. (A successful one also creates a pod, whose own event refreshes
    status.)"""
    if namespace is None or type == "DELETED" or body.get("reason") != FAILED_CREATE:
        return
    owner = names.engine_owner((body.get("involvedObject") or {}).get("name", ""))
    if owner is not None and (namespace, owner[0]) in kw["dinf_index"]:
        await run_pass(memo, namespace, owner[0], full=False, trigger="statefulset-event", logger=logger,
                       **_indexes(memo, kw))


@kopf.on.event("events.k8s.io", "v1", "events", field="reason", value=FAILED_MOUNT, id="pod-mount-events")
async def pod_mount_event(type: str | None, body: kopf.Body, namespace: str | None, memo: kopf.Memo,
                          logger: kopf.Logger, **kw: Any) -> None:
    """A volume an engine pod cannot mount changes Degraded; nothing in the pod's own status changes meanwhile."""
    if namespace is None or type == "DELETED":
        return
    owner = names.engine_pod_owner(str((body.get("regarding") or {}).get("name") or ""))
    if owner is not None and (namespace, owner[0]) in kw["dinf_index"]:
        await run_pass(memo, namespace, owner[0], full=False, trigger="pod-mount-event", logger=logger,
                       **_indexes(memo, kw))


@kopf.on.event("", "v1", "pods", labels=MANAGED)
async def engine_pod_event(namespace: str | None, labels: kopf.Labels, memo: kopf.Memo, logger: kopf.Logger,
                           **kw: Any) -> None:
    owner = labels.get(INSTANCE)
    if namespace is None or not owner or labels.get(COMPONENT) not in ("prefill", "decode"):
        return
    if (namespace, owner) in kw["dinf_index"]:
        await run_pass(memo, namespace, owner, full=False, trigger="pod-event", logger=logger,
                       **_indexes(memo, kw))


@kopf.on.event(*ROLE_OBJECTS, id="role-objects")
async def role_event(type: str | None, body: kopf.Body, namespace: str | None, memo: kopf.Memo, logger: kopf.Logger,
                     **kw: Any) -> None:
    """A role's count changed (`kubectl scale`, an HPA, KEDA) or its role object was deleted: a status pass decides
    the counts again (and recreates a deleted one), and the rollout moves toward them."""
    owner = _role_of(body)
    if namespace is None or owner is None or (namespace, owner[0]) not in kw["dinf_index"]:
        return
    reconciler: Reconciler = memo.reconciler
    if not reconciler.scale.changed(namespace, body, deleted=type == "DELETED"):
        return
    if type == "DELETED" and not await reconciler.exists(namespace, owner[0]):
        return  # the garbage collector is removing the objects of a deleted CR: do not recreate them
    await run_pass(memo, namespace, owner[0], full=False, trigger="role-event", logger=logger, **_indexes(memo, kw))
