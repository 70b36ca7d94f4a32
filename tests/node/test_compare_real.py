"""`disagg compare` with real vLLM engines on the real node: the tiny-cpu example, push against pull, the mode
switched with `--switch recreate` (this host has a core per engine and no room for a surge). The report's every
request was served by a router of its segment's mode and carries a KV handoff, so each mode's figures are that
mode's P/D path."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.dinf import Dinf
from support.kube import watch_until
from support.node import deploy, serving

pytestmark = [pytest.mark.cluster, pytest.mark.node, pytest.mark.engines]

REQUESTS = 8


def test_compare_on_the_tiny_cpu_example(cluster, real_node, operator_release, module_namespace, tmp_path):
    d = deploy(cluster, real_node, module_namespace, "tiny-compare", "push", router={"pairWaitSeconds": 300})
    assert d is not None
    workload = tmp_path / "questions.jsonl"
    workload.write_text("\n".join(json.dumps({"prompt": f"Question {i}: the project ships a text; recite it.",
                                              "max_tokens": 8}) for i in range(REQUESTS)))
    done = subprocess.run(
        [str(Path(sys.executable).with_name("disagg")), "compare", d.name, "-n", module_namespace, "--workload",
         str(workload), "--rate", "1", "--rounds", "1", "--warmup", "1", "--switch", "recreate",
         "--rollout-timeout", "600", "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=1500, env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig)})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["sent"] == {"push": REQUESTS, "pull": REQUESTS} and report["failed"] == {"push": 0, "pull": 0}
    assert report["served_in_other_mode"] == {"push": 0, "pull": 0} and report["unlogged"] == {"push": 0, "pull": 0}
    assert all(r["handoff_ms"] is not None and r["served_mode"] == r["mode"] for r in report["requests"])
    assert report["verdict"]["reason"]
    print((tmp_path / "out" / "report.md").read_text())  # the report from the real node, for the closing note
    watch_until(cluster, Dinf, d.name, serving, namespace=module_namespace, timeout=600, what="serving again")
    assert cluster.client.get(Dinf, d.name, namespace=module_namespace).to_dict()["spec"]["kvTransfer"]["mode"] == \
        "push"
