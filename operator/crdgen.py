"""Generate the CustomResourceDefinitions from the typed models in `api.py` and `role_api.py`.

pydantic emits JSON Schema; Kubernetes wants a *structural* OpenAPI v3 schema: every node typed, no $ref,
no anyOf for nullability, no additionalProperties beside properties. This module is that translation and
nothing else. `python -m disagg.operator.crdgen` rewrites `crds/` and the chart's copy; a test fails when
either drifts.

Gotchas the real apiserver enforces (each found by installing the CRD, and each covered by a test):
- a `default` is checked against its object's CEL rules without the nested defaults applied, so nested objects
  get their full default value, not `{}`;
- root `metadata` may carry nothing but `type` and a schema for `name` (no description);
- int-or-string is the bare `x-kubernetes-int-or-string` extension (no type, no enum), and CEL sees it as dyn;
- a messageExpression that concatenates `string(<int>)` exceeds the cost budget 100x: see `api._fmt`.
"""
from __future__ import annotations

import argparse
import json
import sys
import typing
from pathlib import Path
from typing import Any

import yaml

from . import api, role_api

CRD_FILENAME = f"{api.GROUP}_{api.PLURAL}.yaml"
ROLE_CRD_FILENAME = f"{api.GROUP}_{role_api.PLURAL}.yaml"
_DROP = {"title", "additionalProperties", "$defs"}


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _is_int_or_string(variants: list[dict[str, Any]]) -> bool:
    return sorted(v.get("type", "") for v in variants) == ["integer", "string"]


