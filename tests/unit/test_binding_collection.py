"""Which rendezvous ClusterRoleBindings the operator deletes (Reconciler.collect_bindings), against a fake client:
only its own, only for CRs in namespaces it serves, and only when their CR no longer needs one. The same on the
real apiserver: tests/cluster/test_rendezvous_binding.py."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest
from lightkube import codecs
from lightkube.core.exceptions import ApiError
from lightkube.models.meta_v1 import Status

from disagg.operator.api import DisaggregatedInference
from disagg.operator.builders import build_children
from disagg.operator.meta import OperatorImages
from disagg.operator.reconciler import Reconciler


def _api_error(code: int) -> ApiError:
    err = ApiError.__new__(ApiError)
    err.status = Status(code=code, message=f"HTTP {code}")
    return err


def cr(name: str, namespace: str = "ml", auth: str = "kubernetes") -> DisaggregatedInference:
    return DisaggregatedInference.model_validate({
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}"},
        "spec": {"model": {"name": "m"}, "accelerator": {"profile": "nvidia-h200"}, "rendezvous": {"auth": auth}}})


def binding(cr_name: str, namespace: str = "ml", **meta: Any):
    """The binding the builders make for CR `cr_name`, as listed from the apiserver; `meta` overrides metadata."""
    [obj] = [o for o in build_children(cr(cr_name, namespace)) if o["kind"] == "ClusterRoleBinding"]
    obj["metadata"].update(uid=f"b-{namespace}-{cr_name}", resourceVersion="7", **meta)
    return codecs.from_dict(obj)


class FakeClient:
    def __init__(self, bindings, crs: dict[tuple[str, str], dict | None]):
        self.bindings, self.crs = bindings, crs
        self.gets: list[tuple[str, str]] = []
        self.listed_with: dict[str, str] | None = None

    async def list(self, res, labels=None):
        self.listed_with = labels
        for b in self.bindings:
            if all((b.metadata.labels or {}).get(k) == v for k, v in (labels or {}).items()):
                yield b

    async def get(self, res, name, namespace=None):
        self.gets.append((namespace, name))
        body = self.crs.get((namespace, name))
        if body is None:
            raise _api_error(404)
        return res(body)


def reconciler(client: FakeClient, namespaces=None, fail: dict[str, int] | None = None) -> tuple[Reconciler, list]:
    r = Reconciler(client, OperatorImages(), namespaces=namespaces)  # type: ignore[arg-type]
    deleted: list[tuple[str, str, str]] = []

    async def delete_exact(res, name, uid, rv):
        if fail and name in fail:
            raise _api_error(fail[name])
        deleted.append((name, uid, rv))

    r.bindings.delete_exact = delete_exact  # type: ignore[method-assign]
    return r, deleted


def live(name: str, namespace: str = "ml", auth: str | None = "kubernetes", deleting: bool = False) -> dict:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "uid": f"uid-{name}"}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "spec": {"rendezvous": {"auth": auth}} if auth else {}}


def test_deletes_bindings_whose_cr_is_gone_deleting_or_on_token_and_keeps_the_rest():
    client = FakeClient(
        [binding(n) for n in ("gone", "deleting", "token", "alive", "old", "indexed")],
        {("ml", "deleting"): live("deleting", deleting=True), ("ml", "token"): live("token", auth="token"),
         ("ml", "alive"): live("alive"), ("ml", "old"): live("old", auth=None)})
    r, deleted = reconciler(client)
    names = asyncio.run(r.collect_bindings(needed={("ml", "indexed")}))
    assert names == ["disagg-rendezvous:ml:gone", "disagg-rendezvous:ml:deleting", "disagg-rendezvous:ml:token"]
    # Preconditions: exactly the UID and resourceVersion that were judged.
    assert deleted[0] == ("disagg-rendezvous:ml:gone", "b-ml-gone", "7")
    assert ("ml", "indexed") not in client.gets, "a CR the index knows needs no API call"
    assert ("ml", "old") in client.gets  # stored before the field existed: kubernetes, kept
    assert client.listed_with == {"app.kubernetes.io/managed-by": "disagg-operator",
                                  "app.kubernetes.io/component": "rendezvous"}


def test_never_deletes_what_it_did_not_make_or_does_not_serve():
    client = FakeClient([
        binding("renamed", name="some-other-name"),
        binding("annotated", annotations={"serving.disagg.io/owner": "elsewhere/annotated"}),
        binding("unannotated", annotations={}),
        binding("team-b", namespace="team-b"),
    ], {})
    # Another role than system:auth-delegator.
    other_role = binding("viewer")
    other_role.roleRef.name = "view"
    client.bindings.append(other_role)
    r, deleted = reconciler(client, namespaces=["ml"])
    assert asyncio.run(r.collect_bindings()) == []
    assert client.gets == [], "nothing looked like ours, so no CR was even looked up"
    # Served namespaces: the cluster-wide operator does judge team-b's.
    r, deleted = reconciler(client)
    assert asyncio.run(r.collect_bindings()) == ["disagg-rendezvous:team-b:team-b"]


def test_only_one_cr_and_tolerates_races():
    client = FakeClient([binding("a"), binding("b"), binding("c")], {})
    r, deleted = reconciler(client, fail={"disagg-rendezvous:ml:b": 409})
    assert asyncio.run(r.collect_bindings(only=("ml", "a"))) == ["disagg-rendezvous:ml:a"]
    assert client.listed_with["app.kubernetes.io/instance"] == "a"
    assert client.listed_with["serving.disagg.io/namespace"] == "ml"
    # b changed since it was listed (409): left alone; c is removed.
    assert asyncio.run(r.collect_bindings()) == ["disagg-rendezvous:ml:a", "disagg-rendezvous:ml:c"]
    r, deleted = reconciler(FakeClient([binding("b")], {}), fail={"disagg-rendezvous:ml:b": 500})
    with pytest.raises(ApiError):
        asyncio.run(r.collect_bindings())
