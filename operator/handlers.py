"""Thin kopf handlers: turn watch events into reconcile passes. All decisions live in builders, status and
reconciler; nothing here builds objects.

Triggers:
- the CR is created, changed, or found at start-up (resume) → full pass (apply children, then status);
- a child changed and it is not the echo of our own apply (a hand edit, a deletion) → full pass;
- a child's status changed, or an engine pod's state changed → status pass;
- a periodic resync → full pass (drift correction; writes nothing when nothing drifted).

The resync is a plain asyncio loop, not a kopf timer: kopf timers put a finalizer on every CR, and a CR
must stay deletable when the operator is not running (owner references do the cleanup).
"""
from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import kopf
from pydantic import ValidationError

from . import api, metrics
from .reconciler import ApplyFailed, Reconciler
from .status import Observed, WorkloadState, pod_problems, workload_state

INSTANCE = "app.kubernetes.io/instance"
COMPONENT = "app.kubernetes.io/component"
MANAGED = {"app.kubernetes.io/managed-by": "disagg-operator"}
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
@kopf.index(*CR)
def dinf_index(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict:
    return {(namespace, name): {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
                                "metadata": dict(body.metadata), "spec": dict(body.spec),
                                "status": dict(body.get("status") or {})}}


@kopf.index("apps", "v1", "statefulsets", labels=MANAGED)
def sts_index(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict:
    return {(namespace, labels.get(INSTANCE, ""), labels.get(COMPONENT, "")): workload_state(dict(body))}


@kopf.index("apps", "v1", "deployments", labels=MANAGED)
def deploy_index(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict:
    return {(namespace, labels.get(INSTANCE, ""), labels.get(COMPONENT, "")): workload_state(dict(body))}


@kopf.index("", "v1", "pods", labels=MANAGED)
def pod_problem_index(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict | None:
    problems = pod_problems(dict(body))
    return {(namespace, labels.get(INSTANCE, "")): tuple(problems)} if problems else None


def _one(index: kopf.Index, key: tuple) -> WorkloadState:
    store = index.get(key)
    return next(iter(store), WorkloadState()) if store else WorkloadState()


def observe(namespace: str, name: str, sts: kopf.Index, deploys: kopf.Index, pods: kopf.Index) -> Observed:
    problems = tuple(p for group in (pods.get((namespace, name)) or ()) for p in group)
    return Observed(prefill=_one(sts, (namespace, name, "prefill")), decode=_one(sts, (namespace, name, "decode")),
                    router=_one(deploys, (namespace, name, "router")), problems=problems)


# -- the passes -----------------------------------------------------------------------------------------
async def run_pass(memo: kopf.Memo, namespace: str, name: str, *, full: bool, trigger: str,
                   dinf_index: kopf.Index, sts_index: kopf.Index, deploy_index: kopf.Index,
                   pod_problem_index: kopf.Index, logger) -> None:
    reconciler: Reconciler = memo.reconciler

    async def one_pass(full: bool) -> None:
        store = dinf_index.get((namespace, name))
        body = next(iter(store), None) if store else None
        if body is None or body["metadata"].get("deletionTimestamp"):
            return  # deleted: owner references make the garbage collector remove the children
        t0 = time.monotonic()
        try:
            cr = api.DisaggregatedInference.model_validate(body)
        except ValidationError as e:
            metrics.RECONCILES.labels(trigger=trigger, result="invalid").inc()
            kopf.warn(body, reason="InvalidSpec", message=_first_error(e))
            raise kopf.PermanentError(f"invalid spec: {_first_error(e)}")
        try:
            # The index can lag a deletion; applying then would recreate children the garbage collector is
            # removing (owned by a deleted UID). Ask the apiserver before any pass that may create.
            if full and not await reconciler.exists(namespace, name):
                return
            if full:
                outcome = await reconciler.apply_children(cr, thorough=trigger == "resync")
                for ref in outcome.created:
                    metrics.CHILD_WRITES.labels(kind=ref.split("/")[0], change="created").inc()
                for ref in outcome.updated:
                    metrics.CHILD_WRITES.labels(kind=ref.split("/")[0], change="updated").inc()
                if outcome.created:
                    kopf.info(body, reason="Created", message="created " + ", ".join(outcome.created))
                if outcome.updated:
                    kopf.info(body, reason="Updated", message="updated " + ", ".join(outcome.updated))
            observed = observe(namespace, name, sts_index, deploy_index, pod_problem_index)
            await reconciler.publish_status(cr, body, observed)
        except ApplyFailed as e:
            if e.code == 403 and "being terminated" in str(e):
                return  # the namespace is going away with the CR in it; nothing to converge to
            metrics.RECONCILES.labels(trigger=trigger, result="error").inc()
            kopf.exception(body, reason="ApplyFailed", message=str(e))
            raise kopf.TemporaryError(str(e), delay=10 if e.code != 403 else 60)
        metrics.RECONCILES.labels(trigger=trigger, result="ok").inc()
        metrics.RECONCILE_SECONDS.observe(time.monotonic() - t0)

    await reconciler.coalescer.run((namespace, name), full, one_pass)


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    return f"spec.{'.'.join(str(p) for p in err['loc'] if p != 'spec')}: {err['msg']}"


@kopf.on.resume(*CR)
@kopf.on.create(*CR)
@kopf.on.update(*CR, field="spec")
async def dinf_changed(namespace: str, name: str, memo: kopf.Memo, logger, reason: str, **kw: Any) -> None:
    await run_pass(memo, namespace, name, full=True, trigger=str(reason), logger=logger, **_indexes(memo, kw))


def _indexes(memo: kopf.Memo, kw: dict[str, Any]) -> dict[str, Any]:
    # Index objects are live views; the resync loop keeps a reference to reach them between events. kopf
    # hands each object a shallow copy of the memo, so the reference goes into a dict they all share.
    indexes = {k: kw[k] for k in ("dinf_index", "sts_index", "deploy_index", "pod_problem_index")}
    memo.shared["indexes"] = indexes
    return indexes


async def resync_forever(memo: kopf.Memo, logger) -> None:
    while True:
        await asyncio.sleep(RESYNC_SECONDS)
        indexes = memo.shared.get("indexes")
        if not indexes:
            metrics.RESYNC_ROUNDS.inc()
            continue
        metrics.MANAGED.set(len(indexes["dinf_index"]))
        for namespace, name in list(indexes["dinf_index"].keys()):
            try:
                await run_pass(memo, namespace, name, full=True, trigger="resync", logger=logger, **indexes)
            except (kopf.TemporaryError, kopf.PermanentError) as e:
                logger.warning(f"resync of {namespace}/{name} failed: {e}")
            except Exception:  # one CR's failure (an API error, a timeout) must never end the resync loop
                metrics.RECONCILES.labels(trigger="resync", result="error").inc()
                logger.exception(f"resync of {namespace}/{name} failed")
        metrics.RESYNC_ROUNDS.inc()


def _register_child(kind: str, group: str, version: str, plural: str) -> None:
    @kopf.on.event(group, version, plural, labels=MANAGED, id=f"child-{plural}")
    async def child_event(type: str | None, body: kopf.Body, namespace: str, labels: kopf.Labels,
                          memo: kopf.Memo, logger, **kw: Any) -> None:
        owner = labels.get(INSTANCE)
        if not owner or (namespace, owner) not in kw["dinf_index"]:
            return
        reconciler: Reconciler = memo.reconciler
        if type == "DELETED" and not await reconciler.exists(namespace, owner):
            return  # the garbage collector is removing the children of a deleted CR: do not recreate them
        # Our own apply echoing back, or a status-only change: refresh status. Anything else (a hand edit, a
        # deletion) means the child no longer matches the spec: put it back.
        own = type != "DELETED" and reconciler.is_own_echo(kind, dict(body))
        await run_pass(memo, namespace, owner, full=not own, trigger=f"{kind}-event", logger=logger,
                       **_indexes(memo, kw))


for _kind, (_g, _v, _p) in CHILD_KINDS.items():
    _register_child(_kind, _g, _v, _p)


@kopf.on.event("", "v1", "pods", labels=MANAGED)
async def engine_pod_event(namespace: str, labels: kopf.Labels, memo: kopf.Memo, logger, **kw: Any) -> None:
    owner = labels.get(INSTANCE)
    if owner and labels.get(COMPONENT) in ("prefill", "decode") and (namespace, owner) in kw["dinf_index"]:
        await run_pass(memo, namespace, owner, full=False, trigger="pod-event", logger=logger,
                       **_indexes(memo, kw))
