"""Helpers for tests against a real apiserver: await conditions through watches, never by sleeping."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import yaml
from lightkube import AsyncClient, KubeConfig
from lightkube.core.exceptions import ApiError
from lightkube.models.authentication_v1 import TokenRequestSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Event, ServiceAccount

T = TypeVar("T")


async def _watch_until(kubeconfig: Path, res: type[T], name: str, predicate: Callable[[T], bool],
                       namespace: str | None, timeout: float, what: str, gone_ok: bool) -> T | None:
    client = AsyncClient(KubeConfig.from_file(kubeconfig))
    last: T | None = None
    try:
        async with asyncio.timeout(timeout):
            try:
                last = await client.get(res, name, namespace=namespace)
                if predicate(last):
                    return last
                rv = last.metadata.resourceVersion
            except ApiError as e:
                if e.status.code != 404:
                    raise
                if gone_ok:
                    return None
                rv = None
            async for op, obj in client.watch(res, namespace=namespace, fields={"metadata.name": name},
                                              resource_version=rv):
                if op == "DELETED" and gone_ok:
                    return None
                last = obj
                if predicate(obj):
                    return obj
    except TimeoutError:
        raise TimeoutError(f"{res.__name__} {namespace}/{name}: {what} not reached in {timeout}s; "
                           f"last: {last}") from None
    finally:
        await client.close()
    raise AssertionError("watch ended")


def watch_until(cluster, res: type[T], name: str, predicate: Callable[[T], bool], *,
                namespace: str | None = None, timeout: float = 60, what: str = "condition",
                gone_ok: bool = False) -> T:
    """Return the object once `predicate` holds, following a watch from the current resourceVersion.
    With gone_ok, the object's deletion (or absence) also ends the wait, returning None."""
    return asyncio.run(_watch_until(cluster.kubeconfig, res, name, predicate, namespace, timeout, what, gone_ok))


def condition(obj, ctype: str):
    return next((c for c in (obj.status.conditions or []) if c.type == ctype), None) if obj.status else None


def pod_ready(pod) -> bool:
    c = condition(pod, "Ready")
    return c is not None and c.status == "True"


def pod_unschedulable(pod) -> bool:
    c = condition(pod, "PodScheduled")
    return c is not None and c.status == "False" and c.reason == "Unschedulable"


async def _watch_list_until(kubeconfig: Path, res: type[T], predicate: Callable[[T], bool], namespace: str | None,
                            fields: dict[str, str] | None, timeout: float, what: str) -> T:
    client = AsyncClient(KubeConfig.from_file(kubeconfig))
    seen: list[T] = []
    try:
        async with asyncio.timeout(timeout):
            async for _op, obj in client.watch(res, namespace=namespace, fields=fields):
                seen.append(obj)  # the watch starts with the existing objects (ADDED), then follows changes
                if predicate(obj):
                    return obj
    except TimeoutError:
        raise TimeoutError(f"no {res.__name__} in {namespace}: {what} in {timeout}s; saw: {seen[-5:]}") from None
    finally:
        await client.close()
    raise AssertionError("watch ended")


def watch_list_until(cluster, res: type[T], predicate: Callable[[T], bool], *, namespace: str | None = None,
                     fields: dict[str, str] | None = None, timeout: float = 60, what: str = "condition") -> T:
    """Return the first object of a kind (existing or new) for which `predicate` holds: for objects whose name is
    not known in advance, such as Events."""
    return asyncio.run(_watch_list_until(cluster.kubeconfig, res, predicate, namespace, fields, timeout, what))


async def _events_until(kubeconfig: Path, namespace: str, name: str, reason: str,
                        done: Callable[[list[Event]], bool], timeout: float, what: str) -> list[Event]:
    client = AsyncClient(KubeConfig.from_file(kubeconfig))
    fields = {"involvedObject.name": name, "reason": reason}
    # Per Event name: its place in the record (its first resourceVersion; a repeat bumps it) and its latest form.
    seen: dict[str, tuple[int, Event]] = {}

    def ordered() -> list[Event]:
        return [e for _, e in sorted(seen.values(), key=lambda p: p[0])]

    def record(e: Event) -> None:
        first = seen[e.metadata.name][0] if e.metadata.name in seen else int(e.metadata.resourceVersion)
        seen[e.metadata.name] = (first, e)

    try:
        async with asyncio.timeout(timeout):
            # A list is a complete snapshot; a watch's initial ADDED burst is not ordered, so a predicate on order
            # could hold on part of it.
            listing = client.list(Event, namespace=namespace, fields=fields)
            async for e in listing:
                record(e)
            if done(ordered()):
                return ordered()
            async for op, e in client.watch(Event, namespace=namespace, fields=fields,
                                            resource_version=listing.resourceVersion):
                if op == "DELETED":
                    continue
                record(e)
                if done(ordered()):
                    return ordered()
    except TimeoutError:
        raise TimeoutError(f"{reason} Events on {namespace}/{name}: {what} not reached in {timeout}s; saw: "
                           f"{[e.message for e in ordered()]}") from None
    finally:
        await client.close()
    raise AssertionError("watch ended")


def events_until(cluster, namespace: str, name: str, reason: str, done: Callable[[list[Event]], bool], *,
                 timeout: float = 30, what: str = "condition") -> list[Event]:
    """The Events of one reason about the object `name`, in the order they were first recorded, once `done`
    holds for them. A controller posts an Event apart from its status write, so an Event can trail the status
    that reports the same change."""
    return asyncio.run(_events_until(cluster.kubeconfig, namespace, name, reason, done, timeout, what))


def _await_service_account(cluster, namespace: str, sa: str, timeout: int = 60) -> None:
    """Synchronous (callers may run inside an event loop, where watch_until's asyncio.run cannot). A watch from
    no resourceVersion starts with an ADDED event for an object that already exists."""
    for op, _obj in cluster.client.watch(ServiceAccount, namespace=namespace, fields={"metadata.name": sa},
                                         server_timeout=timeout):
        if op == "ADDED":
            return
    raise TimeoutError(f"ServiceAccount {namespace}/{sa} not created within {timeout}s")


def service_account_token(cluster, namespace: str, sa: str) -> str:
    """A bound token for the ServiceAccount, for the apiserver's audience, from the TokenRequest API. Waits for
    the ServiceAccount first: a new namespace's `default` one is created by the controller manager, later."""
    _await_service_account(cluster, namespace, sa)
    request = ServiceAccount.Token(metadata=ObjectMeta(), spec=TokenRequestSpec(audiences=[], expirationSeconds=3600))
    token: str = cluster.client.create(request, name=sa, namespace=namespace).status.token
    return token


def token_kubeconfig(cluster, namespace: str, sa: str, path: Path) -> Path:
    """A kubeconfig that authenticates as the ServiceAccount with a bound token from the TokenRequest API."""
    token = service_account_token(cluster, namespace, sa)
    admin = yaml.safe_load(Path(cluster.kubeconfig).read_text())
    context = next(c for c in admin["contexts"] if c["name"] == admin["current-context"])["context"]
    server = next(c for c in admin["clusters"] if c["name"] == context["cluster"])
    user = f"system:serviceaccount:{namespace}:{sa}"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "sa",
        "clusters": [server], "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": server["name"], "user": user, "namespace": namespace}}],
    }))
    path.chmod(0o600)
    return path
