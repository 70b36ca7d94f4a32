"""The apiserver itself enforces the DisaggregatedInference API: the generated CRD installs, its CEL rules
compile, bad specs are rejected with 422 and a message that names the field, and defaults are filled in."""
from __future__ import annotations

import copy
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from lightkube.core.exceptions import ApiError
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Namespace
from lightkube.types import PatchType

from disagg.operator import api, crdgen

pytestmark = pytest.mark.cluster

MINIMAL = {"model": {"name": "Qwen/Qwen3-32B"}, "accelerator": {"profile": "nvidia-h200"}}
DELETE = object()


def make_spec(patch: dict[str, Any]) -> dict[str, Any]:
    """MINIMAL with dotted-path overrides, e.g. {"prefill.tensorParallelSize": 16}; DELETE removes a key."""
    spec = copy.deepcopy(MINIMAL)
    for dotted, value in patch.items():
        *parents, leaf = dotted.split(".")
        node = spec
        for p in parents:
            node = node.setdefault(p, {})
        if value is DELETE:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return spec


def kubectl(cluster, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    if cluster.local is not None:
        binary = Path(cluster.local.bin) / "kubectl"
    else:
        from disagg.devcluster import build
        binary = build.bin_dir() / "kubectl"
        binary = binary if binary.exists() else Path(shutil.which("kubectl") or "kubectl")
    return subprocess.run([str(binary), f"--kubeconfig={cluster.kubeconfig}", *args], capture_output=True,
                          text=True, check=check, timeout=60)


@pytest.fixture(scope="module")
def dry_run_namespace(cluster):
    """One namespace for the server-side dry runs: they persist nothing, so they need no per-test namespace
    (and each namespace's deletion costs ~5 s of namespace-controller time). Tests that really create objects
    use the per-test `namespace` fixture."""
    name = f"t-dry-{uuid.uuid4().hex[:8]}"
    cluster.client.create(Namespace(metadata=ObjectMeta(name=name)))
    yield name
    cluster.client.delete(Namespace, name)


def rejection(cluster, dinf, namespace: str, spec: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as err:
        cluster.client.create(dinf(metadata={"name": "bad", "namespace": namespace}, spec=spec), dry_run=True)
    return err.value


# (id, patch over MINIMAL, field path the apiserver reports, substring of the intended message)
REJECTED = [
    ("prefill-tp4-dp4-exceeds-node", {"prefill.tensorParallelSize": 4, "decode.tensorParallelSize": 4,
                                      "prefill.dataParallelSize": 4},
     "spec.prefill.tensorParallelSize", "16 prefill ranks (tensorParallelSize 4 * pipelineParallelSize 1 * "
     "dataParallelSize 4) do not fit one p5en.48xlarge node"),
    ("unknown-profile", {"accelerator.profile": "tpu-v5"},
     "spec.accelerator.profile", 'Unsupported value: "tpu-v5"'),
    ("prefill-tp-16-on-h200", {"prefill.tensorParallelSize": 16, "decode.tensorParallelSize": 16},
     "spec.prefill.tensorParallelSize",
     "16 prefill ranks (tensorParallelSize 16 * pipelineParallelSize 1 * dataParallelSize 1) do not fit one "
     "p5en.48xlarge node (profile nvidia-h200), which has 8 GPUs; multi-node tensor/pipeline parallelism is not "
     "supported yet"),
    ("decode-tp-x-pp-exceeds-node",
     {"kvTransfer.mode": "pull", "decode.tensorParallelSize": 8, "decode.pipelineParallelSize": 2},
     "spec.decode.tensorParallelSize",
     "16 decode ranks (tensorParallelSize 8 * pipelineParallelSize 2 * dataParallelSize 1) do not fit one "
     "p5en.48xlarge node"),
    ("trainium2-tp-128", {"accelerator.profile": "trainium2", "decode.tensorParallelSize": 128},
     "spec.decode.tensorParallelSize",
     "128 decode ranks (tensorParallelSize 128 * pipelineParallelSize 1 * dataParallelSize 1) do not fit one "
     "trn2.48xlarge node (profile trainium2), which has 64 logical NeuronCores; multi-node"),
    ("prefill-tp-above-decode-tp", {"prefill.tensorParallelSize": 4, "decode.tensorParallelSize": 2},
     "spec.prefill.tensorParallelSize", "4 exceeds spec.decode.tensorParallelSize 2"),
    ("decode-tp-not-a-multiple", {"prefill.tensorParallelSize": 4, "decode.tensorParallelSize": 6},
     "spec.decode.tensorParallelSize", "6 is not a multiple of spec.prefill.tensorParallelSize 4"),
    ("push-bidirectional", {"kvTransfer.bidirectional": True},
     "spec.kvTransfer.bidirectional", "push mode does not support bidirectional KV transfer"),
    ("push-decode-pp-2", {"decode.pipelineParallelSize": 2},
     "spec.decode.pipelineParallelSize", "push mode does not support pipeline parallelism on decode"),
    ("efa-17-on-h200", {"accelerator.efa": 17},
     "spec.accelerator.efa", "17 EFA devices per pod exceed the 16 of one p5en.48xlarge node (profile nvidia-h200)"),
    ("efa-9-on-trainium1", {"accelerator.profile": "trainium1", "accelerator.efa": 9},
     "spec.accelerator.efa", "9 EFA devices per pod exceed the 8 of one trn1.32xlarge node (profile trainium1)"),
    ("efa-maybe", {"accelerator.efa": "maybe"},
     "spec.accelerator.efa", "must be 'auto', 'off' or a non-negative count of EFA devices per pod; got 'maybe'"),
    ("efa-negative", {"accelerator.efa": -1},
     "spec.accelerator.efa", "non-negative count of EFA devices per pod; got -1"),
    ("prefill-replicas-negative", {"prefill.replicas": -1},
     "spec.prefill.replicas", "should be greater than or equal to 0"),
    ("decode-replicas-negative", {"decode.replicas": -3},
     "spec.decode.replicas", "should be greater than or equal to 0"),
    ("block-size-100", {"engine.blockSize": 100},
     "spec.engine.blockSize", "must be a power of two from 1 to 4096 (128 is recommended for NIXL); got 100"),
    ("block-size-0", {"engine.blockSize": 0},
     "spec.engine.blockSize", "should be greater than or equal to 1"),
    ("empty-model-name", {"model.name": ""},
     "spec.model.name", "should be at least 1 chars long"),
    ("missing-model", {"model": DELETE}, "spec.model", "Required value"),
    ("missing-accelerator", {"accelerator": DELETE}, "spec.accelerator", "Required value"),
    ("libfabric-with-efa-off", {"accelerator.efa": "off", "kvTransfer.backend": "LIBFABRIC"},
     "spec.kvTransfer.backend", "LIBFABRIC needs EFA, but spec.accelerator.efa turns it off"),
    ("libfabric-with-efa-0", {"accelerator.efa": 0, "kvTransfer.backend": "LIBFABRIC"},
     "spec.kvTransfer.backend", "LIBFABRIC needs EFA"),
    ("pvc-and-hub", {"model.source": {"pvc": {"claimName": "weights"}, "hub": {}}},
     "spec.model.source", "set at most one of pvc and hub"),
    ("pvc-without-claim", {"model.source": {"pvc": {"path": "/models"}}},
     "spec.model.source.pvc.claimName", "Required value"),
    ("invalid-mode", {"kvTransfer.mode": "fast"},
     "spec.kvTransfer.mode", 'Unsupported value: "fast": supported values: "push", "pull"'),
    ("invalid-backend", {"kvTransfer.backend": "TCP"},
     "spec.kvTransfer.backend", 'Unsupported value: "TCP"'),
    ("router-port-70000", {"router.port": 70000},
     "spec.router.port", "should be less than or equal to 65535"),
    ("router-queue-wait-negative", {"router.queueWaitSeconds": -0.5},
     "spec.router.queueWaitSeconds", "should be greater than or equal to 0"),
    ("router-max-inflight-fraction", {"router.maxInflight": 1.5},
     "spec.router.maxInflight", "must be of type integer"),
    ("invalid-dtype", {"model.dtype": "fp8"},
     "spec.model.dtype", 'Unsupported value: "fp8"'),
    ("invalid-service-type", {"router.serviceType": "Ingress"},
     "spec.router.serviceType", 'Unsupported value: "Ingress": supported values: "ClusterIP", "NodePort", '
                                '"LoadBalancer"'),
    ("side-channel-port-privileged", {"kvTransfer.sideChannelPort": 80},
     "spec.kvTransfer.sideChannelPort", "should be greater than or equal to 1024"),
    ("push-with-pull-connector", {"kvTransfer.connector": "NixlPullConnector"},
     "spec.kvTransfer.connector", "NixlPullConnector does not do push-mode KV transfer (spec.kvTransfer.mode: push); "
                                  "push needs NixlPushConnector"),
    ("push-with-vendor-connector", {"kvTransfer.connector": "NeuronNixlConnector"},
     "spec.kvTransfer.connector", "NeuronNixlConnector does not do push-mode KV transfer"),
    ("pull-with-push-connector", {"kvTransfer.mode": "pull", "kvTransfer.connector": "NixlPushConnector"},
     "spec.kvTransfer.connector", "NixlPushConnector does not do pull-mode KV transfer (spec.kvTransfer.mode: pull)"),
    ("cpu-with-libfabric", {"accelerator.profile": "cpu", "kvTransfer.backend": "LIBFABRIC"},
     "spec.kvTransfer.backend", "LIBFABRIC needs EFA, which the cpu profile has none of: KV moves over TCP with UCX; "
                                "set spec.kvTransfer.backend: UCX or leave it unset"),
    ("cpu-with-libfabric-and-efa-off", {"accelerator.profile": "cpu", "accelerator.efa": "off",
                                        "kvTransfer.backend": "LIBFABRIC"},
     "spec.kvTransfer.backend", "LIBFABRIC needs EFA, which the cpu profile has none of"),
    ("cpu-with-efa-count", {"accelerator.profile": "cpu", "accelerator.efa": 2},
     "spec.accelerator.efa", "the cpu profile has no EFA (KV moves over TCP with UCX): set efa to auto or off, or "
                             "leave it unset; got 2"),
    ("cpu-with-efa-0", {"accelerator.profile": "cpu", "accelerator.efa": 0},
     "spec.accelerator.efa", "the cpu profile has no EFA"),
    ("kv-cache-on-h200", {"accelerator.kvCacheGiB": 4},
     "spec.accelerator.kvCacheGiB", "only the cpu profile keeps its KV cache in host memory (VLLM_CPU_KVCACHE_SPACE); "
                                    "profile nvidia-h200 sizes it from accelerator memory"),
    ("cpu-kv-cache-0", {"accelerator.profile": "cpu", "accelerator.kvCacheGiB": 0},
     "spec.accelerator.kvCacheGiB", "should be greater than or equal to 1"),
    ("cpu-prefill-tp2", {"accelerator.profile": "cpu", "prefill.tensorParallelSize": 2,
                         "decode.tensorParallelSize": 2},
     "spec.prefill.tensorParallelSize", "the cpu profile runs one rank per engine pod, but prefill has 2 "
                                        "(tensorParallelSize 2 * pipelineParallelSize 1 * dataParallelSize 1)"),
    ("cpu-decode-dp2", {"accelerator.profile": "cpu", "decode.dataParallelSize": 2},
     "spec.decode.tensorParallelSize", "the cpu profile runs one rank per engine pod, but decode has 2"),
    ("prefix-aware-events-port-taken", {"router.policy": "prefix-aware", "engine.port": 5558},
     "spec.router.policy", "prefix-aware puts the prefill engines' KV event ports at 5557-5558"),
]


@pytest.mark.parametrize("patch,field,message", [c[1:] for c in REJECTED], ids=[c[0] for c in REJECTED])
def test_apiserver_rejects_with_a_message_naming_the_field(cluster, crd_installed, dry_run_namespace, patch, field,
                                                           message):
    err = rejection(cluster, crd_installed, dry_run_namespace, make_spec(patch))
    assert err.status.code == 422, err.status
    text = err.status.message
    assert f"{field}: " in text, text
    assert message in text, text
    # The structured causes carry the same field, so clients can point at it.
    assert field in [c.field for c in err.status.details.causes], err.status.details.causes


def test_rejected_cases_are_distinct():
    assert len({c[0] for c in REJECTED}) == len(REJECTED) >= 18
    assert len({repr(c[1]) for c in REJECTED}) == len(REJECTED)


def test_minimal_spec_is_created_with_defaults_filled_in(cluster, crd_installed, namespace):
    c = cluster.client
    c.create(crd_installed(metadata={"name": "minimal", "namespace": namespace}, spec=copy.deepcopy(MINIMAL)))
    obj = c.get(crd_installed, "minimal", namespace=namespace)
    spec = obj.spec
    assert spec["kvTransfer"]["mode"] == "push"
    assert spec["engine"]["blockSize"] == 128
    # No default count: an unset spec.<role>.replicas leaves the count to the role's DisaggregatedRole (/scale).
    assert "replicas" not in spec["prefill"] and "replicas" not in spec["decode"]
    assert spec["prefill"]["tensorParallelSize"] == 1
    assert spec["accelerator"]["efa"] == "auto"
    assert spec["router"]["serviceType"] == "ClusterIP"
    # What the apiserver stores is exactly what the models default to, and the operator can parse it.
    parsed = api.DisaggregatedInference.model_validate(obj.to_dict())
    assert parsed.spec == api.DisaggregatedInferenceSpec.model_validate(MINIMAL)
    assert (parsed.spec.connector, parsed.spec.backend) == (api.PUSH_CONNECTOR, "LIBFABRIC")


def test_decode_pipeline_parallelism_is_rejected_in_push_mode_and_accepted_in_pull(cluster, crd_installed,
                                                                                  namespace):
    err = rejection(cluster, crd_installed, namespace, make_spec({"decode.pipelineParallelSize": 2}))
    assert err.status.code == 422
    assert "spec.decode.pipelineParallelSize: " in err.status.message
    pull = make_spec({"kvTransfer.mode": "pull", "decode.pipelineParallelSize": 2})
    cluster.client.create(crd_installed(metadata={"name": "pull-pp", "namespace": namespace}, spec=pull))
    stored = cluster.client.get(crd_installed, "pull-pp", namespace=namespace).spec
    assert (stored["kvTransfer"]["mode"], stored["decode"]["pipelineParallelSize"]) == ("pull", 2)
    assert api.DisaggregatedInferenceSpec.model_validate(stored).connector == api.PULL_CONNECTOR


ACCEPTED = [
    ("efa-16-on-h200", {"accelerator.efa": 16}),
    ("efa-8-on-trainium1", {"accelerator.profile": "trainium1", "accelerator.efa": 8}),
    ("efa-off-with-ucx", {"accelerator.efa": "off", "kvTransfer.backend": "UCX"}),
    ("full-h200-node", {"prefill.tensorParallelSize": 8, "decode.tensorParallelSize": 8}),
    ("full-trainium2-node", {"accelerator.profile": "trainium2", "prefill.tensorParallelSize": 32,
                             "decode.tensorParallelSize": 64}),
    ("pull-bidirectional", {"kvTransfer.mode": "pull", "kvTransfer.bidirectional": True}),
    ("zero-replicas", {"prefill.replicas": 0, "decode.replicas": 0, "router.replicas": 0}),
    ("block-size-16", {"engine.blockSize": 16}),
    ("router-overload-bounds", {"router.maxInflight": 0, "router.maxInflightPerEngine": 8, "router.maxQueue": 0,
                                "router.queueWaitSeconds": 0.25}),
    ("pvc-source", {"model.source": {"pvc": {"claimName": "weights"}}}),
    ("prefix-aware", {"router.policy": "prefix-aware"}),
    ("quantities-and-free-form", {"prefill.resources": {"requests": {"cpu": 32, "memory": "256Gi"}},
                                  "decode.affinity": {"nodeAffinity": {"anything": ["goes"]}}}),
    ("push-with-push-connector", {"kvTransfer.connector": "NixlPushConnector"}),
    ("pull-with-nixl-connector", {"kvTransfer.mode": "pull", "kvTransfer.connector": "NixlConnector"}),
    ("pull-with-nixl-pull-connector", {"kvTransfer.mode": "pull", "kvTransfer.connector": "NixlPullConnector"}),
    ("pull-with-vendor-connector", {"kvTransfer.mode": "pull", "kvTransfer.connector": "NeuronNixlConnector",
                                    "accelerator.profile": "trainium2"}),
    ("cpu-defaults", {"accelerator.profile": "cpu"}),
    ("cpu-kv-cache-ucx-efa-off", {"accelerator.profile": "cpu", "accelerator.kvCacheGiB": 2,
                                  "accelerator.efa": "off", "kvTransfer.backend": "UCX"}),
    ("cpu-pull", {"accelerator.profile": "cpu", "accelerator.efa": "auto", "kvTransfer.mode": "pull"}),
]


@pytest.mark.parametrize("patch", [c[1] for c in ACCEPTED], ids=[c[0] for c in ACCEPTED])
def test_apiserver_accepts_valid_specs(cluster, crd_installed, dry_run_namespace, patch):
    spec = make_spec(patch)
    created = cluster.client.create(crd_installed(metadata={"name": "good", "namespace": dry_run_namespace},
                                                  spec=spec), dry_run=True)
    api.DisaggregatedInferenceSpec.model_validate(created.spec)  # the models agree with the apiserver


def test_kubectl_explain_documents_kv_transfer_the_cpu_kv_cache_and_restarts(cluster, crd_installed):
    # The apiserver publishes a new CRD's OpenAPI asynchronously after Established; nothing to watch, so poll.
    deadline = time.monotonic() + 30
    while (out := kubectl(cluster, "explain", "dinf.spec.kvTransfer", check=False)).returncode != 0:
        assert time.monotonic() < deadline, out.stderr
        time.sleep(0.25)
    text = " ".join(out.stdout.split())
    kv = crdgen.openapi_schema()["properties"]["spec"]["properties"]["kvTransfer"]
    assert kv["description"] in text
    for field in ("mode", "connector", "backend"):
        assert kv["properties"][field]["description"] in text, (field, out.stdout)
    assert "NixlPushConnector" in text and "LIBFABRIC when EFA is in use" in text
    # Published now: the cpu profile's KV cache field is explained too.
    text = " ".join(kubectl(cluster, "explain", "dinf.spec.accelerator.kvCacheGiB").stdout.split())
    field = crdgen.openapi_schema()["properties"]["spec"]["properties"]["accelerator"]["properties"]["kvCacheGiB"]
    assert field["description"] in text and "VLLM_CPU_KVCACHE_SPACE" in text
    # How a user restarts the engines onto an upgraded operator's plugin.
    text = " ".join(kubectl(cluster, "explain", "dinf.spec.engine.restartedAt").stdout.split())
    field = crdgen.openapi_schema()["properties"]["spec"]["properties"]["engine"]["properties"]["restartedAt"]
    assert field["description"] in text and "kubectl rollout restart" in text


def test_status_subresource_and_printer_columns(cluster, crd_installed, namespace):
    c = cluster.client
    c.create(crd_installed(metadata={"name": "shown", "namespace": namespace}, spec=copy.deepcopy(MINIMAL),
                           status={"endpoint": "http://ignored"}))
    assert not (c.get(crd_installed, "shown", namespace=namespace).status or {}).get("endpoint"), \
        "status must be a subresource: the main endpoint ignores it"
    c.patch(crd_installed.Status, "shown", {"status": {
        "mode": "push", "prefillReady": "1/1", "decodeReady": "0/1", "endpoint": "http://shown-router:8000",
        "conditions": [{"type": "Ready", "status": "False", "reason": "DecodeNotReady", "message": "0/1 decode"}],
    }}, namespace=namespace, patch_type=PatchType.MERGE)
    out = kubectl(cluster, "get", "dinf", "-n", namespace).stdout.splitlines()
    assert out[0].split() == ["NAME", "MODE", "PREFILL", "DECODE", "READY", "ROLLOUT", "ENDPOINT", "AGE"]
    assert out[1].split()[:6] == ["shown", "push", "1/1", "0/1", "False", "http://shown-router:8000"]


def test_cr_name_at_the_limit_is_accepted_and_one_past_is_rejected_with_the_limit(cluster, crd_installed,
                                                                                   dry_run_namespace):
    """The limit is derived from the children's names (tests/unit/test_name_limit.py proves it is exact)."""
    limit = api.NAME_LIMIT.length
    assert limit == 37
    at_limit = "q" * (limit - 3) + "-32"
    created = cluster.client.create(crd_installed(metadata={"name": at_limit, "namespace": dry_run_namespace},
                                                  spec=copy.deepcopy(MINIMAL)), dry_run=True)
    assert created.metadata.name == at_limit
    for name, message in [
        (at_limit + "b", f"must be at most {limit} characters, got {limit + 1}: children are named after it, and the "
                         "longest, the prefill pod label controller-revision-hash <name>-prefill-<revision>-"
                         "<10-character hash>, may have at most 63 characters"),
        ("qwen3.5", "must consist of lowercase letters, digits and '-', start with a letter"),
        ("3b-llama", "children are Services named after it (<name>-router), which must be DNS-1035 labels"),
    ]:
        with pytest.raises(ApiError) as err:
            cluster.client.create(crd_installed(metadata={"name": name, "namespace": dry_run_namespace},
                                                spec=copy.deepcopy(MINIMAL)), dry_run=True)
        assert err.value.status.code == 422, err.value.status
        assert "metadata.name: " in err.value.status.message and message in err.value.status.message, \
            err.value.status.message


def test_a_rejected_cpu_spec_names_only_the_field_at_fault(cluster, crd_installed, dry_run_namespace):
    """LIBFABRIC with efa off on cpu gets the cpu message, not the generic LIBFABRIC-needs-EFA one as well."""
    err = rejection(cluster, crd_installed, dry_run_namespace, make_spec({
        "accelerator.profile": "cpu", "accelerator.efa": "off", "kvTransfer.backend": "LIBFABRIC"}))
    assert [c.field for c in err.status.details.causes] == ["spec.kvTransfer.backend"], err.status.details.causes
    assert "spec.accelerator.efa turns it off" not in err.status.message


def test_tiny_cpu_example_is_accepted_and_parses_as_stored(cluster, crd_installed, namespace):
    doc = yaml.safe_load((Path(__file__).resolve().parents[2] / "manifests" / "examples" / "tiny-cpu.yaml").read_text())
    cluster.client.create(crd_installed(metadata={"name": doc["metadata"]["name"], "namespace": namespace},
                                        spec=doc["spec"]))
    stored = cluster.client.get(crd_installed, doc["metadata"]["name"], namespace=namespace).spec
    assert stored["accelerator"] == {"profile": "cpu", "kvCacheGiB": 1, "efa": "auto"}
    spec = api.DisaggregatedInferenceSpec.model_validate(stored)
    assert (spec.profile.name, spec.backend, spec.connector, spec.cpu_kv_cache_gib) == (
        "cpu", "UCX", api.PUSH_CONNECTOR, 1)

