"""The real node (kubelet, containerd, runc, CNI, kube-proxy, CoreDNS on this host), added once per session to
the session's cluster, with the images the node runs imported into its containerd.

Its teardown stops the node and checks the host is as it was before: the sysctls, iptables, the cni0 bridge,
the kubepods cgroups and the fixed paths the node's components create.
"""
from __future__ import annotations

import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

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
    assert {k: host.iptables_rules(v) for k, v in after.iptables.items()} == \
        {k: host.iptables_rules(v) for k, v in before.iptables.items()}


# -- the product on the node: the operator from its chart, and one CR per module --------------------------------
RELEASE = "disagg-e2e"


@dataclass
class Release:
    name: str
    namespace: str
    values: dict
    """The values it was installed with."""
    values_file: Path

    def upgrade(self, cluster, values: dict) -> None:
        """`helm upgrade` to `values` (and back, with `self.values`), waiting for the operator's Deployment."""
        from support.tools import CHART, helm

        self.values_file.write_text(yaml.safe_dump(values))
        helm("upgrade", "--install", self.name, str(CHART), "--namespace", self.namespace, "--create-namespace",
             "-f", str(self.values_file), "--wait", "--timeout", "180s", cluster=cluster, timeout=240)


@pytest.fixture(scope="session")
def operator_release(cluster, real_node, tmp_path_factory):
    """The operator installed by its Helm chart from the image built from the Dockerfile, running as a pod on the
    real node under the chart's ServiceAccount."""
    from disagg.operator.profiles import CPU_ENGINES_LABEL, CPU_ENGINES_TAINT, CPU_ENGINES_VALUE
    from support.tools import helm

    repository, tag = real_node.images["disagg"].rsplit(":", 1)
    values = {
        "image": {"operator": {"repository": repository, "tag": tag, "pullPolicy": "Never"}},
        "nodeSelector": {CPU_ENGINES_LABEL: CPU_ENGINES_VALUE},
        "tolerations": [{**CPU_ENGINES_TAINT, "operator": "Equal"}],
        "operator": {"resyncSeconds": 30},
    }
    release = Release(RELEASE, RELEASE, values, tmp_path_factory.mktemp("release") / "values.yaml")
    release.upgrade(cluster, values)
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


# -- on failure: what the pods said ---------------------------------------------------------------------------
LOG_LINES = 40


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing node test gets the last lines of every container in the e2e and operator namespaces as a report
    section: the node's pod logs go with the node at the end of the session, and a failure seen only in CI
    must be explainable from CI's output alone."""
    report = yield
    if report.failed and call.when in ("call", "setup") and "cluster" in item.funcargs:
        try:
            report.sections.append(("pod logs", _pod_logs(item.funcargs["cluster"].client)))
        except Exception as e:  # the report must not hide the failure itself
            report.sections.append(("pod logs", f"could not read pod logs: {e!r}"))
    return report


def _pod_logs(client) -> str:
    from lightkube.resources.core_v1 import Namespace, Pod

    out = []
    for ns in client.list(Namespace):
        name = ns.metadata.name
        if not (name.startswith("e2e-") or name == RELEASE):
            continue
        for pod in client.list(Pod, namespace=name):
            for status in (pod.status.containerStatuses or []) if pod.status else []:
                head = f"--- {name}/{pod.metadata.name} [{status.name}] ready={status.ready} " \
                       f"restarts={status.restartCount}"
                try:
                    lines = list(client.log(pod.metadata.name, namespace=name, container=status.name,
                                            tail_lines=LOG_LINES))
                except Exception as e:
                    lines = [f"(no log: {e!r})\n"]
                out.append(head + "\n" + "".join(lines))
    return "\n".join(out) or "(no pods)"
