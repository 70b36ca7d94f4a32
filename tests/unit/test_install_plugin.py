"""`disagg install-plugin DIR`: the engine pods' init container copies disagg.connector into an emptyDir, and the
vLLM image (which has no disagg) imports it from there with PYTHONPATH=DIR."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from disagg.connector import install_plugin

DISAGG = Path(sys.executable).parent / "disagg"
SOURCE = Path(install_plugin.__file__).resolve().parent


def run_install(target: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(DISAGG), "install-plugin", str(target)], capture_output=True, text=True, cwd="/",
                          timeout=60)


def source_files() -> set[str]:
    """What an engine imports: the plugin, the wire contract and the rendezvous client, with their packages."""
    parts = [SOURCE / "plugin", SOURCE / "wire"]
    files = {str(p.relative_to(SOURCE)) for d in parts for p in d.rglob("*.py") if "__pycache__" not in p.parts}
    return files | {"__init__.py", "rendezvous/__init__.py", "rendezvous/client.py"}


def installed_files(target: Path) -> set[str]:
    root = target / "disagg" / "connector"
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def third_party_only(tmp_path_factory) -> Path:
    """A directory offering every third-party package of this environment (pydantic, aiohttp, ...) but no disagg:
    symlinks to site-packages entries, minus disagg's own and the .pth hooks of its editable install."""
    site = Path(sysconfig.get_paths()["purelib"])
    out = tmp_path_factory.mktemp("third-party")
    for entry in site.iterdir():
        name = entry.name.lower()
        if name.startswith(("disagg", "__editable__")) or name.endswith(".pth") or name == "__pycache__":
            continue
        (out / entry.name).symlink_to(entry)
    return out


VLLM_ENVIRONMENT = {"vllm", "torch", "msgspec", "nixl", "numpy"}
"""What engine images have and this test environment may not: the only imports the copy may miss here."""

# Imported in the engine-like interpreter below. Every module of the copy must import, except for what only
# vLLM's environment has (vllm itself, and its dependencies such as msgspec): never a missing disagg module.
PROBE = r"""
import importlib, json, pathlib, sys
target = pathlib.Path(sys.argv[1])
out = {"missing": {}, "files": {}}
import disagg
out["disagg_path"] = [str(p) for p in disagg.__path__]
root = target / "disagg" / "connector"
for f in sorted(root.rglob("*.py")):
    rel = f.relative_to(root).with_suffix("").parts
    name = ".".join(("disagg", "connector", *(rel[:-1] if rel[-1] == "__init__" else rel)))
    try:
        mod = importlib.import_module(name)
        out["files"][name] = mod.__file__
    except ModuleNotFoundError as e:
        out["missing"][name] = e.name
try:
    import disagg.operator
    out["operator"] = disagg.operator.__path__[0]
except ModuleNotFoundError:
    out["operator"] = None
out["loaded"] = {n: getattr(m, "__file__", None) for n, m in sys.modules.items() if n.split(".")[0] == "disagg"}
print(json.dumps(out))
"""


def test_the_copied_tree_alone_provides_disagg_connector(tmp_path, third_party_only):
    target = tmp_path / "opt-disagg"
    done = run_install(target)
    assert done.returncode == 0, done.stderr
    assert f"in {target}/disagg/connector" in done.stdout
    assert installed_files(target) == source_files(), "what engines import, nothing else"
    assert not (target / "disagg" / "connector" / "router").exists(), "the router never runs in an engine"
    assert not (target / "disagg" / "connector" / "rendezvous" / "server.py").exists()
    assert not (target / "disagg" / "__init__.py").exists(), "disagg must stay a namespace package"
    for f in (target / "disagg" / "connector").rglob("*"):
        assert f.stat().st_mode & 0o444 == 0o444, f"{f.name} readable by the engine container's user"

    # An interpreter like the engine's: no site (so no editable-install hook and no site-packages), cwd=/, the
    # third-party packages, and PYTHONPATH=<target> as the pod spec sets it.
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": f"{target}{os.pathsep}{third_party_only}",
           "PYTHONDONTWRITEBYTECODE": "1"}
    probe = subprocess.run([sys.executable, "-S", "-c", PROBE, str(target)], capture_output=True, text=True,
                           cwd="/", env=env, timeout=120)
    assert probe.returncode == 0, probe.stderr
    out = json.loads(probe.stdout)
    assert out["operator"] is None, "this interpreter must not have disagg installed"
    assert out["disagg_path"] == [str(target / "disagg")]
    assert {"disagg.connector.wire.advertisement", "disagg.connector.rendezvous.client",
            "disagg.connector.plugin.prewarm"} <= set(out["files"])
    assert out["missing"].get("disagg.connector.plugin.connectors") == "vllm", "only vLLM's own modules are missing"
    for name, file in out["loaded"].items():
        assert file is None or file.startswith(str(target)), f"{name} came from {file}, not the copy"
    for name, missing in out["missing"].items():
        assert missing.split(".")[0] in VLLM_ENVIRONMENT, f"{name} needs {missing}, which the copy lacks"


def test_rerunning_replaces_a_stale_tree_and_is_a_no_op_when_current(tmp_path):
    target = tmp_path / "opt-disagg"
    assert run_install(target).returncode == 0
    again = run_install(target)
    assert again.returncode == 0 and "already up to date" in again.stdout

    root = target / "disagg" / "connector"
    (root / "wire" / "advertisement.py").write_text("raise ImportError('stale')\n")
    (root / "removed_in_this_version.py").write_text("")
    (target / "disagg" / ".connector-new-leftover").mkdir()  # an interrupted earlier run
    fixed = run_install(target)
    assert fixed.returncode == 0 and "installed" in fixed.stdout
    assert installed_files(target) == source_files()
    assert (root / "wire" / "advertisement.py").read_bytes() == (SOURCE / "wire" / "advertisement.py").read_bytes()
    assert sorted(p.name for p in (target / "disagg").iterdir()) == ["connector"], "no staging leftovers"


def test_a_failed_copy_never_leaves_a_half_tree(tmp_path, monkeypatch):
    target = tmp_path / "opt-disagg"
    install_plugin.install(target)
    root = target / "disagg" / "connector"
    (root / "wire" / "advertisement.py").write_text("# the previous version\n")
    before = {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}

    copied = []
    real = install_plugin.shutil.copyfile

    def copy_then_fail(src, dst, *a, **kw):
        if len(copied) == 3:
            raise OSError(28, "No space left on device", str(dst))
        copied.append(dst)
        return real(src, dst, *a, **kw)

    monkeypatch.setattr(install_plugin.shutil, "copyfile", copy_then_fail)
    with pytest.raises(install_plugin.InstallError, match="No space left on device"):
        install_plugin.install(target)
    assert copied, "the copy had started"
    after = {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    assert after == before, "the previous tree is untouched"
    assert sorted(p.name for p in (target / "disagg").iterdir()) == ["connector"]


def test_an_unwritable_directory_fails_with_a_clear_message(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    done = run_install(blocker / "plugin")
    assert done.returncode != 0
    assert done.stderr.startswith("disagg install-plugin: cannot install the connector plugin into")
    assert str(blocker / "plugin") in done.stderr and "Not a directory" in done.stderr
    assert "Traceback" not in done.stderr

    if os.geteuid() == 0:
        return  # root writes through file modes; the case above covers the error path
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    done = run_install(locked)
    assert done.returncode != 0 and "Permission denied" in done.stderr and str(locked) in done.stderr
