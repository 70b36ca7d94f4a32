"""The built `helm` and `kubectl` (Helm 3.21, kubectl 1.36 from `disagg cluster build`), run against a test cluster."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "disagg-operator"
ALL_OPTIONS = CHART / "ci" / "all-options-values.yaml"


def binary(name: str) -> Path:
    from disagg.devcluster import build

    built = build.bin_dir() / name
    if built.exists():
        return built
    found = shutil.which(name)
    if not found:
        raise FileNotFoundError(f"{name} not found in {build.bin_dir()} or on PATH; run `disagg cluster build {name}`")
    return Path(found)


def run(name: str, *args: str, cluster=None, check: bool = True, stdin: str | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess:
    argv = [str(binary(name)), *([f"--kubeconfig={cluster.kubeconfig}"] if cluster is not None else []), *args]
    out = subprocess.run(argv, capture_output=True, text=True, input=stdin, timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(argv[:1] + list(args))} exited {out.returncode}:\n{out.stderr}{out.stdout}")
    return out


def helm(*args: str, **kw) -> subprocess.CompletedProcess:
    return run("helm", *args, **kw)


def kubectl(*args: str, **kw) -> subprocess.CompletedProcess:
    return run("kubectl", *args, **kw)


def docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def template(*args: str, release: str = "disagg", namespace: str = "disagg-system") -> list[dict]:
    """`helm template` of the chart (without CRDs), as objects."""
    return docs(helm("template", release, str(CHART), "--namespace", namespace, *args).stdout)


def rules_of(objs: list[dict], kind: str = "ClusterRole") -> list[dict]:
    return [rule for o in objs if o["kind"] == kind for rule in o["rules"]]


def can_i(kubeconfig: Path, *args: str) -> bool:
    """`kubectl auth can-i` as the kubeconfig's identity."""
    out = kubectl(f"--kubeconfig={kubeconfig}", "auth", "can-i", *args, check=False)
    assert out.stdout.strip() in ("yes", "no"), out.stderr
    return out.stdout.strip() == "yes"
