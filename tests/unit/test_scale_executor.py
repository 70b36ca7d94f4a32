"""The role objects' writes (operator/scale_executor.py) against a fake apiserver: every write is conditional on what
was read, a conflict is read and decided again, and a refusal leaves the roles running. The same on the real
apiserver: tests/cluster/test_scale.py."""
from __future__ import annotations

import asyncio
import copy
from typing import Any

import httpx2
from lightkube.core.exceptions import ApiError
from lightkube.models.meta_v1 import Status

from disagg.operator.api import DisaggregatedInferenceStatus, RoleStatus
from disagg.operator.scale.objects import live_role
from disagg.operator.scale_executor import RoleScaler
from support.crs import make_cr


def _api_error(code: int, message: str = "") -> ApiError:
    err = ApiError.__new__(ApiError)
    err.status = Status(code=code, message=message or f"HTTP {code}")
    return err


class FakeApiserver:
    """Role objects by name, with resourceVersions: a create of an existing one and a patch carrying an old
    resourceVersion are refused with 409, as the apiserver does."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.version = 10
        self.calls: list[str] = []
        self.missing_crd = False

    def _stored(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        return copy.deepcopy(obj)

    async def create(self, obj, field_manager=None):
        body = obj.to_dict()
        name = body["metadata"]["name"]
        self.calls.append(f"create {name}")
        if self.missing_crd:  # the apiserver's answer is no Status but "404 page not found": lightkube passes it on
            url = "https://apiserver/apis/serving.disagg.io/v1alpha1/namespaces/ml/disaggregatedroles"
            raise httpx2.HTTPStatusError("404 Not Found", request=httpx2.Request("POST", url),
                                         response=httpx2.Response(404, text="404 page not found\n"))
        if name in self.objects:
            raise _api_error(409, "already exists")
        body["metadata"]["generation"] = 1
        self.objects[name] = body
        return self._stored(body)

    async def patch(self, res, name, body, namespace=None, patch_type=None, field_manager=None):
        self.calls.append(f"patch {name}")
        obj = self.objects[name]
        if body["metadata"]["resourceVersion"] != obj["metadata"]["resourceVersion"]:
            raise _api_error(409, "the object has been modified")
        annotations = {**obj["metadata"].get("annotations", {}), **body["metadata"]["annotations"]}
        obj["metadata"]["annotations"] = {k: v for k, v in annotations.items() if v is not None}
        obj["metadata"]["ownerReferences"] = body["metadata"]["ownerReferences"]
        if obj["spec"]["replicas"] != body["spec"]["replicas"]:
            obj["spec"]["replicas"] = body["spec"]["replicas"]
            obj["metadata"]["generation"] += 1
        return self._stored(obj)

    async def get(self, res, name, namespace=None):
        self.calls.append(f"get {name}")
        if name not in self.objects:
            raise _api_error(404)
        return copy.deepcopy(self.objects[name])

    def scale(self, name: str, replicas: int) -> None:
        """What `kubectl scale` or an HPA does: a new count, a new generation and resourceVersion."""
        obj = self.objects[name]
        obj["spec"]["replicas"] = replicas
        obj["metadata"]["generation"] += 1
        self._stored(obj)

    def live(self) -> dict:
        return {obj["spec"]["role"]: live_role(obj) for obj in self.objects.values()}


async def _there() -> bool:
    return True


def sync(api: FakeApiserver, cr, live):
    scaler = RoleScaler(api)  # type: ignore[arg-type]
    return scaler, asyncio.run(scaler.sync(cr, live, _there))


def test_role_objects_are_created_from_the_spec_once_and_then_left_alone():
    api = FakeApiserver()
    cr = make_cr({"decode": {"replicas": 2}})
    _, first = sync(api, cr, {})
    assert first.desired() == (1, 2) and api.calls == ["create qwen-prefill", "create qwen-decode"]
    assert [c.split(" (")[0] for c in first.created] == ["DisaggregatedRole/qwen-prefill",
                                                        "DisaggregatedRole/qwen-decode"]
    api.calls.clear()
    _, again = sync(api, cr, api.live())
    assert again.desired() == (1, 2) and api.calls == [] and not again.created and not again.updated


def test_a_create_that_finds_the_object_reads_it_and_keeps_a_scalers_count():
    """The watch has not shown the role object yet, which an HPA already scaled: the create is refused, and the
    object read back decides."""
    api = FakeApiserver()
    cr = make_cr({"decode": {"replicas": 1}})
    sync(api, cr, {})
    api.scale("qwen-decode", 3)
    api.calls.clear()
    _, result = sync(api, cr, {"prefill": api.live()["prefill"]})
    assert api.calls == ["create qwen-decode", "get qwen-decode"]
    assert result.desired() == (1, 3) and api.objects["qwen-decode"]["spec"]["replicas"] == 3


def test_an_update_on_a_stale_object_is_refused_read_again_and_decided_again():
    api = FakeApiserver()
    sync(api, make_cr({"decode": {"replicas": 1}}), {})
    stale = api.live()
    api.scale("qwen-decode", 4)  # after the watch's view: the operator's update carries an old resourceVersion
    api.calls.clear()
    _, result = sync(api, make_cr({"decode": {"replicas": 2}}), stale)
    assert api.calls == ["patch qwen-decode", "get qwen-decode", "patch qwen-decode"]
    assert result.desired() == (1, 2), "the edit of spec.decode.replicas wins, on the object as it is now"
    assert api.objects["qwen-decode"]["metadata"]["annotations"] == {"serving.disagg.io/spec-replicas": "2"}


def test_without_the_role_crd_the_roles_follow_the_spec_and_say_why():
    api = FakeApiserver()
    api.missing_crd = True
    _, result = sync(api, make_cr({"decode": {"replicas": 2}}), {})
    assert result.desired() == (1, 2)
    assert result.code == 404 and result.error == (
        "creating DisaggregatedRole qwen-prefill: 404 page not found (is the DisaggregatedRole CRD installed? apply "
        "crds/ before upgrading the operator)")


def test_a_deleted_role_object_comes_back_at_the_count_the_status_remembers():
    api = FakeApiserver()
    cr = make_cr({"decode": {"replicas": 1}})
    cr.status = DisaggregatedInferenceStatus(observed_generation=2, prefill=RoleStatus(desired=1, spec_replicas=None),
                                             decode=RoleStatus(desired=3, spec_replicas=1))
    _, result = sync(api, cr, {})
    assert result.desired() == (1, 3) and api.objects["qwen-decode"]["spec"]["replicas"] == 3


def test_only_news_of_a_role_object_asks_for_a_pass():
    api = FakeApiserver()
    scaler, _ = sync(api, make_cr(), {})
    body = copy.deepcopy(api.objects["qwen-decode"])
    assert not scaler.changed("ml", body, deleted=False), "the echo of the operator's own create"
    body["status"] = {"replicas": 1}
    assert not scaler.changed("ml", body, deleted=False), "a status write: same generation"
    api.scale("qwen-decode", 2)
    assert scaler.changed("ml", api.objects["qwen-decode"], deleted=False), "a scale: a new generation"
    assert scaler.changed("ml", body, deleted=True)
