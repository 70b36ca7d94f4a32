"""disagg compare's cluster side, without a cluster: the Job and the least RBAC it runs with, the arguments it gets
from the command line, and when a deployment counts as served in a mode."""
from __future__ import annotations

import base64
import gzip
import random

import pytest

from disagg import cli
from disagg.compare import command, job, workload
from disagg.compare.settled import engines_left, waiting_for
from disagg.operator import names


def compare_job(**kw) -> job.CompareJob:
    return job.CompareJob(**{"namespace": "ns", "name": "demo", "run": "ab12c", "image": "disagg:1",
                             "args": ("--rate", "2"), **kw})


def by_kind(objs: list[dict]) -> dict[str, dict]:
    return {o["kind"]: o for o in objs}


def test_the_job_runs_compare_run_on_the_routers_image_with_a_role_for_this_cr_only():
    objs = by_kind(job.objects(compare_job()))
    assert list(objs) == ["ServiceAccount", "Role", "RoleBinding", "Job"]  # no workload: the synthetic one
    assert all(o["metadata"]["labels"][job.LABEL_RUN] == "ab12c" and o["metadata"]["namespace"] == "ns"
               for o in objs.values())
    rules = objs["Role"]["rules"]
    assert rules[0] == {"apiGroups": ["serving.disagg.io"], "resources": ["disaggregatedinferences"],
                        "resourceNames": ["demo"], "verbs": ["get", "patch"]}
    assert {"apiGroups": ["serving.disagg.io"], "resources": ["disaggregatedroles"], "verbs": ["get", "patch"],
            "resourceNames": ["demo-prefill", "demo-decode"]} in rules  # --switch recreate, through /scale
    assert not any("delete" in r["verbs"] or "*" in r["verbs"] for r in rules)
    spec = objs["Job"]["spec"]
    pod = spec["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"] == "disagg:1" and c["command"] == ["disagg"]
    assert c["args"][:7] == ["compare-run", "--name", "demo", "--namespace", "ns", "--report-configmap",
                             "demo-compare-ab12c-report"] and c["args"][-2:] == ["--rate", "2"]
    assert pod["serviceAccountName"] == "demo-compare-ab12c" and pod["restartPolicy"] == "Never"
    assert spec["backoffLimit"] == 0 and spec["activeDeadlineSeconds"] == 3600
    assert objs["RoleBinding"]["subjects"][0]["name"] == "demo-compare-ab12c"


def test_the_job_runs_where_the_router_runs():
    taint = {"key": "disagg.io/cpu-engines", "operator": "Equal", "value": "true", "effect": "NoSchedule"}
    placed = job.objects(compare_job(placement=(("nodeSelector", {"pool": "gpu"}), ("tolerations", [taint]))))
    pod = by_kind(placed)["Job"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "gpu"} and pod["tolerations"] == [taint]
    assert pod["serviceAccountName"] == "demo-compare-ab12c"


def test_a_users_workload_travels_compressed_in_a_configmap_and_one_too_large_is_refused():
    text = b'{"prompt": "hello", "max_tokens": 4}\n' * 100
    objs = by_kind(job.objects(compare_job(workload_jsonl=text)))
    packed = objs["ConfigMap"]["binaryData"][job.WORKLOAD_KEY]
    assert gzip.decompress(base64.b64decode(packed)) == text
    (c,) = objs["Job"]["spec"]["template"]["spec"]["containers"]
    assert c["args"][-2:] == ["--workload", f"/workload/{job.WORKLOAD_KEY}"]
    assert c["volumeMounts"] == [{"name": "workload", "mountPath": "/workload", "readOnly": True}]
    noise = random.Random(0).randbytes(1_100_000)  # does not compress
    with pytest.raises(ValueError, match="a ConfigMap holds at most"):
        job.objects(compare_job(workload_jsonl=noise))


