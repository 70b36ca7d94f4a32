"""The generated CRD: committed copies match the models, the schema is structural and fully documented."""
from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from disagg.operator import api, crdgen, role_api

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / crdgen.CRD_FILENAME
CHART_CRD_PATH = ROOT / "charts" / "disagg-operator" / "crds" / crdgen.CRD_FILENAME

# Keywords a structural schema node may carry (apiextensions v1 JSONSchemaProps we use).
ALLOWED_KEYS = {
    "type", "description", "properties", "required", "items", "additionalProperties", "default", "enum",
    "minimum", "maximum", "minLength", "maxLength", "pattern", "minItems", "maxItems",
    "x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields", "x-kubernetes-validations",
    "x-kubernetes-list-type", "x-kubernetes-list-map-keys",
}


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    return yaml.safe_load(crdgen.render())


@pytest.fixture(scope="module")
def schema(crd) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def walk(node: dict[str, Any], path: str = "", is_property: bool = False) \
        -> Iterator[tuple[str, dict[str, Any], bool]]:
    """Every schema node with its path, and whether it is a named property (as opposed to items/values)."""
    yield path, node, is_property
    for name, sub in node.get("properties", {}).items():
        yield from walk(sub, f"{path}.{name}", True)
    if isinstance(node.get("items"), dict):
        yield from walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}{{}}")


def test_committed_crd_matches_the_models():
    assert CRD_PATH.exists(), f"{CRD_PATH.relative_to(ROOT)} is missing; {crdgen.REGENERATE}"
    assert CRD_PATH.read_text() == crdgen.render(), \
        f"{CRD_PATH.relative_to(ROOT)} is stale: operator/api.py changed; {crdgen.REGENERATE}"


def test_chart_crd_is_byte_identical_to_crds():
    assert CHART_CRD_PATH.exists(), f"{CHART_CRD_PATH.relative_to(ROOT)} is missing; {crdgen.REGENERATE}"
    assert CHART_CRD_PATH.read_bytes() == CRD_PATH.read_bytes(), \
        f"{CHART_CRD_PATH.relative_to(ROOT)} differs from {CRD_PATH.relative_to(ROOT)}; {crdgen.REGENERATE}"


@pytest.mark.parametrize("filename", sorted(crdgen.files()))
def test_every_generated_file_is_committed_in_both_places(filename):
    text = crdgen.files()[filename]
    for folder in (CRD_PATH.parent, CHART_CRD_PATH.parent):
        path = folder / filename
        assert path.exists() and path.read_text() == text, \
            f"{path.relative_to(ROOT)} is missing or stale; {crdgen.REGENERATE}"
    generated = set(crdgen.files()) | {"README.md", "kustomization.yaml"}
    assert {p.name for p in CRD_PATH.parent.iterdir()} == generated, "crds/ holds a file nobody generates"
    assert {p.name for p in CHART_CRD_PATH.parent.iterdir()} == generated - {"README.md", "kustomization.yaml"}


