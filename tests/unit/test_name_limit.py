"""The longest CR name the API admits (api.NAME_LIMIT, derived in names.py) is exactly the longest for which every
child the builders render, and every name Kubernetes derives from those children, is valid. Checked here against
the rendered objects with the apiserver's own rules, written out independently of names.py."""
from __future__ import annotations

import re

import pytest

from disagg.operator import api, names
from disagg.operator.builders import build_children

DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
LONGEST_NAMESPACE = "n" * 63


def problems_of(cr_name: str, namespace: str = LONGEST_NAMESPACE) -> list[str]:
    """Every invalid name or label value among a CR's children, as the apiserver would see them: the rendered
    objects, the token Secret the reconciler creates, and what the StatefulSet controller derives (pods up to the
    highest ordinal, the controller-revision-hash label: `<statefulset>-` and a hash of up to 10 characters)."""
    out = []

    def check(what: str, value: str, pattern: re.Pattern, limit: int) -> None:
        if len(value) > limit or not pattern.match(value):
            out.append(f"{what}: {value!r} ({len(value)} characters)")

    for auth in ("kubernetes", "token"):
        cr = api.DisaggregatedInference.model_validate({
            "metadata": {"name": cr_name, "namespace": namespace, "uid": "u"},
            "spec": {"model": {"name": "m"}, "accelerator": {"profile": "nvidia-h200"},
                     "rendezvous": {"auth": auth},
                     "prefill": {"replicas": api.MAX_ENGINE_REPLICAS},
                     "decode": {"replicas": api.MAX_ENGINE_REPLICAS}}})
        objs = build_children(cr)
        if auth == "token":
            objs.append({"kind": "Secret", "metadata": {"name": names.rendezvous_token_secret(cr_name), "labels": {}}})
        for obj in objs:
            kind, meta = obj["kind"], obj["metadata"]
            if kind == "Service":
                check("Service name", meta["name"], DNS1035_LABEL, 63)
            elif kind == "ClusterRoleBinding":
                check("ClusterRoleBinding name", meta["name"], re.compile(r"^[^/%]+$"), 253)
            else:
                check(f"{kind} name", meta["name"], DNS1123_SUBDOMAIN, 253)
            labels = dict(meta.get("labels") or {})
            template = obj.get("spec", {}).get("template")
            if template:
                labels.update(template["metadata"].get("labels") or {})
            labels.update(obj.get("spec", {}).get("selector", {}).get("matchLabels") or {})
            for key, value in labels.items():
                check(f"{kind} {meta['name']} label {key}", value, LABEL_VALUE, 63)
            if kind == "StatefulSet":
                check("StatefulSet serviceName", obj["spec"]["serviceName"], DNS1035_LABEL, 63)
                pod = f"{meta['name']}-{obj['spec']['replicas'] - 1}"
                check("pod name (hostname)", pod, DNS1123_LABEL, 63)
                check("pod label statefulset.kubernetes.io/pod-name", pod, LABEL_VALUE, 63)
                check("pod label controller-revision-hash", f"{meta['name']}-{'7' * 10}", LABEL_VALUE, 63)
    return out


def test_every_child_of_a_cr_at_the_limit_is_valid_and_one_past_is_not():
    limit = api.NAME_LIMIT.length
    assert limit == 37, \
        "`<name>-prefill-<revision>-<10-character hash>` is the longest; it must fit 63 characters"
    assert problems_of("a" * limit) == []
    assert problems_of("x" + "-y" * ((limit - 1) // 2)) == [], "a name of dashes at the limit"
    past = problems_of("a" * (limit + 1))
    assert past and all("controller-revision-hash" in p for p in past), past
    # The bound holds in every namespace: the binding name absorbs long namespaces with its hash.
    assert problems_of("a" * limit, namespace="n") == []


def test_the_limit_names_the_child_that_sets_it():
    assert api.NAME_LIMIT.binding == names.DerivedName(
        "prefill pod label controller-revision-hash", "a" * 37 + "-prefill-000000-" + "0" * 10, "label-value")
    rule = next(r for r in api.NAME_RULES if "size()" in r["rule"])
    assert rule["rule"] == "self.size() <= 37"
    assert "at most 37 characters" in rule["messageExpression"] and \
        "<name>-prefill-<revision>-<10-character hash>" in rule["messageExpression"]


def test_more_replicas_would_lower_the_limit_only_once_pod_names_bind():
    # Pod names (`<name>-prefill-<revision>-<ordinal>`) bind before the revision label only with 10-digit ordinals.
    assert names.max_cr_name_length(10 ** 9).length == 37
    assert names.max_cr_name_length(10 ** 11).length == 63 - len("-prefill-000000-") - 11


@pytest.mark.parametrize("name", ["qwen3.5", "3b-llama", "a.b"])
def test_names_the_pattern_rejects_would_give_invalid_services(name):
    assert not re.match(names.CR_NAME_PATTERN, name)
    cr = api.DisaggregatedInference.model_validate({"metadata": {"name": name, "namespace": "ns"}, "spec": {
        "model": {"name": "m"}, "accelerator": {"profile": "nvidia-h200"}}})
    services = [o["metadata"]["name"] for o in build_children(cr) if o["kind"] == "Service"]
    assert any(not DNS1035_LABEL.match(s) for s in services), services


@pytest.mark.parametrize("name", ["a", "qwen3-32b", "llama-3-1-8b"])
def test_ordinary_names_match_the_pattern(name):
    assert re.match(names.CR_NAME_PATTERN, name) and not problems_of(name)
