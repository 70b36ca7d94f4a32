"""Apply a DisaggregatedInference's children and publish its status.

The reconciler is the executor: the builders decide *what* should exist (pure), this module makes the
cluster match with server-side apply under one field manager, and writes status only when it changed.
Hard bounds it enforces:
- every write is a server-side apply with force, so a hand-edited field we own is put back;
- a no-op pass writes nothing (SSA of an unchanged object is not persisted; status is compared first);
- one pass per CR at a time: triggers that arrive during a pass coalesce into one more pass.
"""
from __future__ import annotations

import datetime as dt
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping

from lightkube import AsyncClient, codecs
from lightkube.core.exceptions import ApiError
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.core_v1 import Secret
from lightkube.resources.rbac_authorization_v1 import ClusterRoleBinding
from lightkube.types import PatchType

from . import api, metrics, names
from .builders import OperatorImages, build_children, endpoint_url
from .meta import cr_name as meta_name
from .meta import namespace_of as meta_namespace
from .meta import object_meta
from .status import TRANSPORT_VERIFIED, Observed, compute_status, transport_event

FIELD_MANAGER = "disagg-operator"
DinfResource = create_namespaced_resource(api.GROUP, api.VERSION, api.KIND, api.PLURAL)

Key = tuple[str, str]  # (namespace, name) of a DisaggregatedInference
ChildKey = tuple[str, str, str]  # (kind, namespace, name)


@dataclass
class ApplyOutcome:
    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: int = 0


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def child_marker(obj: Mapping[str, Any]) -> str:
    """What identifies our own write of a child: its generation where it has one (spec changes only), else
    its resourceVersion."""
    meta = obj.get("metadata", {})
    return f"g{meta['generation']}" if meta.get("generation") else f"rv{meta.get('resourceVersion')}"


class Coalescer:
    """At most one pass per key at a time. Triggers that arrive during a pass collapse into one more pass, at
    the strongest level asked for: a full pass if any trigger wanted one, else a status pass."""

    def __init__(self) -> None:
        self._running: set[Key] = set()
        self._again: dict[Key, bool] = {}

    async def run(self, key: Key, full: bool, fn: Callable[[bool], Awaitable[None]]) -> None:
        if key in self._running:
            self._again[key] = self._again.get(key, False) or full
            return
        self._running.add(key)
        try:
            while True:
                await fn(full)
                if key not in self._again:
                    return
                full = self._again.pop(key)
        finally:
            self._running.discard(key)
            self._again.pop(key, None)


