"""Generate the CustomResourceDefinition from the typed models in `api.py`.

pydantic emits JSON Schema; Kubernetes wants a *structural* OpenAPI v3 schema: every node typed, no $ref,
no anyOf for nullability, no additionalProperties beside properties. This module is that translation and
nothing else. `python -m disagg.operator.crdgen` rewrites `crds/`; a test fails when the file drifts.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from . import api

CRD_FILENAME = f"{api.GROUP}_{api.PLURAL}.yaml"
_DROP = {"title", "additionalProperties", "$defs"}


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in node:
        target = defs[node["$ref"].split("/")[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _structural(merged, defs)
    if "anyOf" in node:
        variants = [v for v in node["anyOf"] if v.get("type") != "null"]
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        if node.get("x-kubernetes-int-or-string"):
            out = {k: v for k, v in rest.items() if k not in _DROP}
            out.pop("type", None)
            if "description" in out:
                out["description"] = _one_line(out["description"])
            return out
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
    if isinstance(extra, dict) and "properties" not in node:
        if not extra:  # dict[str, Any]
            out["x-kubernetes-preserve-unknown-fields"] = True
        else:
            out["additionalProperties"] = _structural(extra, defs)
            if out["additionalProperties"].get("x-kubernetes-int-or-string") is None and \
                    "anyOf" in extra and {v.get("type") for v in extra["anyOf"]} == {"integer", "string"}:
                out["additionalProperties"] = {"x-kubernetes-int-or-string": True}
    if out.get("type") == "object" and "properties" in out:
        # Nested objects the models default with a factory get `default: {}`, so the apiserver fills in their
        # scalar defaults and CEL rules can always read them.
        for name, sub in out["properties"].items():
            if sub.get("type") == "object" and "properties" in sub and name not in out.get("required", []) \
                    and "default" not in sub:
                sub["default"] = {}
    if out.get("x-kubernetes-preserve-unknown-fields") and "type" not in out:
        out["type"] = "object"
    return out


def _int_or_string_maps(schema: dict[str, Any]) -> None:
    """Quantities (`dict[str, int | str]`) become int-or-string values, as in core/v1 ResourceRequirements."""
    for sub in schema.get("properties", {}).values():
        _int_or_string_maps(sub)
    if "items" in schema:
        _int_or_string_maps(schema["items"])
    ap = schema.get("additionalProperties")
    if isinstance(ap, dict) and "anyOf" in ap:
        schema["additionalProperties"] = {"x-kubernetes-int-or-string": True}


def openapi_schema() -> dict[str, Any]:
    raw = api.DisaggregatedInference.model_json_schema(by_alias=True, mode="validation")
    defs = raw.get("$defs", {})
    _prepare(raw, defs)
    schema = _structural(raw, defs)
    _int_or_string_maps(schema)
    props = schema["properties"]
    props["apiVersion"] = {"type": "string", "description": props["apiVersion"]["description"]}
    props["kind"] = {"type": "string", "description": props["kind"]["description"]}
    props["metadata"] = {"type": "object"}
    props["status"].pop("default", None)
    schema["required"] = ["spec"]
    conditions = props["status"]["properties"]["conditions"]
    conditions["x-kubernetes-list-type"] = "map"
    conditions["x-kubernetes-list-map-keys"] = ["type"]
    return schema


def _prepare(raw: dict[str, Any], defs: dict[str, Any]) -> None:
    # pydantic puts quantity maps as anyOf inside additionalProperties; normalise before the structural pass.
    for d in defs.values():
        for prop in d.get("properties", {}).values():
            ap = prop.get("additionalProperties")
            if isinstance(ap, dict) and "anyOf" in ap:
                prop["additionalProperties"] = {"anyOf": ap["anyOf"], "x-kubernetes-int-or-string": True}


def crd() -> dict[str, Any]:
    col = lambda name, path, typ="string", **kw: {"name": name, "type": typ, "jsonPath": path, **kw}  # noqa: E731
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
                    col("Endpoint", ".status.endpoint", priority=0),
                    col("Age", ".metadata.creationTimestamp", "date"),
                ],
                "schema": {"openAPIV3Schema": openapi_schema()},
            }],
        },
    }


def render() -> str:
    header = "# Generated by `python -m disagg.operator.crdgen` from operator/api.py. Do not edit.\n"
    return header + yaml.safe_dump(crd(), sort_keys=False, width=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="write the CRD generated from the API models")
    p.add_argument("--out", type=Path, nargs="*", default=[Path("crds"), Path("charts/disagg-operator/crds")],
                   help="directories to write into")
    p.add_argument("--check", action="store_true", help="exit 1 if any file differs instead of writing")
    args = p.parse_args(argv)
    text, stale = render(), []
    for d in args.out:
        path = d / CRD_FILENAME
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    if stale:
        sys.exit(f"stale generated CRDs: {', '.join(stale)}; run python -m disagg.operator.crdgen")


if __name__ == "__main__":
    main()
