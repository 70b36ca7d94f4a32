"""manifests/install/ is generated from the Helm chart; a change to the chart without regenerating fails here."""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
INSTALL = ROOT / "manifests" / "install"


@pytest.fixture(scope="module")
def generate():
    spec = importlib.util.spec_from_file_location("generate_install", INSTALL / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generated(generate) -> dict[str, str]:
    return generate.files()


def test_committed_files_match_the_chart(generate, generated):
    committed = {p.name for p in INSTALL.glob("*.yaml")}
    assert committed == set(generated), f"manifests/install holds {sorted(committed)}; {generate.REGENERATE}"
    for name, text in generated.items():
        assert (INSTALL / name).read_text() == text, f"manifests/install/{name} is stale; {generate.REGENERATE}"


def test_check_mode_names_a_stale_file(generate, tmp_path, monkeypatch):
    copy = tmp_path / "install"
    shutil.copytree(INSTALL, copy)
    (copy / "rbac.yaml").write_text((copy / "rbac.yaml").read_text().replace('"patch"', '"update"'))
    monkeypatch.setattr(generate, "HERE", copy)
    with pytest.raises(SystemExit) as exc:
        generate.main(["--check"])
    assert "rbac.yaml" in str(exc.value) and "generate.py" in str(exc.value)


def test_install_rbac_is_the_charts_default_rbac(generated):
    """The plain manifests grant exactly what the chart grants by default (cluster-wide, standalone)."""
    docs = list(yaml.safe_load_all(generated["rbac.yaml"]))
    assert [d["kind"] for d in docs] == ["ClusterRole", "ClusterRoleBinding"]
    resources = {r for rule in docs[0]["rules"] for r in rule["resources"]}
    assert {"disaggregatedinferences", "disaggregatedinferences/status", "statefulsets", "deployments", "services",
            "configmaps", "poddisruptionbudgets", "pods", "events", "customresourcedefinitions",
            "serviceaccounts", "clusterroles", "clusterrolebindings"} <= resources
    assert "tokenreviews" not in resources, "the rendezvous sends TokenReviews as its own ServiceAccount"
    assert docs[1]["subjects"] == [{"kind": "ServiceAccount", "name": "disagg-operator", "namespace": "disagg-system"}]


def test_no_helm_leftovers(generated):
    for name, text in generated.items():
        assert "helm.sh/chart" not in text and "managed-by: Helm" not in text and "{{" not in text, name


def test_kustomization_takes_the_crds_from_the_generated_folder(generated):
    kustomization = yaml.safe_load(generated["kustomization.yaml"])
    assert kustomization["resources"][0] == "../../crds"
    assert set(kustomization["resources"][1:]) == set(generated) - {"kustomization.yaml"}
