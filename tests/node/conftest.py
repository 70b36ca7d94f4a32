"""The real node (kubelet, containerd, runc, CNI, kube-proxy, CoreDNS on this host), added once per session to
the session's cluster, with the images the node runs imported into its containerd.

Its teardown stops the node and checks the host is as it was before: the sysctls, iptables, the cni0 bridge,
the kubepods cgroups and the fixed paths the node's components create.
"""
from __future__ import annotations

import sys
import uuid
from dataclasses import dataclass

import pytest
import yaml

from disagg.devcluster.node import host


@dataclass
class NodeUnderTest:
    name: str
    ip: str
    images: dict[str, str]  # image name -> the reference pods use


@pytest.fixture(scope="session")
def real_node(cluster):
    if cluster.local is None:
        pytest.fail("the real-node tests start their own node: run them without DISAGG_TEST_KUBECONFIG")
    from disagg.devcluster.images import catalog
    from disagg.devcluster.node.node import NodeSpec, default_spec, recover

    # A node killed earlier left its changes and its snapshot: put the host back first, so `before` is the host.
    assert recover() == []
    before = host.HostSnapshot.capture(cluster.local.dir / "node")
    spec: NodeSpec = default_spec(import_images=catalog.ensure_images)
    node = cluster.local.add_real_node(spec, progress=lambda m: print(m, file=sys.stderr, flush=True))
    yield NodeUnderTest(spec.name, node.layout.ip, node.images)
    problems = node.stop()
    cluster.local.node = None
    after = host.HostSnapshot.capture(cluster.local.dir / "node")
    assert problems == [], problems
    assert (after.sysctls, after.absent_paths, after.had_cni0, after.absent_cgroups) == \
        (before.sysctls, before.absent_paths, before.had_cni0, before.absent_cgroups)
    assert after.iptables == before.iptables or _rules(after.iptables) == _rules(before.iptables)


def _rules(dumps: dict[str, str]) -> dict[str, list[str]]:
    """iptables-save output without its timestamps and packet counters."""
    return {k: [line.split(" [")[0] for line in v.splitlines() if not line.startswith("#")] for k, v in dumps.items()}


# -- the product on the node: the operator from its chart, and one CR per module --------------------------------
RELEASE = "disagg-e2e"


@dataclass
class Release:
    name: str
    namespace: str


@pytest.fixture(scope="session")
def operator_release(cluster, real_node, tmp_path_factory):
    """The operator installed by its Helm chart from the image built from the Dockerfile, running as a pod on the
    real node under the chart's ServiceAccount."""
    from disagg.operator.profiles import CPU_ENGINES_LABEL, CPU_ENGINES_TAINT, CPU_ENGINES_VALUE
    from support.tools import CHART, helm

    repository, tag = real_node.images["disagg"].rsplit(":", 1)
    values = tmp_path_factory.mktemp("release") / "values.yaml"
    values.write_text(yaml.safe_dump({
        "image": {"operator": {"repository": repository, "tag": tag, "pullPolicy": "Never"}},
        "nodeSelector": {CPU_ENGINES_LABEL: CPU_ENGINES_VALUE},
        "tolerations": [{**CPU_ENGINES_TAINT, "operator": "Equal"}],
        "operator": {"resyncSeconds": 30},
    }))
    release = Release(RELEASE, RELEASE)
    helm("upgrade", "--install", release.name, str(CHART), "--namespace", release.namespace, "--create-namespace",
         "-f", str(values), "--wait", "--timeout", "180s", cluster=cluster, timeout=240)
    yield release
    helm("uninstall", release.name, "--namespace", release.namespace, "--wait", "--timeout", "120s",
         cluster=cluster, timeout=180)


@pytest.fixture(scope="module")
def module_namespace(cluster):
    """A namespace for one module's CR, deleted afterwards and awaited: its engine pods must be gone (their cores
    free) before the next module's engines start. Its model volume goes with it."""
    from lightkube.models.meta_v1 import ObjectMeta
    from lightkube.resources.core_v1 import Namespace, PersistentVolume

    from support.kube import watch_until

    name = f"e2e-{uuid.uuid4().hex[:6]}"
    cluster.client.create(Namespace(metadata=ObjectMeta(name=name)))
    yield name
    cluster.client.delete(Namespace, name)
    watch_until(cluster, Namespace, name, lambda ns: False, timeout=180, what="deleted", gone_ok=True)
    for pv in cluster.client.list(PersistentVolume, labels={"serving.disagg.io/models-for": name}):
        cluster.client.delete(PersistentVolume, pv.metadata.name)
