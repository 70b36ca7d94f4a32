"""The operator runs whole deployments of the engine emulator from the CR (`spec.engine.emulator`), on the real
apiserver and scheduler: 16 prefill and 16 decode emulated engines, their router and rendezvous fit one node shaped
like the real node (2 CPUs), and `kubectl explain` documents the CR surface."""
from __future__ import annotations

import time

import pytest
from lightkube import codecs
from lightkube.resources.apps_v1 import StatefulSet
from lightkube.resources.core_v1 import ConfigMap, Node, Pod

from disagg.connector.wire import emulator as contract
from disagg.devcluster import fleet
from disagg.operator import crdgen
from disagg.operator.engine_builders import EMULATOR_LABEL
from disagg.operator.profiles import CPU_ENGINES_LABEL, CPU_ENGINES_TAINT, CPU_ENGINES_VALUE
from support.dinf import Dinf, create, is_ready, revision
from support.kube import watch_until
from support.operator import OperatorProcess
from support.tools import kubectl

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def operator(cluster, crd_installed, tmp_path_factory):
    op = OperatorProcess(cluster.kubeconfig, tmp_path_factory.mktemp("operator") / "operator.log", resync_seconds=3)
    op.start()
    yield op
    op.stop()


@pytest.fixture
def two_cpu_node(cluster, namespace):
    """A simulated node with the real node's two CPUs and memory, labelled and tainted for CPU engines, so only this
    test's CR lands there."""
    t = fleet.CATALOG["m7i.4xlarge"]
    node = fleet.build_node(t, 0, zone_index=0, global_index=251)
    name = node["metadata"]["name"] = node["metadata"]["labels"]["kubernetes.io/hostname"] = f"emu-{namespace}"
    node["metadata"]["labels"][CPU_ENGINES_LABEL] = CPU_ENGINES_VALUE
    node["spec"]["taints"] = [CPU_ENGINES_TAINT]
    for side in ("capacity", "allocatable"):
        node["status"][side].update({"cpu": "2", "memory": "23Gi", "pods": "110"})
    cluster.client.create(codecs.from_dict(node))
    yield name
    cluster.client.delete(Node, name)


def emulated_cr(name: str, replicas: int) -> dict:
    return {"apiVersion": "serving.disagg.io/v1alpha1", "kind": "DisaggregatedInference", "metadata": {"name": name},
            "spec": {"model": {"name": "tiny"}, "accelerator": {"profile": "cpu"},
                     "engine": {"emulator": {"profile": "cpu-kv64k"}},
                     "prefill": {"replicas": replicas}, "decode": {"replicas": replicas}}}


def test_sixteen_pairs_of_emulated_engines_fit_a_two_cpu_node(cluster, operator, namespace, two_cpu_node):
    name = create(cluster, namespace, emulated_cr("fleet", 16))
    dinf = watch_until(cluster, Dinf, name, is_ready, namespace=namespace, timeout=180, what="Ready")
    assert dinf.status["prefill"]["ready"] == 16 and dinf.status["decode"]["ready"] == 16
    assert dinf.status["backend"] == contract.TRANSPORT
    pods = list(cluster.client.list(Pod, namespace=namespace, labels={"app.kubernetes.io/instance": name}))
    engines = [p for p in pods if p.metadata.labels.get(EMULATOR_LABEL) == "emulator"]
    assert len(engines) == 32 and len(pods) == 34  # and the router and the rendezvous
    assert {p.spec.nodeName for p in pods} == {two_cpu_node}, "the scheduler placed them all on the two CPUs"
    millicores = sum(int(p.spec.containers[0].resources.requests["cpu"].removesuffix("m")) for p in engines)
    assert millicores <= 1000, "half the node is left for the router, the rendezvous and the node itself"
    rev = revision(cluster, namespace, name)
    for role in ("prefill", "decode"):
        [sts] = cluster.client.list(StatefulSet, namespace=namespace, labels={
            "app.kubernetes.io/instance": name, "app.kubernetes.io/component": role, "serving.disagg.io/revision": rev})
        assert not sts.spec.template.spec.initContainers
        assert sts.spec.template.metadata.labels[EMULATOR_LABEL] == "emulator"
    script = cluster.client.get(ConfigMap, f"{name}-launch-{rev}", namespace=namespace).data["decode.sh"]
    assert "exec disagg emulator" in script and "--profile cpu-kv64k" in script


def test_kubectl_explain_documents_the_emulator(cluster, crd_installed):
    # The apiserver publishes a CRD's OpenAPI asynchronously after Established: nothing to watch, so poll.
    deadline = time.monotonic() + 30
    while (out := kubectl("explain", "dinf.spec.engine.emulator", cluster=cluster, check=False)).returncode != 0:
        assert time.monotonic() < deadline, out.stderr
        time.sleep(0.25)
    text = " ".join(out.stdout.split())
    field = crdgen.openapi_schema()["properties"]["spec"]["properties"]["engine"]["properties"]["emulator"]
    assert field["description"] in text and "serving.disagg.io/engine=emulator" in text
    for sub in ("profile", "kvCacheBlocks"):
        assert field["properties"][sub]["description"] in text, sub
    assert set(field["properties"]["profile"]["enum"]) == set(contract.PROFILES)
