"""kopf's side: the handlers turn watch events into passes on the work queue, and decide nothing else.

`register` puts the indexes (indexes.py) and these handlers on a kopf registry. The startup handler makes the one
Controller (runtime.py) from the settings and the indexes; every event handler only asks it for a pass (which
pass each event asks for is in runtime.py's docstring).

Event handlers take `type: str | None`: kopf passes None for objects from a listing (its RawEventType), though its
WatchingFn protocol says str (a wider parameter type still satisfies the protocol).
"""
from __future__ import annotations

import logging
from typing import Any

import kopf
from lightkube import AsyncClient, KubeConfig

from .. import names, watch_selectors
from ..no_diffbase import NoDiffBase
from ..status import FAILED_CREATE, FAILED_MOUNT
from . import indexes
from .indexes import CR, MANAGED, ROLE_OBJECTS, Indexes, role_of
from .runtime import Controller
from .settings import Settings

CHILD_KINDS = {
    "StatefulSet": ("apps", "v1", "statefulsets"),
    "Deployment": ("apps", "v1", "deployments"),
    "Service": ("", "v1", "services"),
    "ConfigMap": ("", "v1", "configmaps"),
    "PodDisruptionBudget": ("policy", "v1", "poddisruptionbudgets"),
}
STATUS_KINDS = frozenset({"StatefulSet", "Deployment"})  # the children whose state status reads (observe.py)


def child_event_pass(kind: str, changed: bool) -> bool | None:
    """The pass a child's watch event asks for: full when the child changed under us (a hand edit, a deletion:
    the plan puts it back); a status pass for our own echo or a status-only change of a kind status reads;
    otherwise none (a Service's echo, a PodDisruptionBudget's status: nothing the CR reports moved)."""
    if changed:
        return True
    return False if kind in STATUS_KINDS else None


class Started:
    """The Controller, once the startup handler has made it (kopf runs no event handler before)."""

    def __init__(self) -> None:
        self._controller: Controller | None = None

    def set(self, controller: Controller) -> None:
        self._controller = controller

    @property
    def controller(self) -> Controller:
        if self._controller is None:
            raise RuntimeError("an event handler ran before the operator's startup handler")
        self._controller.poster.bind()  # a handler's context: what Events are posted through
        return self._controller


def configure_kopf(settings: kopf.OperatorSettings, registry: kopf.OperatorRegistry) -> None:
    # kopf's bookkeeping, if a handler ever needs some: annotations under our prefix, never .status (ours).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="serving.disagg.io")
    settings.persistence.diffbase_storage = NoDiffBase()  # the CR's changes: Generations, not a diff
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 300
    settings.networking.request_timeout = 30
    # The handlers' label and field filters, asked of the apiserver too: the operator never receives (nor decodes)
    # the cluster's other pods, Events, Services... (watch_selectors.py).
    watch_selectors.configure(settings, watch_selectors.derive(registry))


