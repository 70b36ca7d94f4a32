"""The container image (Dockerfile at the repository root), tested without a Docker engine.

No Docker engine runs here, so this tests what the image is made of: the wheel `pip wheel .` builds (the
Dockerfile's build stage does exactly that), installed into a fresh venv with its runtime dependencies only, must
start every entrypoint. The Dockerfile itself is checked for a slim base, no test extras, no vLLM, a non-root user
and `disagg` as the entrypoint.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = (REPO / "Dockerfile").read_text()
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())

pytestmark = pytest.mark.image


def run(*argv: str | Path, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout, **kw)
    assert out.returncode == 0, f"{' '.join(map(str, argv))} exited {out.returncode}:\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """bin/ of a fresh venv holding only the built wheel and its runtime dependencies."""
    tmp = tmp_path_factory.mktemp("image")
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check", "-q", "-w", tmp / "dist",
        REPO)
    (wheel,) = (tmp / "dist").glob("disagg-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "disagg/operator/launch.sh.j2" in names, "package data (the launch script template) is in the wheel"
    assert not [n for n in names if n.startswith("tests/") or "/tests/" in n]
    run(sys.executable, "-m", "venv", tmp / "venv")
    run(tmp / "venv" / "bin" / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check", wheel)
    return tmp / "venv" / "bin"


def test_entrypoints_start_from_the_installed_wheel(installed):
    disagg = installed / "disagg"
    top = run(disagg, "--help").stdout
    assert "operator" in top and "render" in top
    assert "--peering" in run(disagg, "operator", "--help").stdout
    assert "--file" in run(disagg, "render", "--help").stdout
    # Not just argparse: rendering an example imports the operator's builders and reads the packaged template.
    children = run(disagg, "render", "-f", REPO / "manifests" / "examples" / "qwen3-32b-p5en.yaml").stdout
    assert "kind: StatefulSet" in children and "name: qwen3-32b-prefill" in children


def test_install_plugin_copies_the_wheels_connector_package(installed, tmp_path):
    """The engine pods' init container: `disagg install-plugin` finds the package in the wheel's site-packages."""
    target = tmp_path / "opt-disagg"
    run(installed / "disagg", "install-plugin", target, cwd="/")
    site = Path(run(installed / "python", "-c", "import disagg.connector, os; "
                    "print(os.path.dirname(disagg.connector.__file__))", cwd="/").stdout.strip())
    assert str(site).startswith(str(installed.parent)), "the wheel's copy, not the checkout"
    copied = sorted(str(p.relative_to(target / "disagg" / "connector"))
                    for p in (target / "disagg" / "connector").rglob("*.py"))
    assert "wire/advertisement.py" in copied and "rendezvous/client.py" in copied and "plugin/__init__.py" in copied
    for rel in copied:
        assert (site / rel).read_bytes() == (target / "disagg" / "connector" / rel).read_bytes()
    assert sorted(p.name for p in (target / "disagg").iterdir()) == ["connector"]


def test_only_runtime_dependencies_are_installed(installed):
    listed = json.loads(run(installed / "python", "-m", "pip", "list", "--format=json").stdout)
    norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()  # noqa: E731  (PEP 503 names)
    names = {norm(p["name"]) for p in listed}
    assert "disagg" in names
    for absent in ("pytest", "pytest-timeout", "vllm", "torch"):
        assert absent not in names, f"{absent} must not be in the image"
    declared = {norm(re.split(r"[<>=!~\[ ]", d)[0]) for d in PYPROJECT["project"]["dependencies"]}
    assert declared <= names


def test_dockerfile_is_slim_runtime_only_non_root():
    bases = re.findall(r"^ARG PYTHON_IMAGE=(\S+)$", DOCKERFILE, re.M)
    assert bases and all("-slim" in b for b in bases), "a slim Python base"
    assert len(re.findall(r"^FROM ", DOCKERFILE, re.M)) == 2, "build stage + runtime stage"
    installs = [line for line in DOCKERFILE.splitlines() if "pip install" in line or "pip wheel" in line]
    assert installs and not any("[test]" in line or "vllm" in line.lower() for line in installs)
    assert re.search(r"^USER 65532:65532$", DOCKERFILE, re.M), "non-root, the uid the chart runs as"
    assert re.search(r'^ENTRYPOINT \["disagg"\]$', DOCKERFILE, re.M)


def test_dockerfile_copies_every_package_folder():
    """A package folder missing from the build context would build an image that fails at import time."""
    folders = set(PYPROJECT["tool"]["setuptools"]["package-dir"].values())
    copied = set(re.findall(r"^COPY (\w+)/ \1/$", DOCKERFILE, re.M))
    assert folders == copied
    ignore = [line for line in (REPO / ".dockerignore").read_text().splitlines() if line and line[0] != "#"]
    assert ignore[0] == "*", "the build context is an allow-list"
    for needed in (*folders, "pyproject.toml", "README.md"):
        assert f"!{needed}/" in ignore or f"!{needed}" in ignore, f".dockerignore excludes {needed}"