def test_the_command_line_passes_every_load_setting_on_to_the_job():
    args = cli.parser().parse_args(["compare", "demo", "-n", "ns", "--rate", "3.5", "--rounds", "3",
                                    "--first", "pull", "--prefer", "tpot", "--switch", "recreate"])
    passed = command.job_args(args)
    run = cli.parser().parse_args(["compare-run", "--name", "demo", "--namespace", "ns", "--report-configmap", "r",
                                   *passed])
    for key in ("requests", "prompt_words", "output_tokens", "rate", "rounds", "first", "prefer", "seed", "warmup",
                "request_timeout", "rollout_timeout", "switch"):
        assert getattr(run, key) == getattr(args, key), key
    assert (run.rate, run.rounds, run.first, run.prefer, run.switch) == (3.5, 3, "pull", "tpot", "recreate")
    # Each of 6 segments: a rollout, 200 requests at 3.5/s, a request's timeout; and the way back.
    assert command.deadline(args, 200) == int(1800 * 7 + 6 * (200 / 3.5 + 300))


def test_segments_that_replay_a_workload_share_no_prefix():
    prompt = workload.WorkloadRequest(prompt="same words", max_tokens=2)
    chat = workload.WorkloadRequest(messages=({"role": "system", "content": "be brief"},
                                              {"role": "user", "content": "hi"}), max_tokens=2)
    assert prompt.tagged("[compare 1]").prompt == "[compare 1] same words"
    tagged = chat.tagged("[compare 2]")
    assert [m.content for m in tagged.messages] == ["[compare 2] be brief", "hi"]
    assert chat.messages[0].content == "be brief"  # the original is untouched


def cr(mode: str = "push", generation: int = 3, observed: int = 3, served: str = "push", rollout: str = "Complete",
       revisions: int = 1, ready: str = "True") -> dict:
    return {"apiVersion": "serving.disagg.io/v1alpha1", "kind": "DisaggregatedInference",
            "metadata": {"name": "demo", "namespace": "ns", "generation": generation},
            "spec": {"model": {"name": "tiny"}, "accelerator": {"profile": "cpu"}, "kvTransfer": {"mode": mode}},
            "status": {"observedGeneration": observed, "mode": served, "rollout": rollout,
                       "revisions": [{"name": f"r{i}"} for i in range(revisions)],
                       "conditions": [{"type": "Ready", "status": ready, "reason": "AllReplicasReady" if ready ==
                                       "True" else "EnginesNotReady", "message": "",
                                       "lastTransitionTime": "2026-12-07T00:00:00Z"}]}}


@pytest.mark.parametrize(("obj", "words"), [
    (cr(), None),
    (cr(observed=2), "the operator to see the change"),
    (cr(mode="pull"), "spec.kvTransfer.mode to be push"),
    (cr(served="pull"), "the push-mode revision"),
    (cr(rollout="RollingOut", revisions=2), "the rollout to complete"),
    (cr(revisions=2), "the rollout to complete"),
    (cr(ready="False"), "Ready (EnginesNotReady)"),
])
def test_a_deployment_is_served_in_a_mode_once_its_rollout_is_complete_and_ready(obj, words):
    got = waiting_for(obj, "push")
    assert got is None if words is None else words in got


def test_engines_left_counts_every_revisions_pods():
    obj = cr(revisions=2)
    obj["status"]["revisions"][0].update({"prefill": {"replicas": 1}, "decode": {"replicas": 2}})
    obj["status"]["revisions"][1].update({"prefill": {"replicas": 1}})
    assert engines_left(obj) == 4
    obj["status"]["revisions"] = []
    assert engines_left(obj) == 0


def test_building_the_command_line_imports_no_client_library():
    import subprocess
    import sys

    code = ("import sys; from disagg import cli; cli.parser(); "
            "print(sorted(m for m in ('lightkube', 'aiohttp', 'disagg.compare.runner') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "lightkube" not in out and "disagg.compare.runner" not in out
    assert names.ROUTER == "router"
