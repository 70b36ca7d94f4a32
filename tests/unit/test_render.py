from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from disagg.cli import main
from disagg.operator.api import DisaggregatedInference
from disagg.operator.engine_builders import launch_script

CR = """\
apiVersion: serving.disagg.io/v1alpha1
kind: DisaggregatedInference
metadata:
  name: qwen
  namespace: ml
spec:
  model: {name: Qwen/Qwen3-32B}
  accelerator: {profile: nvidia-h200}
  prefill: {tensorParallelSize: 4}
  decode: {tensorParallelSize: 4, replicas: 2}
"""


def render(capsys, argv: list[str]) -> tuple[int, str, str]:
    try:
        main(["render", *argv])
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def cr_file(tmp_path: Path) -> Path:
    path = tmp_path / "cr.yaml"
    path.write_text(CR)
    return path


def test_render_prints_every_child_as_a_yaml_stream(capsys, cr_file):
    code, out, err = render(capsys, ["-f", str(cr_file)])
    assert code == 0, err
    docs = list(yaml.safe_load_all(out))
    [rev] = {d["metadata"]["labels"]["serving.disagg.io/revision"] for d in docs if d["kind"] == "StatefulSet"}
    assert sorted((d["kind"], d["metadata"]["name"]) for d in docs) == sorted([
        ("ConfigMap", f"qwen-launch-{rev}"), ("Service", "qwen-rendezvous"), ("Deployment", "qwen-rendezvous"),
        ("ServiceAccount", "qwen-rendezvous"), ("ClusterRoleBinding", "disagg-rendezvous:ml:qwen"),
        ("Service", "qwen-prefill"), ("StatefulSet", f"qwen-prefill-{rev}"), ("PodDisruptionBudget", "qwen-prefill"),
        ("Service", "qwen-decode"), ("StatefulSet", f"qwen-decode-{rev}"), ("PodDisruptionBudget", "qwen-decode"),
        ("Service", "qwen-router"), ("Deployment", "qwen-router"),
        ("DisaggregatedRole", "qwen-prefill"), ("DisaggregatedRole", "qwen-decode")])
    [role] = [d for d in docs if d["kind"] == "DisaggregatedRole" and d["metadata"]["name"] == "qwen-decode"]
    assert role["spec"] == {"deployment": "qwen", "role": "decode", "replicas": 2}
    for doc in docs:
        # The rendezvous' ClusterRoleBinding (spec.rendezvous.auth: kubernetes) has no namespace.
        assert doc["metadata"].get("namespace") == (None if doc["kind"] == "ClusterRoleBinding" else "ml")
        assert "ownerReferences" not in doc["metadata"]  # no uid offline
    [sts] = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == f"qwen-decode-{rev}"]
    assert sts["spec"]["replicas"] == 2
    # The launch scripts survive the YAML round trip byte for byte, and print as readable blocks.
    cr = DisaggregatedInference.model_validate(yaml.safe_load(CR))
    [cm] = [d for d in docs if d["kind"] == "ConfigMap"]
    assert cm["data"]["prefill.sh"] == launch_script(cr.spec, "prefill")
    assert "prefill.sh: |" in out
    assert "&id" not in out and "*id" not in out


def test_render_is_byte_identical_across_runs(capsys, cr_file):
    first = render(capsys, ["-f", str(cr_file)])
    second = render(capsys, ["-f", str(cr_file)])
    assert first == second and first[1]


def test_render_reads_stdin_and_sets_operator_image(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(CR))
    code, out, err = render(capsys, ["-f", "-", "--operator-image", "registry.example/disagg:dev"])
    assert code == 0, err
    docs = list(yaml.safe_load_all(out))
    images = set()
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            pod = d["spec"]["template"]["spec"]
            images |= {c["image"] for c in pod["containers"] + pod.get("initContainers", [])}
    assert images == {"registry.example/disagg:dev", "vllm/vllm-openai:v0.32.0"}


def test_namespace_defaults_when_the_cr_has_none(capsys, tmp_path):
    path = tmp_path / "cr.yaml"
    path.write_text(CR.replace("  namespace: ml\n", ""))
    code, out, _ = render(capsys, ["-f", str(path)])
    assert code == 0
    docs = list(yaml.safe_load_all(out))
    assert {d["metadata"]["namespace"] for d in docs if d["kind"] != "ClusterRoleBinding"} == {"default"}
    [binding] = [d for d in docs if d["kind"] == "ClusterRoleBinding"]
    assert binding["metadata"]["name"] == "disagg-rendezvous:default:qwen"
    assert binding["subjects"][0]["namespace"] == "default"


@pytest.mark.parametrize("edit, field", [
    (("profile: nvidia-h200", "profile: nvidia-a100"), "spec.accelerator.profile"),
    (("prefill: {tensorParallelSize: 4}", "prefill: {tensorParalelSize: 4}"), "spec.prefill.tensorParalelSize"),
    (("model: {name: Qwen/Qwen3-32B}", "model: {}"), "spec.model.name"),
    (("decode: {tensorParallelSize: 4, replicas: 2}", "decode: {tensorParallelSize: 4, replicas: -1}"),
     "spec.decode.replicas"),
])
def test_validation_error_names_the_field_and_exits_2(capsys, tmp_path, edit, field):
    path = tmp_path / "bad.yaml"
    path.write_text(CR.replace(*edit))
    code, out, err = render(capsys, ["-f", str(path)])
    assert code == 2
    assert out == ""
    assert field in err and str(path) in err


@pytest.mark.parametrize("text, message", [
    ("a: [1,", "not valid YAML"),
    ("kind: ConfigMap\nmetadata: {name: x}\n", "no DisaggregatedInference"),
    (CR.replace("  name: qwen\n", ""), "metadata.name"),
    (CR.replace("decode: {tensorParallelSize: 4, replicas: 2}",
                "decode: {tensorParallelSize: 4}\n  engine: {port: 5600}"), "spec.engine.port"),
])
def test_bad_input_exits_2(capsys, tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    code, _, err = render(capsys, ["-f", str(path)])
    assert code == 2 and message in err


def test_missing_file_exits_2(capsys, tmp_path):
    code, _, err = render(capsys, ["-f", str(tmp_path / "nope.yaml")])
    assert code == 2 and "nope.yaml" in err


def test_command_line_entry_point(cr_file):
    """The real command, in a fresh interpreter (lazy imports, exit codes)."""
    ok = subprocess.run([sys.executable, "-m", "disagg.cli", "render", "-f", str(cr_file)],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert len(list(yaml.safe_load_all(ok.stdout))) == 15, "13 children and 2 DisaggregatedRoles"
    bad = subprocess.run([sys.executable, "-m", "disagg.cli", "render", "-f", "-"],
                         input=CR.replace("nvidia-h200", "h300"), capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "spec.accelerator.profile" in bad.stderr