def test_crds_kustomization_lists_every_generated_file():
    """manifests/install includes ../../crds through this kustomization; a CRD missing from it would not install."""
    kustomization = yaml.safe_load((CRD_PATH.parent / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(crdgen.files())


def test_check_mode_reports_a_stale_file_and_how_to_regenerate(tmp_path):
    (tmp_path / crdgen.CRD_FILENAME).write_text("stale\n")
    with pytest.raises(SystemExit) as stale:
        crdgen.main(["--check", "--out", str(tmp_path)])
    assert "crdgen" in str(stale.value.code) and str(tmp_path) in str(stale.value.code)
    crdgen.main(["--out", str(tmp_path)])
    crdgen.main(["--check", "--out", str(tmp_path)])  # fresh: no exit
    assert (tmp_path / crdgen.CRD_FILENAME).read_text() == crdgen.render()


def test_rendered_yaml_has_no_anchors():
    text = crdgen.render()
    assert not re.search(r"[&*]id\d+", text), "YAML anchors/aliases: shared nodes leaked into the schema"


def test_every_property_has_a_description(schema):
    properties = [p for p, _node, is_prop in walk(schema) if is_prop]
    assert len(properties) > 100 and ".spec.prefill.tolerations[].tolerationSeconds" in properties
    missing = [p for p, node, is_prop in walk(schema)
               if is_prop and not p.startswith(".metadata") and not str(node.get("description", "")).strip()]
    # Root metadata is the one exception: the apiserver forbids anything but `type` and a schema for the name there.
    assert schema["properties"]["metadata"] == {"type": "object", "properties": {"name": {
        "type": "string", "x-kubernetes-validations": api.NAME_RULES}}}
    assert missing == [], f"properties without a description: {missing}"


def test_schema_is_structural(schema):
    assert structural_problems(schema) == []


def structural_problems(schema: dict[str, Any]) -> list[str]:
    problems = []
    for path, node, _ in walk(schema):
        where = path or "<root>"
        if "$ref" in node or "$defs" in node or "title" in node:
            problems.append(f"{where}: JSON-Schema-only keyword")
        if "anyOf" in node and not node.get("x-kubernetes-int-or-string"):
            problems.append(f"{where}: anyOf without x-kubernetes-int-or-string")
        if "oneOf" in node or "allOf" in node or "not" in node or "nullable" in node:
            problems.append(f"{where}: combinator/nullable")
        if "type" not in node and not node.get("x-kubernetes-int-or-string") \
                and not node.get("x-kubernetes-preserve-unknown-fields"):
            problems.append(f"{where}: no type")
        if "properties" in node and "additionalProperties" in node:
            problems.append(f"{where}: additionalProperties beside properties")
        if node.get("x-kubernetes-int-or-string") and ("type" in node or "enum" in node):
            problems.append(f"{where}: int-or-string with type/enum")
        if unknown := set(node) - ALLOWED_KEYS:
            problems.append(f"{where}: unexpected keys {sorted(unknown)}")
        if node.get("type") == "object":
            for req in node.get("required", []):
                if req not in node.get("properties", {}):
                    problems.append(f"{where}: required {req} is not a property")
    return problems


def test_cel_rules_name_real_fields_and_avoid_unbounded_string_concat(schema):
    rules = [(p, r) for p, node, _ in walk(schema) for r in node.get("x-kubernetes-validations", [])]
    assert len(rules) >= 10
    for path, rule in rules:
        assert rule.get("message") or rule.get("messageExpression"), f"{path}: rule without a message"
        if "fieldPath" in rule:
            node = schema
            for part in (path + rule["fieldPath"]).strip(".").split("."):
                node = node["properties"][part]
        # `'...' + string(<int>)` makes the apiserver's cost estimate unbounded (CRD rejected); use api._fmt.
        expr = rule.get("messageExpression", "")
        assert not re.search(r"\+\s*string\(|string\([^)]*\)\s*\+", expr.replace("string(self.efa)", "")), \
            f"{path}: {expr}"


def test_nested_objects_default_to_their_full_model_defaults(schema):
    spec = schema["properties"]["spec"]["properties"]
    assert spec["kvTransfer"]["default"] == {"mode": "push", "bidirectional": False, "sideChannelPort": 5600,
                                             "leaseSeconds": 30, "registrationTimeoutSeconds": 60}
    assert spec["engine"]["default"]["blockSize"] == 128
    assert spec["prefill"]["default"]["tensorParallelSize"] == 1
    # No default count: an unset spec.<role>.replicas leaves the role's count to its DisaggregatedRole (/scale).
    assert "replicas" not in spec["prefill"]["default"] and "default" not in spec["prefill"]["properties"]["replicas"]
    assert spec["model"]["properties"]["source"]["default"] == {}
    # Optional objects have no default: defaulting pvc or hub would break "at most one of pvc and hub".
    source = spec["model"]["properties"]["source"]["properties"]
    assert "default" not in source["pvc"] and "default" not in source["hub"]
    assert "default" not in schema["properties"]["status"]
    # Each default is a valid model value (the operator parses what the apiserver stores).
    for field, sub in api.DisaggregatedInferenceSpec.model_fields.items():
        default = spec[sub.alias]["default"] if "default" in spec[sub.alias] else None
        if default is not None:
            assert sub.annotation.model_validate(default) == sub.default_factory(), field


def test_efa_is_int_or_string(schema):
    efa = schema["properties"]["spec"]["properties"]["accelerator"]["properties"]["efa"]
    assert efa == {"default": "auto", "description": efa["description"], "x-kubernetes-int-or-string": True}
    assert api.AcceleratorSpec(profile="nvidia-h200", efa=16).efa == 16
    with pytest.raises(ValueError):
        api.AcceleratorSpec(profile="nvidia-h200", efa=-1)


def test_status_subresource_and_printer_columns(crd):
    version = crd["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == \
        ["Mode", "Prefill", "Decode", "Ready", "Rollout", "Revision", "Endpoint", "Transport", "Age"]
    transport = next(c for c in version["additionalPrinterColumns"] if c["name"] == "Transport")
    assert transport["priority"] == 1, "kubectl get -o wide only"
    assert crd["spec"]["names"]["shortNames"] == ["dinf"]


def test_cel_profile_tables_come_from_profiles():
    from disagg.operator.profiles import PROFILES

    rules = " ".join(r.get("rule", "") + r.get("messageExpression", "")
                     for m in (api.AcceleratorSpec, api.DisaggregatedInferenceSpec)
                     for r in m.model_config["json_schema_extra"]["x-kubernetes-validations"])
    for name, p in PROFILES.items():
        assert f"'{name}': {p.ranks_per_node}" in rules
        assert f"'{name}': {p.efa_per_node}" in rules
        if p.instance_type is not None:
            assert f"'{name}': '{p.instance_type}'" in rules
    # Only the cpu profile has no instance type (it selects nodes by label); the rules that name one skip it.
    assert [n for n, p in PROFILES.items() if p.instance_type is None] == ["cpu"]


def test_mode_connector_rule_is_generated_from_the_push_connectors_and_admits_the_defaults(schema):
    kv = schema["properties"]["spec"]["properties"]["kvTransfer"]
    [rule] = [r for r in kv["x-kubernetes-validations"] if r.get("fieldPath") == ".connector"]
    assert rule["rule"] == f"!has(self.connector) || (self.mode == 'push') == (self.connector in " \
                           f"{sorted(api.PUSH_CONNECTORS)})"
    assert "spec.kvTransfer.mode" in rule["messageExpression"]

    def admitted(mode: str, connector: str | None) -> bool:  # the rule, in Python
        return connector is None or (mode == "push") == (connector in api.PUSH_CONNECTORS)

    for mode in ("push", "pull"):
        spec = api.DisaggregatedInferenceSpec.model_validate({"model": {"name": "m"}, "accelerator": {
            "profile": "nvidia-h200"}, "kvTransfer": {"mode": mode}})
        assert admitted(mode, spec.connector), "each mode's default connector does that mode"
    assert api.PUSH_CONNECTORS <= api.PLUGIN_CONNECTORS
    assert all(admitted("pull", c) for c in api.PLUGIN_CONNECTORS - api.PUSH_CONNECTORS)
    assert not admitted("push", "NixlPullConnector") and not admitted("push", "NeuronNixlConnector")
    assert admitted("pull", "NeuronNixlConnector") and not admitted("pull", "NixlPushConnector")


def test_cpu_profile_fields_are_documented_from_the_profile_constants(schema):
    """The descriptions (`kubectl explain`) are docstrings; this keeps them in step with profiles.py."""
    from disagg.operator.profiles import (
        CPU_ENGINES_LABEL,
        CPU_ENGINES_TAINT,
        CPU_ENGINES_VALUE,
        DEFAULT_CPU_KV_CACHE_GIB,
        PROFILES,
    )

    accelerator = schema["properties"]["spec"]["properties"]["accelerator"]["properties"]
    kv = accelerator["kvCacheGiB"]
    # No schema default: it would be stored on every CR and fail the cpu-only rule for accelerator profiles.
    assert kv["type"] == "integer" and kv["minimum"] == 1 and "default" not in kv
    assert "VLLM_CPU_KVCACHE_SPACE" in kv["description"] and f"Default {DEFAULT_CPU_KV_CACHE_GIB}." in kv["description"]
    assert f"{PROFILES['cpu'].memory_gi_per_device} GiB for vLLM itself" in kv["description"]
    profile = accelerator["profile"]
    assert "cpu" in profile["enum"]
    assert f"{CPU_ENGINES_LABEL}={CPU_ENGINES_VALUE}" in profile["description"]
    assert f"{CPU_ENGINES_LABEL}={CPU_ENGINES_VALUE}:{CPU_ENGINES_TAINT['effect']}" in profile["description"]
    assert api.AcceleratorSpec.model_validate({"profile": "cpu", "kvCacheGiB": 2}).kv_cache_gib == 2


# -- DisaggregatedRole: one role's count, with the scale subresource ------------------------------------------
@pytest.fixture(scope="module")
def role_crd() -> dict[str, Any]:
    return yaml.safe_load(crdgen.render_role())


def test_the_role_crd_has_the_scale_subresource_hpa_and_keda_use(role_crd):
    version = role_crd["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}, "scale": {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector"}}
    schema = version["schema"]["openAPIV3Schema"]
    for path in (".spec.replicas", ".status.replicas", ".status.selector"):
        node = schema
        for part in path.strip(".").split("."):
            node = node["properties"][part]
        assert node["type"] == ("string" if path.endswith("selector") else "integer"), path
    assert role_crd["spec"]["names"]["shortNames"] == ["drole"] and role_crd["spec"]["scope"] == "Namespaced"
    assert [(c["name"], c["jsonPath"]) for c in version["additionalPrinterColumns"]] == [
        ("CR", ".spec.deployment"), ("Role", ".spec.role"), ("Desired", ".spec.replicas"),
        ("Ready", ".status.readyReplicas"), ("Current", ".status.replicas"), ("Age", ".metadata.creationTimestamp")]


def test_the_role_schema_is_structural_documented_and_guards_its_fields(role_crd):
    schema = role_crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert structural_problems(schema) == []
    missing = [p for p, node, is_prop in walk(schema)
               if is_prop and p != ".metadata" and not str(node.get("description", "")).strip()]
    assert missing == [], f"properties without a description (kubectl explain drole): {missing}"
    spec = schema["properties"]["spec"]
    assert sorted(spec["required"]) == ["deployment", "replicas", "role"]
    replicas = spec["properties"]["replicas"]
    assert (replicas["minimum"], replicas["maximum"]) == (0, api.MAX_ENGINE_REPLICAS) and "default" not in replicas
    for field in ("deployment", "role"):
        assert spec["properties"][field]["x-kubernetes-validations"][0]["rule"] == "self == oldSelf", "immutable"
    assert spec["properties"]["deployment"]["maxLength"] == api.NAME_LIMIT.length
    assert spec["properties"]["role"]["enum"] == ["prefill", "decode"]
    assert schema["x-kubernetes-validations"] == [role_api.ROLE_NAME_RULE]