def register(registry: kopf.OperatorRegistry, config: Settings) -> Started:
    """Put the operator's indexes and handlers on `registry`. Returns where the Controller will be once started."""
    indexes.register(registry)
    started = Started()

    @kopf.on.login(registry=registry)
    def login(**kw: Any) -> kopf.ConnectionInfo | None:
        """As lightkube's KubeConfig.from_env, which the executors use: the pod's service account, else the
        kubeconfig."""
        return kopf.login_with_service_account(**kw) or kopf.login_with_kubeconfig(**kw)

    @kopf.on.startup(registry=registry)
    async def start(settings: kopf.OperatorSettings, **kw: Any) -> None:
        configure_kopf(settings, registry)
        controller = Controller(config, AsyncClient(KubeConfig.from_env()), Indexes.of(kw))
        controller.start()
        started.set(controller)

    @kopf.on.cleanup(registry=registry)
    async def stop(**_: Any) -> None:
        await started.controller.close()

    @kopf.on.event(*CR, id="dinf", registry=registry)
    async def dinf_event(type: str | None, namespace: str | None, name: str, body: kopf.Body, **_: Any) -> None:
        """A full pass for each generation of a CR (generations.py); its DELETED event removes its binding."""
        if namespace is None:
            return
        c, key = started.controller, (namespace, name)
        if type == "DELETED":
            await c.cr_deleted(key)
            return
        meta = body.metadata
        trigger = c.generations.trigger(key, type, str(meta.get("uid") or ""), int(meta.get("generation") or 0))
        if trigger is not None:
            c.enqueue(key, full=True, trigger=trigger)

    def child(kind: str, group: str, version: str, plural: str) -> None:
        @kopf.on.event(group, version, plural, labels=MANAGED, id=f"child-{plural}", registry=registry)
        async def child_event(type: str | None, body: kopf.Body, namespace: str | None, labels: kopf.Labels,
                              **_: Any) -> None:
            owner = labels.get(names.LABEL_INSTANCE)
            c = started.controller
            if namespace is None or not owner or (namespace, owner) not in c.indexes:
                return
            if type == "DELETED" and not await c.reconciler.exists(namespace, owner):
                return  # the garbage collector is removing the children of a deleted CR: do not recreate them
            full = child_event_pass(kind, c.reconciler.child_changed(kind, dict(body), deleted=type == "DELETED"))
            if full is not None:
                c.enqueue((namespace, owner), full=full, trigger=f"{kind}-event")

    for kind, (group, version, plural) in CHILD_KINDS.items():
        child(kind, group, version, plural)

    @kopf.on.event("", "v1", "events", field="involvedObject.kind", value="StatefulSet", id="statefulset-events",
                   registry=registry)
    async def statefulset_event(type: str | None, body: kopf.Body, namespace: str | None, **_: Any) -> None:
        """A failed pod creation changes Degraded; StatefulSet status has no condition for it. (A successful one
        also creates a pod, whose own event refreshes status.)"""
        if namespace is None or type == "DELETED" or body.get("reason") != FAILED_CREATE:
            return
        owner = names.engine_owner((body.get("involvedObject") or {}).get("name", ""))
        if owner is not None:
            started.controller.enqueue((namespace, owner[0]), full=False, trigger="statefulset-event")

    @kopf.on.event("events.k8s.io", "v1", "events", field="reason", value=FAILED_MOUNT, id="pod-mount-events",
                   registry=registry)
    async def pod_mount_event(type: str | None, body: kopf.Body, namespace: str | None, **_: Any) -> None:
        """A volume an engine pod cannot mount changes Degraded; nothing in the pod's own status changes meanwhile."""
        if namespace is None or type == "DELETED":
            return
        owner = names.engine_pod_owner(str((body.get("regarding") or {}).get("name") or ""))
        if owner is not None:
            started.controller.enqueue((namespace, owner[0]), full=False, trigger="pod-mount-event")

    @kopf.on.event("", "v1", "pods", labels=MANAGED, registry=registry)
    async def engine_pod_event(namespace: str | None, labels: kopf.Labels, **_: Any) -> None:
        owner = labels.get(names.LABEL_INSTANCE)
        if namespace is None or not owner or labels.get(names.LABEL_COMPONENT) not in names.ENGINE_ROLES:
            return
        started.controller.enqueue((namespace, owner), full=False, trigger="pod-event")

    @kopf.on.event(*ROLE_OBJECTS, id="role-objects", registry=registry)
    async def role_event(type: str | None, body: kopf.Body, namespace: str | None, **_: Any) -> None:
        """A role's count changed or its role object was deleted: a status pass decides the counts again (and
        recreates a deleted one), and the rollout moves toward them. The echoes of the operator's own writes are
        not news (RoleScaler.changed)."""
        owner = role_of(body)
        c = started.controller
        if namespace is None or owner is None or (namespace, owner[0]) not in c.indexes:
            return
        if not c.reconciler.scale.changed(namespace, body, deleted=type == "DELETED"):
            return
        if type == "DELETED" and not await c.reconciler.exists(namespace, owner[0]):
            return  # the garbage collector is removing the objects of a deleted CR: do not recreate them
        c.enqueue((namespace, owner[0]), full=False, trigger="role-event")

    return started
