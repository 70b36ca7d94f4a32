"""An engine pod whose preflight fails ends the CR in Degraded with the real termination message of a real
container: here /dev/shm made too small through the roles' podTemplates, as a user's override could. Both roles
fail before vLLM starts, so the module needs no core."""
from __future__ import annotations

import pytest
from lightkube.resources.core_v1 import Pod

from disagg.operator import names
from support.dinf import Dinf, cond
from support.kube import watch_until
from support.node import deploy

pytestmark = [pytest.mark.cluster, pytest.mark.node]


def test_a_failing_preflight_ends_in_degraded_with_the_containers_termination_message(
        cluster, real_node, operator_release, module_namespace):
    small_shm = {"spec": {"volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}}]}}
    deploy(cluster, real_node, module_namespace, "tiny-shm", "push", wait=False,
           prefill={"podTemplate": small_shm}, decode={"podTemplate": small_shm})
    # Either role may fail first; once the prefill has, Degraded names it (prefill pods come first).
    degraded = watch_until(cluster, Dinf, "tiny-shm",
                           lambda d: (c := cond(d, "Degraded")) is not None and c["status"] == "True"
                           and "disagg preflight (prefill)" in c["message"],
                           namespace=module_namespace, timeout=180, what="Degraded, naming the prefill pod")
    (pod,) = cluster.client.list(Pod, namespace=module_namespace, labels={
        names.LABEL_INSTANCE: "tiny-shm", names.LABEL_COMPONENT: "prefill"})
    engine = next(s for s in pod.status.containerStatuses if s.name == "engine")
    terminated = engine.state.terminated or engine.lastState.terminated
    assert terminated.exitCode == 1
    assert terminated.message.startswith("disagg preflight (prefill): shared memory /dev/shm is 1024 KiB, below"), \
        terminated.message
    reason = cond(degraded, "Degraded")
    assert terminated.message.strip() in reason["message"], reason
