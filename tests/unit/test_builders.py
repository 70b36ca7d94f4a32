"""A CR's children as a whole (operator/builders.py): ownership, selectors, overlays, determinism, names."""
from __future__ import annotations

import json

import pytest
import yaml

from disagg.operator import names
from disagg.operator.builders import build_children
from disagg.operator.merge import deep_merge
from support.crs import UID, engine, env_of, make_cr, pod, statefulset


def test_every_child_is_owned_by_the_cr_in_its_namespace():
    children = build_children(make_cr())
    assert len(children) == 13
    namespaced = [c for c in children if c["kind"] != "ClusterRoleBinding"]
    assert len(namespaced) == 12, "the rendezvous' ClusterRoleBinding is the one child without a namespace"
    for obj in namespaced:
        assert obj["metadata"]["namespace"] == "ml"
        assert obj["metadata"]["ownerReferences"] == [{
            "apiVersion": "serving.disagg.io/v1alpha1", "kind": "DisaggregatedInference", "name": "qwen",
            "uid": UID, "controller": True, "blockOwnerDeletion": True}]
        assert obj["metadata"]["labels"][names.LABEL_INSTANCE] == "qwen"
        assert obj["metadata"]["labels"][names.LABEL_MANAGED_BY] == "disagg-operator"
    rev = statefulset(children, "prefill")["metadata"]["labels"][names.LABEL_REVISION]
    assert len(rev) == names.REVISION_CHARS
    kinds = sorted((c["kind"], c["metadata"]["name"]) for c in children)
    assert kinds == sorted([
        ("ConfigMap", f"qwen-launch-{rev}"), ("Service", "qwen-rendezvous"), ("Deployment", "qwen-rendezvous"),
        ("ServiceAccount", "qwen-rendezvous"), ("ClusterRoleBinding", "disagg-rendezvous:ml:qwen"),
        ("Service", "qwen-prefill"), ("StatefulSet", f"qwen-prefill-{rev}"), ("PodDisruptionBudget", "qwen-prefill"),
        ("Service", "qwen-decode"), ("StatefulSet", f"qwen-decode-{rev}"), ("PodDisruptionBudget", "qwen-decode"),
        ("Service", "qwen-router"), ("Deployment", "qwen-router")])

def test_offline_render_has_no_owner_references():
    for obj in build_children(make_cr(uid=None)):
        assert "ownerReferences" not in obj["metadata"]
        assert names.OWNER_UID_ANNOTATION not in obj["metadata"].get("annotations", {})

def test_selectors_use_only_instance_and_component_and_match_pod_labels():
    children = build_children(make_cr())
    for obj in children:
        if obj["kind"] in ("StatefulSet", "Deployment", "PodDisruptionBudget"):
            selector = obj["spec"]["selector"]["matchLabels"]
        elif obj["kind"] == "Service":
            selector = obj["spec"]["selector"]
        else:
            continue
        # A StatefulSet selects its own revision's pods; Services and PDBs every revision's.
        extra = {names.LABEL_REVISION} if obj["kind"] == "StatefulSet" else set()
        assert set(selector) == {names.LABEL_INSTANCE, names.LABEL_COMPONENT} | extra
        if "template" in obj["spec"]:
            assert selector.items() <= obj["spec"]["template"]["metadata"]["labels"].items()
    assert pod(children, "decode")["metadata"]["labels"]["serving.disagg.io/role"] == "decode"