class Reconciler:
    def __init__(self, client: AsyncClient, images: OperatorImages, logger: logging.Logger | None = None,
                 namespaces: list[str] | None = None):
        self.client = client
        self.images = images
        # The namespaces this operator serves (None: all). It removes only rendezvous bindings of CRs in them.
        self.namespaces = set(namespaces) if namespaces else None
        self.log = logger or logging.getLogger("disagg.operator")
        self.coalescer = Coalescer()
        # What our last apply of each child produced: a later event with the same marker is our own echo.
        self.applied: dict[ChildKey, str] = {}
        self._token_secrets: set[str] = set()  # CR uids whose token Secret is known to exist
        self._bindings_forbidden = False  # listing ClusterRoleBindings was refused (logged once)
        self._transport_status: dict[Key, str] = {}  # TransportVerified status last published per CR
        self._apply_errors: dict[Key, str] = {}  # CRs whose last full pass had a child refused, and why

    # -- children ----------------------------------------------------------------------------------------
    async def apply_children(self, cr: api.DisaggregatedInference, thorough: bool = False) -> ApplyOutcome:
        """Apply every child; remember a refusal (`apply_error`) until a later pass applies them all."""
        key = (meta_namespace(cr), meta_name(cr))
        try:
            outcome = await self._apply_children(cr, thorough)
        except ApplyFailed as e:
            self._apply_errors[key] = str(e)
            raise
        self._apply_errors.pop(key, None)
        return outcome

    def apply_error(self, key: Key) -> str | None:
        """Why the last full pass of this CR could not apply a child (the apiserver's message), or None."""
        return self._apply_errors.get(key)

    async def _apply_children(self, cr: api.DisaggregatedInference, thorough: bool) -> ApplyOutcome:
        outcome = ApplyOutcome()
        if cr.spec.rendezvous.auth == "token":
            if await self.ensure_token_secret(cr, verify=thorough):
                outcome.created.append(f"Secret/{names.rendezvous_token_secret(meta_name(cr))}")
            binding = names.rendezvous_binding_name(meta_namespace(cr), meta_name(cr))
            if ("ClusterRoleBinding", "", binding) in self.applied:  # switched from kubernetes: revoke it now
                await self.collect_bindings(only=(meta_namespace(cr), meta_name(cr)))
        for obj in build_children(cr, images=self.images):
            kind, ns, name = obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]
            key = (kind, ns, name)
            before = self.applied.get(key)
            t0 = time.monotonic()
            try:
                res = await self._apply(obj)
            except ApiError as e:
                metrics.API_ERRORS.labels(kind=kind, verb="apply").inc()
                hint = ""
                if e.status.code == 403 and kind in ("ServiceAccount", "ClusterRoleBinding"):
                    hint = (" (spec.rendezvous.auth: kubernetes needs the operator to create the rendezvous' "
                            f"ServiceAccount and bind it to {names.AUTH_DELEGATOR}: the chart's rbac.tokenReview; "
                            "or set spec.rendezvous.auth: token)")
                raise ApplyFailed(f"applying {kind} {f'{ns}/' if ns else ''}{name}: {e.status.message}{hint}",
                                  e.status.code) from e
            finally:
                metrics.API_SECONDS.labels(verb="apply").observe(time.monotonic() - t0)
            after_obj = res.to_dict() if hasattr(res, "to_dict") else dict(res)
            after = child_marker(after_obj)
            self.applied[key] = after
            if after_obj["metadata"].get("generation") == 1 and before is None and \
                    after_obj["metadata"].get("resourceVersion") and _fresh(after_obj):
                outcome.created.append(f"{kind}/{name}")
            elif before is not None and before != after:
                outcome.updated.append(f"{kind}/{name}")
            else:
                outcome.unchanged += 1
        return outcome

    async def ensure_token_secret(self, cr: api.DisaggregatedInference, verify: bool) -> bool:
        """Create the rendezvous token Secret once. Not server-side applied: its value is random and must
        survive every later pass, so only its absence is repaired (checked on the first pass for a CR and on
        every resync, so ordinary passes cost no request). Returns whether it was created."""
        uid = cr.metadata.get("uid", "")
        if uid in self._token_secrets and not verify:
            return False
        meta = object_meta(cr, names.rendezvous_token_secret(meta_name(cr)), names.RENDEZVOUS)
        secret = Secret(metadata=codecs.from_dict({"apiVersion": "v1", "kind": "Secret", "metadata": meta}).metadata,
                        type="Opaque", stringData={names.RENDEZVOUS_TOKEN_KEY: secrets.token_urlsafe(32)})
        try:
            await self.client.create(secret)
        except ApiError as e:
            if e.status.code != 409:
                metrics.API_ERRORS.labels(kind="Secret", verb="create").inc()
                raise ApplyFailed(f"creating Secret {meta['name']}: {e.status.message}", e.status.code) from e
            self._token_secrets.add(uid)
            return False
        self._token_secrets.add(uid)
        return True

    async def collect_bindings(self, only: Key | None = None,
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
        selector = {names.LABEL_MANAGED_BY: names.MANAGED_BY, names.LABEL_COMPONENT: names.RENDEZVOUS}
        if only is not None:
            selector.update({names.LABEL_CR_NAMESPACE: only[0], names.LABEL_INSTANCE: only[1]})
        t0 = time.monotonic()
        try:
            bindings = [b async for b in self.client.list(ClusterRoleBinding, labels=selector)]
        except ApiError as e:
            if e.status.code == 403:  # rbac.tokenReview off: then it made no binding either (auth token only)
                if not self._bindings_forbidden:
                    self.log.warning("cannot list ClusterRoleBindings (%s): rendezvous bindings of deleted CRs "
                                     "are not removed; CRs need spec.rendezvous.auth: token", e.status.message)
                self._bindings_forbidden = True
                return []
            metrics.API_ERRORS.labels(kind="ClusterRoleBinding", verb="list").inc()
            raise
        finally:
            metrics.API_SECONDS.labels(verb="list").observe(time.monotonic() - t0)
        deleted = []
        for binding in bindings:
            owner = self._binding_owner(binding)
            if owner is None or (only is not None and owner != only) or owner in needed or \
                    await self._needs_binding(*owner):
                continue
            meta = binding.metadata
            try:
                await self._delete_exact(ClusterRoleBinding, meta.name, meta.uid, meta.resourceVersion)
            except ApiError as e:
                if e.status.code in (404, 409):  # gone already, or changed since we looked: not ours to delete
                    continue
                metrics.API_ERRORS.labels(kind="ClusterRoleBinding", verb="delete").inc()
                raise
            self.applied.pop(("ClusterRoleBinding", "", meta.name), None)
            metrics.CHILD_WRITES.labels(kind="ClusterRoleBinding", change="deleted").inc()
            self.log.info("deleted ClusterRoleBinding %s: %s/%s no longer needs it", meta.name, *owner)
            deleted.append(meta.name)
        return deleted

    def _binding_owner(self, binding: ClusterRoleBinding) -> Key | None:
        """The (namespace, name) of the CR a binding was made for, or None when it is not one of ours."""
        meta = binding.metadata
        namespace, _, name = (meta.annotations or {}).get(names.OWNER_ANNOTATION, "").partition("/")
        if not namespace or not name or (meta.labels or {}).get(names.LABEL_CR_NAMESPACE) != namespace:
            return None
        if meta.name != names.rendezvous_binding_name(namespace, name) or \
                binding.roleRef.name != names.AUTH_DELEGATOR:
            return None
        if self.namespaces is not None and namespace not in self.namespaces:
            return None  # another operator's (or nobody's we may judge)
        return namespace, name

    async def _needs_binding(self, namespace: str, name: str) -> bool:
        """Ask the apiserver (an index can lag a creation as well as a deletion)."""
        try:
            obj = await self.client.get(DinfResource, name, namespace=namespace)
        except ApiError as e:
            if e.status.code == 404:
                return False
            raise
        if obj.metadata.deletionTimestamp is not None:
            return False
        # The CRD defaults the field; an object stored before it existed reads as the default, kubernetes.
        return ((obj.get("spec") or {}).get("rendezvous") or {}).get("auth", "kubernetes") == "kubernetes"

    async def _delete_exact(self, res: type, name: str, uid: str, resource_version: str) -> None:
        """DELETE with DeleteOptions preconditions (lightkube's delete sends no body, so build the request on
        its generic client: same connection, same credentials)."""
        generic = self.client._client
        request = generic.prepare_request("delete", res=res, name=name)
        request.data = {"apiVersion": "v1", "kind": "DeleteOptions",
                        "preconditions": {"uid": uid, "resourceVersion": resource_version}}
        t0 = time.monotonic()
        try:
            response = await generic.send(generic.build_adapter_request(request))
            generic.handle_response("delete", response, request)
        finally:
            metrics.API_SECONDS.labels(verb="delete").observe(time.monotonic() - t0)

    async def _apply(self, obj: dict[str, Any]):
        resource = codecs.from_dict(obj)
        try:
            return await self.client.apply(resource, field_manager=FIELD_MANAGER, force=True)
        except ApiError as e:
            if e.status.code != 422:
                raise
        # Server-side apply merges list entries by key, so an entry someone else added by hand survives our
        # apply and can make the result invalid (two Service ports named "http"). A JSON merge patch replaces
        # lists wholesale: it puts our lists back, then the apply takes ownership again.
        self.log.info("apply of %s %s was invalid; repairing hand-edited lists with a merge patch",
                      obj["kind"], obj["metadata"]["name"])
        await self.client.patch(type(resource), obj["metadata"]["name"], obj, namespace=obj["metadata"].get("namespace"),
                                patch_type=PatchType.MERGE, field_manager=FIELD_MANAGER)
        return await self.client.apply(resource, field_manager=FIELD_MANAGER, force=True)

    async def exists(self, namespace: str, name: str) -> bool:
        """Ask the apiserver, not the watch cache: a deletion may not have reached our index yet."""
        try:
            obj = await self.client.get(DinfResource, name, namespace=namespace)
        except ApiError as e:
            if e.status.code == 404:
                return False
            raise
        return obj.metadata.deletionTimestamp is None

    def is_own_echo(self, kind: str, body: Mapping[str, Any]) -> bool:
        meta = body.get("metadata", {})
        return self.applied.get((kind, meta.get("namespace", ""), meta.get("name", ""))) == child_marker(body)

    # -- status ------------------------------------------------------------------------------------------
    async def publish_status(self, cr: api.DisaggregatedInference, body: Mapping[str, Any],
                             observed: Observed) -> dict[str, Any] | None:
        """Write the status if it changed. Returns the status, or None when the CR is gone."""
        meta = body["metadata"]
        previous = dict(body.get("status") or {})
        status = compute_status(cr.spec, int(meta.get("generation", 0)), observed, endpoint_url(cr), previous,
                                _now())
        if _same_status(previous, status):
            return status
        try:
            await self.client.patch(DinfResource.Status, meta["name"], {"status": status},
                                    namespace=meta["namespace"], patch_type=PatchType.MERGE)
        except ApiError as e:
            metrics.API_ERRORS.labels(kind=api.KIND, verb="patch-status").inc()
            if e.status.code == 404:  # deleted meanwhile
                return None
            raise
        metrics.STATUS_WRITES.inc()
        return status

    def transport_event(self, key: Key, previous: Mapping[str, Any] | None,
                        status: Mapping[str, Any]) -> tuple[str, str, str] | None:
        """The Event for a TransportVerified transition, once per transition. What this process last published
        beats the status it read, which can lag our own write; after a restart the stored status is the memory."""
        cond = next(c for c in status["conditions"] if c["type"] == TRANSPORT_VERIFIED)
        stored = next((c for c in (previous or {}).get("conditions", []) or [] if c.get("type") == TRANSPORT_VERIFIED),
                      None)
        before = self._transport_status.get(key, stored.get("status") if stored else None)
        self._transport_status[key] = cond["status"]
        return transport_event(before, cond)

    def forget(self, key: Key) -> None:
        self._transport_status.pop(key, None)
        self._apply_errors.pop(key, None)


class ApplyFailed(RuntimeError):
    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def _fresh(obj: Mapping[str, Any], seconds: float = 30) -> bool:
    ts = obj.get("metadata", {}).get("creationTimestamp")
    if not ts:
        return False
    created = dt.datetime.fromisoformat(str(ts).replace("Z", "+00:00"))
    return (dt.datetime.now(dt.timezone.utc) - created).total_seconds() < seconds


def _same_status(previous: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    # Compare only what we own; other writers' keys (none expected) are left alone by a merge patch anyway.
    return all(previous.get(k) == v for k, v in new.items())
