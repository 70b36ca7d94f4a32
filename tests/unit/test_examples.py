"""The example CRs (manifests/examples): every one is listed in the kustomization, parses through the API models
and builds its children; the tiny CPU example is what its comments promise."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from lightkube import codecs

from disagg.operator.api import DisaggregatedInference
from disagg.operator.builders import build_children
from disagg.operator.profiles import CPU_ENGINES_LABEL, CPU_ENGINES_VALUE
from support.crs import child, env_of, kv_config, pod

EXAMPLES = Path(__file__).resolve().parents[2] / "manifests" / "examples"


def listed() -> list[str]:
    return list(yaml.safe_load((EXAMPLES / "kustomization.yaml").read_text())["resources"])


def load(name: str) -> DisaggregatedInference:
    doc = yaml.safe_load((EXAMPLES / name).read_text())
    return DisaggregatedInference.model_validate({**doc, "metadata": {**doc["metadata"], "namespace": "ml"}})


def test_every_example_is_listed_in_the_kustomization():
    files = sorted(p.name for p in EXAMPLES.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(listed()) == files
    assert "tiny-cpu.yaml" in files


@pytest.mark.parametrize("name", listed())
def test_example_parses_and_builds_valid_children(name):
    cr = load(name)
    for obj in build_children(cr):
        assert codecs.from_dict(obj).to_dict() == obj, (obj["kind"], obj["metadata"]["name"])


def test_tiny_cpu_example_fits_a_two_cpu_node_with_one_engine_per_core():
    cr = load("tiny-cpu.yaml")
    spec = cr.spec
    assert (spec.accelerator.profile, spec.kv_transfer.mode, spec.backend) == ("cpu", "push", "UCX")
    assert (spec.prefill.replicas, spec.decode.replicas) == (1, 1)
    assert spec.model.source.pvc is not None and spec.model.source.pvc.claim_name == "disagg-models"
    children = build_children(cr)
    name = cr.metadata["name"]
    cpu_millis = 0
    for role, core in (("prefill", "0"), ("decode", "1")):
        [c] = [c for c in pod(children, role, name)["spec"]["containers"] if c["name"] == "engine"]
        assert c["resources"] == {"requests": {"cpu": "100m", "memory": "5Gi"}, "limits": {"memory": "5Gi"}}
        cpu_millis += 500
        env = env_of(c)
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == core
        assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["UCX_TLS"] == "tcp,self,sm"
        assert env["DISAGG_NIXL_PROGRESS_DELAY_US"] == "1000"
        assert pod(children, role, name)["spec"]["nodeSelector"] == {CPU_ENGINES_LABEL: CPU_ENGINES_VALUE}
        assert kv_config(cr, role)["kv_buffer_device"] == "cpu"
    for component in ("router", "rendezvous"):
        deployment = child(children, "Deployment", f"{name}-{component}")["spec"]
        [c] = deployment["template"]["spec"]["containers"]
        cpu_millis += deployment["replicas"] * int(c["resources"]["requests"]["cpu"].removesuffix("m"))
        assert deployment["template"]["spec"]["nodeSelector"] == {CPU_ENGINES_LABEL: CPU_ENGINES_VALUE}
    assert cpu_millis <= 1500, "two engines, the router and the rendezvous leave room on a 2-CPU node"
