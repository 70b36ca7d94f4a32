"""`disagg compare` on the real node: the command a user runs starts its Job beside the router, the Job switches a
deployment from push to pull and back through the rollout machinery, replays a workload in each mode, and leaves
a report whose every request the router's own log shows served in its segment's mode.

The engine pods run the engine emulator (a mode switch surges a whole revision, more engines than this host's two
cores can run as vLLM engines); the operator, the rollouts, the router, the Job and its RBAC are real.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from lightkube.resources.batch_v1 import Job
from lightkube.resources.core_v1 import ConfigMap, ServiceAccount
from lightkube.resources.rbac_authorization_v1 import Role, RoleBinding

from disagg.compare.job import LABEL_RUN
from support.dinf import Dinf, create
from support.kube import watch_until
from support.traffic import settled

pytestmark = [pytest.mark.cluster, pytest.mark.node]

REQUESTS = 12


@pytest.fixture(scope="module")
def deployment(cluster, real_node, operator_release, module_namespace):
    name = create(cluster, module_namespace, {
        "apiVersion": "serving.disagg.io/v1alpha1", "kind": "DisaggregatedInference",
        "metadata": {"name": "compared"},
        "spec": {"model": {"name": "tiny"}, "accelerator": {"profile": "cpu"},
                 "engine": {"emulator": {"profile": "cpu-kv64k"}}, "kvTransfer": {"mode": "push"},
                 "router": {"pairWaitSeconds": 120}}})
    watch_until(cluster, Dinf, name, settled(1, 1), namespace=module_namespace, timeout=300, what="settled")
    return name


def disagg_compare(cluster, namespace: str, *args: str) -> subprocess.CompletedProcess[str]:
    disagg = str(Path(sys.executable).with_name("disagg"))
    return subprocess.run([disagg, "compare", *args, "-n", namespace], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig)})


def test_compare_switches_the_mode_through_the_rollout_and_reports_each_mode_proven(cluster, deployment,
                                                                                    module_namespace, tmp_path):
    workload = tmp_path / "mine.jsonl"
    workload.write_text("\n".join(json.dumps(
        {"prompt": f"question {i}: what comes after {i}?", "max_tokens": 8} if i % 3 else
        {"messages": [{"role": "user", "content": f"say {i}"}], "output_tokens": 6}) for i in range(REQUESTS)))
    done = disagg_compare(cluster, module_namespace, deployment, "--workload", str(workload), "--rate", "4",
                          "--rounds", "1", "--warmup", "1", "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "switching" in done.stdout and "Recommendation" in done.stdout  # the Job's progress, then the report
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["order"] == ["push", "pull"]
    assert report["sent"] == {"push": REQUESTS, "pull": REQUESTS} and report["failed"] == {"push": 0, "pull": 0}
    # Every answered request was served by a router of its segment's mode, by the router's own log.
    assert report["served_in_other_mode"] == {"push": 0, "pull": 0} and report["unlogged"] == {"push": 0, "pull": 0}
    assert {r["served_mode"] for r in report["requests"] if r["mode"] == "pull"} == {"pull"}
    assert all(r["handoff_ms"] is not None for r in report["requests"])
    assert report["summary"]["push"]["ttft"]["n"] == REQUESTS == report["summary"]["pull"]["ttft"]["n"]
    assert (tmp_path / "out" / "report.md").read_text().startswith(f"# disagg compare: {module_namespace}/")
    assert (tmp_path / "out" / "plot.svg").read_text().startswith("<svg")
    # The deployment serves in push again, and nothing of the run is left.
    watch_until(cluster, Dinf, deployment, settled(1, 1), namespace=module_namespace, timeout=300, what="settled")
    spec = cluster.client.get(Dinf, deployment, namespace=module_namespace).to_dict()["spec"]
    assert spec["kvTransfer"]["mode"] == "push"
    run = re.search(r"^disagg compare (\w+):", done.stdout, re.M)
    assert run, done.stdout[:500]
    watch_until(cluster, Job, f"{deployment}-compare-{run[1]}", lambda j: False, namespace=module_namespace,
                timeout=120, what="deleted", gone_ok=True)
    for kind in (ConfigMap, ServiceAccount, Role, RoleBinding):
        assert list(cluster.client.list(kind, namespace=module_namespace, labels={LABEL_RUN: run[1]})) == [], kind


def test_a_bad_workload_is_refused_before_anything_is_created(cluster, deployment, module_namespace, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine", "max_tokens": 4}\n{"prompt": "no length"}\n')
    done = disagg_compare(cluster, module_namespace, deployment, "--workload", str(bad))
    assert done.returncode != 0
    assert "bad.jsonl:2: max_tokens: Field required" in done.stderr
    assert [j for j in cluster.client.list(Job, namespace=module_namespace)
            if LABEL_RUN in (j.metadata.labels or {})] == []