def _structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in node:
        target = defs[node["$ref"].split("/")[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _structural(merged, defs)
    if "anyOf" in node:
        variants = [v for v in node["anyOf"] if v.get("type") != "null"]
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        if node.get("x-kubernetes-int-or-string") or _is_int_or_string(variants):
            # Structural schemas allow int-or-string only as the bare extension: no type, no enum (CEL checks).
            bare = {k: v for k, v in rest.items() if k not in _DROP and not (k == "default" and v is None)}
            bare["x-kubernetes-int-or-string"] = True
            if "description" in bare:
                bare["description"] = _one_line(bare["description"])
            return bare
        if len(variants) == 1:
            return _structural({**variants[0], **rest}, defs)
        raise ValueError(f"cannot express anyOf in a structural schema: {node}")
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP:
            continue
        if key == "default" and value is None:
            continue
        if key == "description":
            out[key] = _one_line(value)
        elif key == "properties":
            out[key] = {name: _structural(sub, defs) for name, sub in value.items()}
        elif key == "items":
            out[key] = _structural(value, defs)
        else:
            out[key] = value
    extra = node.get("additionalProperties")
    if "properties" not in node and (extra is True or extra == {}):  # dict[str, Any]
        out["type"] = "object"
        out["x-kubernetes-preserve-unknown-fields"] = True
    elif "properties" not in node and isinstance(extra, dict):  # dict[str, X]
        out["additionalProperties"] = _structural(extra, defs)
    if out.get("x-kubernetes-preserve-unknown-fields") and "type" not in out:
        out["type"] = "object"
    return out


def _model_in(annotation: Any) -> type[api.Model] | None:
    """The Model class an annotation holds directly, in an Optional, or as list items; else None."""
    if isinstance(annotation, type) and issubclass(annotation, api.Model):
        return annotation
    for arg in typing.get_args(annotation):
        if (found := _model_in(arg)) is not None:
            return found
    return None


def _compact(value: Any) -> Any:
    """A default without its empty collections: the apiserver stores defaults in every object."""
    if isinstance(value, dict):
        return {k: _compact(v) for k, v in value.items() if v not in ({}, [])}
    return value


def _apply_defaults(schema: dict[str, Any], model: type[api.Model]) -> None:
    """Give each nested object the models build with `default_factory` its full default value, so the apiserver
    creates it with all its scalar defaults and CEL rules can read every field. (The apiserver checks a
    `default` against the object's CEL rules as written, without applying the nested defaults first, so
    `default: {}` would fail rules such as `self.mode == 'push'`.)"""
    for name, field in model.model_fields.items():
        sub = schema["properties"][field.alias or name]
        inner = _model_in(field.annotation)
        if inner is None:
            continue
        node = sub.get("items", sub)
        _apply_defaults(node, inner)
        built_by_default = field.default_factory is inner  # (a bool: `is` would narrow `inner` to the factory's type)
        if built_by_default:
            sub["default"] = _compact(inner().dump())


def _schema_of(model: type[api.Model]) -> dict[str, Any]:
    """A root kind's structural schema, with nested defaults applied and apiVersion and kind as plain strings."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    structural = _structural(raw, raw.get("$defs", {}))
    schema: dict[str, Any] = json.loads(json.dumps(structural))  # no shared nodes: defaults are written per place
    _apply_defaults(schema, model)
    props = schema["properties"]
    props["apiVersion"] = {"type": "string", "description": props["apiVersion"]["description"]}
    props["kind"] = {"type": "string", "description": props["kind"]["description"]}
    schema["required"] = ["spec"]
    return schema


def openapi_schema() -> dict[str, Any]:
    schema = _schema_of(api.DisaggregatedInference)
    props = schema["properties"]
    # The apiserver forbids anything here but `type` and a schema for `name` (or `generateName`), not even a
    # description; it documents ObjectMeta itself. The name's rules reject CRs whose children would be invalid.
    props["metadata"] = {"type": "object", "properties": {"name": {"type": "string",
                                                                   "x-kubernetes-validations": api.NAME_RULES}}}
    conditions = props["status"]["properties"]["conditions"]
    conditions["x-kubernetes-list-type"] = "map"
    conditions["x-kubernetes-list-map-keys"] = ["type"]
    return schema


def role_openapi_schema() -> dict[str, Any]:
    schema = _schema_of(role_api.DisaggregatedRole)
    # Its name is checked against spec by the root's rule (role_api.ROLE_NAME_RULE), which CEL may read there.
    schema["properties"]["metadata"] = {"type": "object"}
    return schema


def _column(name: str, path: str, typ: str = "string", **extra: Any) -> dict[str, Any]:
    """One additionalPrinterColumns entry."""
    return {"name": name, "type": typ, "jsonPath": path, **extra}


def crd() -> dict[str, Any]:
    col = _column
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{api.PLURAL}.{api.GROUP}"},
        "spec": {
            "group": api.GROUP,
            "scope": "Namespaced",
            "names": {"kind": api.KIND, "listKind": f"{api.KIND}List", "plural": api.PLURAL,
                      "singular": api.SINGULAR, "shortNames": api.SHORT_NAMES, "categories": ["all", "disagg"]},
            "versions": [{
                "name": api.VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": [
                    col("Mode", ".spec.kvTransfer.mode"),
                    col("Prefill", ".status.prefillReady", description="ready/desired prefill engines"),
                    col("Decode", ".status.decodeReady", description="ready/desired decode engines"),
                    col("Ready", ".status.conditions[?(@.type=='Ready')].status"),
                    col("Rollout", ".status.rollout",
                        description="Complete, RollingOut or Blocked (the Progressing condition's reason)"),
                    col("Revision", ".status.revision", priority=1,
                        description="the revision of the engines' pod templates the spec asks for"),
                    col("Endpoint", ".status.endpoint", priority=0),
                    col("Transport", ".status.conditions[?(@.type=='TransportVerified')].reason", priority=1,
                        description="whether the engines report the requested NIXL backend (TransportVerified)"),
                    col("Age", ".metadata.creationTimestamp", "date"),
                ],
                "schema": {"openAPIV3Schema": openapi_schema()},
            }],
        },
    }


def role_crd() -> dict[str, Any]:
    col = _column
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{role_api.PLURAL}.{api.GROUP}"},
        "spec": {
            "group": api.GROUP,
            "scope": "Namespaced",
            "names": {"kind": role_api.KIND, "listKind": f"{role_api.KIND}List", "plural": role_api.PLURAL,
                      "singular": role_api.SINGULAR, "shortNames": role_api.SHORT_NAMES,
                      "categories": ["all", "disagg"]},
            "versions": [{
                "name": api.VERSION,
                "served": True,
                "storage": True,
                # What `kubectl scale`, the HPA controller and KEDA read and write.
                "subresources": {"status": {}, "scale": {"specReplicasPath": ".spec.replicas",
                                                         "statusReplicasPath": ".status.replicas",
                                                         "labelSelectorPath": ".status.selector"}},
                "additionalPrinterColumns": [
                    col("CR", ".spec.deployment", description="the DisaggregatedInference this role belongs to"),
                    col("Role", ".spec.role"),
                    col("Desired", ".spec.replicas", "integer", description="the engines the role is scaled to"),
                    col("Ready", ".status.readyReplicas", "integer",
                        description="engines Ready and not withdrawn, in every revision"),
                    col("Current", ".status.replicas", "integer", priority=1,
                        description="engine pods in every revision, draining ones included"),
                    col("Age", ".metadata.creationTimestamp", "date"),
                ],
                "schema": {"openAPIV3Schema": role_openapi_schema()},
            }],
        },
    }


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:  # no &id001 anchors: every node is written out in full
        return True


REGENERATE = ("run `make generate` (or `.venv/bin/python -m disagg.operator.crdgen`) from the repository root "
              "(it writes crds/ and charts/disagg-operator/crds/)")


def render() -> str:
    header = "# Generated by `python -m disagg.operator.crdgen` from operator/api.py. Do not edit.\n"
    return header + yaml.dump(crd(), Dumper=_Dumper, sort_keys=False, width=120)


def render_role() -> str:
    header = "# Generated by `python -m disagg.operator.crdgen` from operator/role_api.py. Do not edit.\n"
    return header + yaml.dump(role_crd(), Dumper=_Dumper, sort_keys=False, width=120)


PEERING_FILENAME = "kopf.dev_peerings.yaml"


def render_peering() -> str:
    from . import peering

    header = "# Generated by `python -m disagg.operator.crdgen` from operator/peering.py. Do not edit.\n"
    return header + "---\n".join(yaml.dump(c, Dumper=_Dumper, sort_keys=False, width=120) for c in peering.crds())


def files() -> dict[str, str]:
    """Every generated file in crds/ (and the chart's crds/), by name."""
    return {CRD_FILENAME: render(), ROLE_CRD_FILENAME: render_role(), PEERING_FILENAME: render_peering()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="write the CRD generated from the API models")
    p.add_argument("--out", type=Path, nargs="*", default=[Path("crds"), Path("charts/disagg-operator/crds")],
                   help="directories to write into")
    p.add_argument("--check", action="store_true", help="exit 1 if any file differs instead of writing")
    args = p.parse_args(argv)
    stale = []
    for d in args.out:
        for filename, text in files().items():
            path = d / filename
            if args.check:
                if not path.exists() or path.read_text() != text:
                    stale.append(str(path))
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        sys.exit(f"stale generated CRDs: {', '.join(stale)}; {REGENERATE}")


if __name__ == "__main__":
    main()