def test_pod_template_overlay_merges_sidecar_and_env_by_name():
    overlay = {"metadata": {"labels": {names.LABEL_COMPONENT: "hijacked", "team": "ml"}},
               "spec": {"containers": [
                   {"name": "engine", "env": [{"name": "DISAGG_HEARTBEAT_SECONDS", "value": "9"},
                                              {"name": "NEW_VAR", "value": "1"}]},
                   {"name": "log-shipper", "image": "fluent/fluent-bit:3"}]}}
    cr = make_cr({"prefill": {"podTemplate": overlay}})
    template = pod(build_children(cr), "prefill")
    containers = template["spec"]["containers"]
    assert [c["name"] for c in containers] == ["engine", "log-shipper"]
    eng = containers[0]
    assert eng["image"] == "vllm/vllm-openai:v0.32.0"
    assert eng["command"] == ["/bin/sh", "/etc/disagg/prefill.sh"]
    env = env_of(eng)
    assert env["DISAGG_HEARTBEAT_SECONDS"] == "9" and env["NEW_VAR"] == "1"
    assert env["DISAGG_ENGINE_ID"] == "$(POD_NAME)-$(POD_UID)"
    assert eng["resources"]["limits"]["nvidia.com/gpu"] == "4"
    # Selector labels cannot be overlaid away; other labels can be added.
    assert template["metadata"]["labels"][names.LABEL_COMPONENT] == "prefill"
    assert template["metadata"]["labels"]["team"] == "ml"
    # The other role is untouched.
    assert [c["name"] for c in pod(build_children(cr), "decode")["spec"]["containers"]] == ["engine"]

def test_deep_merge_rules():
    base = {"a": {"b": 1, "c": [1, 2]}, "items": [{"name": "x", "v": 1}], "gone": 1}
    merged = deep_merge(base, {"a": {"c": [3]}, "items": [{"name": "x", "w": 2}, {"name": "y"}], "gone": None})
    assert merged == {"a": {"b": 1, "c": [3]}, "items": [{"name": "x", "v": 1, "w": 2}, {"name": "y"}]}
    assert base["items"] == [{"name": "x", "v": 1}] and "gone" in base

def test_build_is_deterministic():
    cr = make_cr({"prefill": {"nodeSelector": {"z": "1", "a": "2"}}, "decode": {"dataParallelSize": 2}})
    first, second = build_children(cr), build_children(make_cr(cr.spec.dump()))
    assert first == second
    assert yaml.safe_dump_all(first) == yaml.safe_dump_all(second)
    assert json.dumps(first) == json.dumps(second)

def test_children_share_no_objects():
    children = build_children(make_cr())
    engine(children, "prefill")["env"].clear()
    assert engine(children, "decode")["env"]

def test_names():
    assert names.engine_name("a", "prefill") == "a-prefill"
    assert names.router_name("a") == "a-router" and names.rendezvous_name("a") == "a-rendezvous"
    assert names.launch_configmap_name("a", "0a1b2c") == "a-launch-0a1b2c"
    assert names.engine_statefulset_name("a", "decode", "0a1b2c") == "a-decode-0a1b2c"
    with pytest.raises(ValueError):
        names.engine_statefulset_name("a", "decode", "legacy")
    # Both StatefulSet names, and the ones made before revisions, lead back to their CR and role.
    assert names.engine_owner("a-decode-0a1b2c") == ("a", "decode")
    assert names.engine_owner("a-prefill") == ("a", "prefill")
    assert names.engine_owner("x-prefill-0a1b2c-decode-ffffff") == ("x-prefill-0a1b2c", "decode")
    assert names.engine_owner("a-router") is None and names.engine_owner("-decode") is None
    with pytest.raises(ValueError):
        names.engine_name("a", "router")
    assert names.labels("a", "router") == {
        "app.kubernetes.io/name": "disagg", "app.kubernetes.io/instance": "a",
        "app.kubernetes.io/component": "router", "app.kubernetes.io/managed-by": "disagg-operator"}

def test_every_field_is_a_real_kubernetes_field():
    """lightkube's typed models drop unknown keys, so a misspelled field breaks the round trip."""
    from lightkube import codecs

    cr = make_cr({"model": {"source": {"hub": {"tokenSecret": {"name": "hf"}}}}, "decode": {"dataParallelSize": 2},
                  "prefill": {"tolerations": [{"key": "k", "operator": "Exists"}]}})
    for cr_ in (cr, make_cr({"model": {"source": {"pvc": {"claimName": "w"}}}}, profile="trainium1")):
        for obj in build_children(cr_):
            assert codecs.from_dict(obj).to_dict() == obj, (obj["kind"], obj["metadata"]["name"])
