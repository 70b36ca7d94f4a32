"""The one child garbage collection cannot remove: the rendezvous' ClusterRoleBinding (spec.rendezvous.auth:
kubernetes). It is cluster-scoped, so the namespaced CR cannot own it, and a finalizer would make CRs undeletable
while the operator is down; so the operator finds and deletes the bindings it made whose CR no longer needs one.

Invariants: only bindings this operator made are candidates (its labels, the `disagg-rendezvous:` name pattern,
the system:auth-delegator role, an owner annotation that agrees with the labels, a CR in a namespace it serves);
the CR is asked of the apiserver unless the caller's index already says it needs one; every delete carries the
UID and resourceVersion that were judged as preconditions.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.rbac_authorization_v1 import ClusterRoleBinding

from . import api, metrics, names
from .names import Key

DinfResource = create_namespaced_resource(api.GROUP, api.VERSION, api.KIND, api.PLURAL)


async def live_cr(client: AsyncClient, namespace: str, name: str) -> Any | None:
    """The CR as the apiserver has it now, or None when it is gone or being deleted. Asks the apiserver, not a
    watch index: an index can lag a creation as well as a deletion."""
    try:
        obj = await client.get(DinfResource, name, namespace=namespace)
    except ApiError as e:
        if e.status.code == 404:
            return None
        raise
    # metadata is optional in lightkube's model; an object without it is not being deleted.
    if obj.metadata is not None and obj.metadata.deletionTimestamp is not None:
        return None
    return obj



class BindingCollector:
    def __init__(self, client: AsyncClient, namespaces: set[str] | None, log: logging.Logger):
        self.client = client
        self.namespaces = namespaces  # the namespaces the operator serves (None: all)
        self.log = log
        self._forbidden = False  # listing ClusterRoleBindings was refused (logged once)

    async def collect(self, only: Key | None = None,
                      needed: frozenset[Key] | set[Key] = frozenset()) -> list[str]:
        """Delete the rendezvous ClusterRoleBindings (auth kubernetes) that no CR needs any more: their CR is
        gone or being deleted, or now uses auth token. Garbage collection cannot do this (a cluster-scoped
        object cannot be owned by a namespaced one) and a finalizer would make CRs undeletable while the
        operator is down, so the resync calls this every round, and a CR's DELETED event for that CR.

        Only bindings this operator made are candidates: its labels, the `disagg-rendezvous:` name, the
        auth-delegator role, and a CR in a namespace it serves. Each delete carries the binding's UID and
        resourceVersion as preconditions, so a binding re-applied meanwhile (a CR recreated under the same
        name) is left alone. `needed`: CRs known (from the watch index) to use auth kubernetes, whose bindings
        are kept without asking the apiserver. Returns the names deleted."""
        selector: dict[str, Any] = {names.LABEL_MANAGED_BY: names.MANAGED_BY, names.LABEL_COMPONENT: names.RENDEZVOUS}
        if only is not None:
            selector.update({names.LABEL_CR_NAMESPACE: only[0], names.LABEL_INSTANCE: only[1]})
        t0 = time.monotonic()
        try:
            bindings = [b async for b in self.client.list(ClusterRoleBinding, labels=selector)]
        except ApiError as e:
            if e.status.code == 403:  # rbac.tokenReview off: then it made no binding either (auth token only)
                if not self._forbidden:
                    self.log.warning("cannot list ClusterRoleBindings (%s): rendezvous bindings of deleted CRs "
                                     "are not removed; CRs need spec.rendezvous.auth: token", e.status.message)
                self._forbidden = True
                return []
            metrics.API_ERRORS.labels(kind="ClusterRoleBinding", verb="list").inc()
            raise
        finally:
            metrics.API_SECONDS.labels(verb="list").observe(time.monotonic() - t0)
        deleted = []
        for binding in bindings:
            owner = self.owner(binding)
            if owner is None or (only is not None and owner != only) or owner in needed or \
                    await self.needs_binding(*owner):
                continue
            meta = binding.metadata
            if meta is None or not (meta.name and meta.uid and meta.resourceVersion):
                continue  # owner() found a name; the apiserver always sets uid and resourceVersion
            try:
                await self.delete_exact(ClusterRoleBinding, meta.name, meta.uid, meta.resourceVersion)
            except ApiError as e:
                if e.status.code in (404, 409):  # gone already, or changed since we looked: not ours to delete
                    continue
                metrics.API_ERRORS.labels(kind="ClusterRoleBinding", verb="delete").inc()
                raise
            metrics.CHILD_WRITES.labels(kind="ClusterRoleBinding", change="deleted").inc()
            self.log.info("deleted ClusterRoleBinding %s: %s/%s no longer needs it", meta.name, *owner)
            deleted.append(meta.name)
        return deleted

    def owner(self, binding: ClusterRoleBinding) -> Key | None:
        """The (namespace, name) of the CR a binding was made for, or None when it is not one of ours."""
        meta = binding.metadata
        if meta is None:
            return None
        namespace, _, name = (meta.annotations or {}).get(names.OWNER_ANNOTATION, "").partition("/")
        if not namespace or not name or (meta.labels or {}).get(names.LABEL_CR_NAMESPACE) != namespace:
            return None
        if meta.name != names.rendezvous_binding_name(namespace, name) or \
                binding.roleRef.name != names.AUTH_DELEGATOR:
            return None
        if self.namespaces is not None and namespace not in self.namespaces:
            return None  # another operator's (or nobody's we may judge)
        return namespace, name

    async def needs_binding(self, namespace: str, name: str) -> bool:
        """Whether a live CR asks for `auth: kubernetes` (see `live_cr`)."""
        obj = await live_cr(self.client, namespace, name)
        if obj is None:
            return False
        # Only the field that decides, parsed by its model: an object stored before the field existed reads as the
        # model's (and the CRD's) default, kubernetes.
        rendezvous = api.RendezvousSpec.model_validate((obj.get("spec") or {}).get("rendezvous") or {})
        return rendezvous.auth == "kubernetes"

    async def delete_exact(self, res: type, name: str, uid: str, resource_version: str) -> None:
        """DELETE with DeleteOptions preconditions (lightkube's delete sends no body, so build the request on
        its generic client: same connection, same credentials)."""
        generic = self.client._client
        request = generic.prepare_request("delete", res=res, name=name)
        request.data = {"apiVersion": "v1", "kind": "DeleteOptions",
                        "preconditions": {"uid": uid, "resourceVersion": resource_version}}
        t0 = time.monotonic()
        try:
            response = await generic.send(generic.build_adapter_request(request))  # type: ignore[no-untyped-call]
            generic.handle_response("delete", response, request)
        finally:
            metrics.API_SECONDS.labels(verb="delete").observe(time.monotonic() - t0)

