"""The local cluster is a real Kubernetes control plane with P5en- and Trainium-shaped nodes."""
from __future__ import annotations

import pytest
from lightkube import codecs
from lightkube.core.exceptions import ApiError
from lightkube.generic_resource import create_global_resource
from lightkube.resources.apiextensions_v1 import CustomResourceDefinition
from lightkube.resources.apps_v1 import StatefulSet
from lightkube.resources.core_v1 import Node, Pod

from support.kube import pod_ready, pod_unschedulable, watch_until

pytestmark = pytest.mark.cluster

P5EN_TOLERATIONS = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


def efa_pod(name: str, namespace: str, gpus: int, efa: int, node_selector: dict | None = None) -> Pod:
    limits = {"nvidia.com/gpu": str(gpus), "vpc.amazonaws.com/efa": str(efa), "hugepages-2Mi": "5120Mi",
              "memory": "64Gi", "cpu": "16"}
    return codecs.from_dict({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "nodeSelector": node_selector or {"node.kubernetes.io/instance-type": "p5en.48xlarge"},
            "tolerations": P5EN_TOLERATIONS,
            "containers": [{"name": "engine", "image": "vllm/vllm-openai:latest",
                            "resources": {"limits": limits, "requests": limits}}],
        },
    })


def _node(client, name: str) -> Node:
    return client.get(Node, name)


def short_efa_node(client) -> str:
    nodes = [n for n in client.list(Node, labels={"node.kubernetes.io/instance-type": "p5en.48xlarge"})
             if n.status.allocatable["vpc.amazonaws.com/efa"] == "15"]
    assert len(nodes) == 1, "the default fleet has exactly one p5en node advertising 15 EFA"
    return nodes[0].metadata.name


def test_default_fleet_shape(cluster):
    if cluster.local is None:
        pytest.skip("an external cluster (DISAGG_TEST_KUBECONFIG) has its own fleet")
    nodes = list(cluster.client.list(Node))
    by_type: dict[str, int] = {}
    for n in nodes:
        t = n.metadata.labels["node.kubernetes.io/instance-type"]
        by_type[t] = by_type.get(t, 0) + 1
    assert by_type == {"p5en.48xlarge": 4, "trn2.48xlarge": 2, "trn1.32xlarge": 1, "m7i.4xlarge": 2}
    zones = {n.metadata.labels["topology.kubernetes.io/zone"] for n in nodes}
    assert len(zones) == 2
    trn2 = next(n for n in nodes if n.metadata.labels["node.kubernetes.io/instance-type"] == "trn2.48xlarge")
    assert trn2.status.allocatable["aws.amazon.com/neuron"] == "16"
    assert trn2.status.allocatable["vpc.amazonaws.com/efa"] == "16"
    assert [(t.key, t.effect) for t in trn2.spec.taints] == [("aws.amazon.com/neuron", "NoSchedule")]
    for n in nodes:
        assert all(f"topology.k8s.aws/network-node-layer-{i}" in n.metadata.labels for i in (1, 2, 3))
    short_efa_node(cluster.client)


def test_full_p5en_pod_lands_on_a_16_efa_node_and_becomes_ready(cluster, namespace):
    c = cluster.client
    c.create(efa_pod("engine", namespace, gpus=8, efa=16))
    pod = watch_until(cluster, Pod, "engine", pod_ready, namespace=namespace, what="Ready")
    node = _node(c, pod.spec.nodeName)
    assert node.metadata.labels["node.kubernetes.io/instance-type"] == "p5en.48xlarge"
    assert node.status.allocatable["vpc.amazonaws.com/efa"] == "16"


def test_16_efa_pod_never_lands_on_the_15_efa_node(cluster, namespace):
    c = cluster.client
    short = short_efa_node(c)
    c.create(efa_pod("pinned", namespace, gpus=8, efa=16, node_selector={"kubernetes.io/hostname": short}))
    pod = watch_until(cluster, Pod, "pinned", pod_unschedulable, namespace=namespace, what="Unschedulable")
    assert pod.spec.nodeName is None
    msg = next(x for x in pod.status.conditions if x.type == "PodScheduled").message
    assert "Insufficient vpc.amazonaws.com/efa" in msg
    # The same request fits a 15-EFA budget: the node itself is healthy, only its EFA count is short.
    c.create(efa_pod("fits", namespace, gpus=8, efa=15, node_selector={"kubernetes.io/hostname": short}))
    assert watch_until(cluster, Pod, "fits", pod_ready, namespace=namespace).spec.nodeName == short


def test_17_efa_pod_stays_pending_unschedulable(cluster, namespace):
    c = cluster.client
    c.create(efa_pod("too-big", namespace, gpus=8, efa=17))
    pod = watch_until(cluster, Pod, "too-big", pod_unschedulable, namespace=namespace, what="Unschedulable")
    assert pod.status.phase == "Pending"
    assert "Insufficient vpc.amazonaws.com/efa" in next(
        x for x in pod.status.conditions if x.type == "PodScheduled").message


def test_statefulset_of_two_becomes_ready(cluster, namespace):
    c = cluster.client
    c.create(codecs.from_dict({
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "web", "namespace": namespace},
        "spec": {"replicas": 2, "serviceName": "web", "selector": {"matchLabels": {"app": "web"}},
                 "template": {"metadata": {"labels": {"app": "web"}},
                              "spec": {"containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}]}}},
    }))
    sts = watch_until(cluster, StatefulSet, "web", lambda s: (s.status.readyReplicas or 0) == 2, namespace=namespace,
                      what="2 ready replicas")
    assert sts.status.replicas == 2
    pods = list(c.list(Pod, namespace=namespace, labels={"app": "web"}))
    assert sorted(p.metadata.name for p in pods) == ["web-0", "web-1"]
    assert all(pod_ready(p) for p in pods)


def test_apiserver_rejects_an_object_that_fails_the_schema(cluster):
    c = cluster.client
    crd = codecs.from_dict({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.testbed.disagg.io"},
        "spec": {"group": "testbed.disagg.io", "scope": "Cluster",
                 "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
                 "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                     "type": "object", "properties": {"spec": {"type": "object", "required": ["size"],
                                                               "properties": {"size": {"type": "integer",
                                                                                       "minimum": 1}}}}}}}]},
    })
    c.create(crd)
    try:
        watch_until(cluster, CustomResourceDefinition, "widgets.testbed.disagg.io",
                    lambda o: any(x.type == "Established" and x.status == "True" for x in o.status.conditions or []),
                    what="Established")
        Widget = create_global_resource("testbed.disagg.io", "v1", "Widget", "widgets")
        with pytest.raises(ApiError) as bad:
            c.create(Widget(metadata={"name": "bad"}, spec={"size": 0}))
        assert bad.value.status.code == 422
        assert "spec.size" in bad.value.status.message
        c.create(Widget(metadata={"name": "good"}, spec={"size": 2}))
        assert c.get(Widget, "good").spec["size"] == 2
    finally:
        c.delete(CustomResourceDefinition, "widgets.testbed.disagg.io")
