"""The real node's images, built here (cached by their inputs) and run by a throwaway containerd: the operator
image from the Dockerfile (BuildKit) runs `disagg`, the base runs python and pip, the engine image imports vLLM and
NIXL from the host's environment mounted read-only, and the pause image holds until SIGTERM.

Cold, this builds everything (debootstrap about 2 minutes, BuildKit about as long); warm, it imports and runs.
Needs root (debootstrap, containerd) and the node binaries from `disagg cluster build`.
"""
from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator

import pytest

from disagg.devcluster import build
from disagg.devcluster.images import buildkit, catalog, containerd, engine
from disagg.devcluster.images.artifact import Image

pytestmark = [
    pytest.mark.image,
    pytest.mark.skipif(os.geteuid() != 0, reason="debootstrap and containerd need root"),
]


@pytest.fixture(scope="module")
def images() -> dict[str, Image]:
    missing = [b for b in ("containerd", "ctr", "containerd-shim-runc-v2", "runc")
               if not (build.bin_dir() / b).exists()]
    assert not missing, f"node binaries missing in {build.bin_dir()}: {missing}; run `disagg cluster build`"
    buildkit.tools_dir(build.bin_dir())  # buildkitd and buildctl, or a FileNotFoundError that says so
    return {img.name: img for img in catalog.build_all()}


@pytest.fixture(scope="module")
def ctr(images: dict[str, Image]) -> Iterator[containerd.Ctr]:
    with containerd.throwaway() as c:
        refs = containerd.import_images(c, list(images.values()))
        assert refs == {name: img.reference for name, img in images.items()}
        yield c


def run_ok(ctr: containerd.Ctr, image: str, *args: str, **kw) -> str:
    out = containerd.run_container(ctr, image, args, **kw)
    assert out.returncode == 0, f"{image} {args} exited {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
    return out.stdout


def test_every_image_is_in_containerd_under_its_key_and_the_stable_tag(ctr, images):
    present = ctr.images()
    for img in images.values():
        assert img.reference in present and img.stable in present
        assert img.reference == f"disagg.local/{img.name}:{img.key}" and img.stable.endswith(":dev")
    assert set(images) == {"python", "pause", "vllm-cpu", "disagg"}


def test_importing_again_imports_nothing(ctr, images, capsys):
    assert containerd.to_import(list(images.values()), ctr.images()) == []
    containerd.import_images(ctr, list(images.values()))
    assert "imported" not in capsys.readouterr().out


def test_operator_image_from_the_dockerfile_runs_disagg(ctr, images):
    ref = images["disagg"].stable
    top = run_ok(ctr, ref)  # ENTRYPOINT disagg, CMD --help
    assert "operator" in top and "render" in top and "install-plugin" in top
    # ctr's args replace the entrypoint too: name disagg again.
    assert "--peering" in run_ok(ctr, ref, "disagg", "operator", "--help")
    # The engine pods' init container, as the non-root user the Dockerfile sets (65532).
    out = run_ok(ctr, ref, "sh", "-c", "id -u && disagg install-plugin /tmp/opt-disagg && "
                 "ls /tmp/opt-disagg/disagg/connector/plugin/__init__.py")
    assert out.splitlines()[0] == "65532" and "plugin/__init__.py" in out


def test_base_image_runs_python_and_pip_like_the_official_one(ctr, images):
    out = run_ok(ctr, images["python"].stable, "sh", "-c",
                 "python --version && pip --version && python -c 'import ssl, sqlite3, ctypes; print(\"stdlib ok\")' "
                 "&& ! test -e /usr/lib/python3.11/EXTERNALLY-MANAGED && echo pep668-free")
    assert "Python 3.11" in out and "pip " in out and "stdlib ok" in out and "pep668-free" in out


def test_engine_image_imports_vllm_and_nixl_from_the_host_mounts(ctr, images):
    host = engine.host_env()
    mounts = [(m, m) for m in host.mounts]
    out = run_ok(ctr, images["vllm-cpu"].stable, "sh", "-c",
                 '"$DISAGG_PYTHON" -c "import vllm, nixl; print(vllm.__version__)"', mounts=mounts)
    assert out.strip().splitlines()[-1].startswith("0.32")


def test_pause_holds_until_sigterm_and_exits_0(ctr, images):
    name = f"pause-check-{os.getpid()}"
    proc = subprocess.Popen(ctr.argv("run", "--rm", "--runc-binary", str(build.bin_dir() / "runc"),
                                     images["pause"].stable, name), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while f"{name} " not in ctr.run("tasks", "ls") or "RUNNING" not in ctr.run("tasks", "ls"):
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "the pause task never ran"
            time.sleep(0.1)
        assert proc.poll() is None, "pause must keep running"
        ctr.run("tasks", "kill", "--signal", "SIGTERM", name)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
