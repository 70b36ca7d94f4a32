"""Importing the images into containerd (namespace `k8s.io`, where the CRI plugin and so the kubelet look), and a
throwaway containerd to check them with.

An image is imported under `disagg.local/<name>:<input key>` unless containerd already holds that name: the key in
the tag is the cache check, and `ctr images ls` the whole query. Each is also tagged `disagg.local/<name>:dev`, the
stable name pods use with imagePullPolicy Never or IfNotPresent.
"""
from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .. import build
from ..cluster import ComponentFailed, Process
from .artifact import Image


@dataclass(frozen=True)
class Ctr:
    """`ctr` against one containerd and namespace."""
    binary: Path
    address: str
    namespace: str = "k8s.io"

    def argv(self, *args: str) -> list[str]:
        return [str(self.binary), "--address", self.address, "--namespace", self.namespace, *args]

    def run(self, *args: str, timeout: float = 600) -> str:
        out = subprocess.run(self.argv(*args), capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"ctr {' '.join(args)} failed (exit {out.returncode}): {out.stderr.strip()}")
        return out.stdout

    def images(self) -> set[str]:
        return set(self.run("images", "ls", "--quiet").split())


def to_import(wanted: Sequence[Image], present: set[str]) -> list[Image]:
    """The images containerd does not hold under their input key (pure)."""
    return [img for img in wanted if img.reference not in present]


def import_images(ctr: Ctr, images: Sequence[Image], progress: bool = True) -> dict[str, str]:
    """Import what is missing, tag every image with its stable name; return name -> keyed reference."""
    present = ctr.images()
    for img in to_import(images, present):
        start = time.monotonic()
        # --local: the client reads the tar (the transfer service would need it streamed); unpacked into
        # overlayfs, the CRI plugin's snapshotter, so a pod starts without unpacking.
        ctr.run("images", "import", "--local", "--snapshotter", "overlayfs", str(img.tar))
        if progress:
            print(f"[containerd] imported {img.reference} in {time.monotonic() - start:.1f}s", flush=True)
    for img in images:
        ctr.run("images", "tag", "--force", img.reference, img.stable)
    return {img.name: img.reference for img in images}


def config_toml(root: Path, runc: Path) -> str:
    """containerd config version 3 with everything under `root` (the settings real-node.md found necessary)."""
    return f"""version = 3
root = '{root}/root'
state = '{root}/state'

[grpc]
  address = '{root}/containerd.sock'

[ttrpc]
  address = '{root}/containerd.sock.ttrpc'

[plugins.'io.containerd.cri.v1.images']
  snapshotter = 'overlayfs'

[plugins.'io.containerd.cri.v1.runtime']
  restrict_oom_score_adj = true

[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
  runtime_type = 'io.containerd.runc.v2'

[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
  BinaryName = '{runc}'
  SystemdCgroup = false
"""


@contextmanager
def throwaway(bin_dir: Path | None = None, startup_timeout: float = 60) -> Iterator[Ctr]:
    """A containerd of our own, with its root, state and sockets in a temporary directory, for the block."""
    bin_dir = bin_dir or build.bin_dir()
    with tempfile.TemporaryDirectory(prefix="disagg-containerd-") as tmp:
        root = Path(tmp)
        (root / "config.toml").write_text(config_toml(root, bin_dir / "runc"))
        sock = root / "containerd.sock"
        # The shim (containerd-shim-runc-v2) must be on containerd's PATH.
        env = dict(os.environ, PATH=f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}")
        proc = Process("containerd", [str(bin_dir / "containerd"), "--config", str(root / "config.toml")],
                       root / "containerd.log", env=env).start()
        ctr = Ctr(bin_dir / "ctr", str(sock))
        try:
            deadline = time.monotonic() + startup_timeout
            while True:
                code = proc.exited()
                if code is not None:
                    raise ComponentFailed("containerd", f"exited with code {code}", proc.log)
                if sock.exists() and subprocess.run(ctr.argv("version"), capture_output=True).returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise ComponentFailed("containerd", f"not serving after {startup_timeout:.0f}s", proc.log)
                time.sleep(0.1)
            yield ctr
        finally:
            proc.stop(grace=20)
            # Unpacked layers are overlayfs snapshots; a stopped containerd leaves no mounts, only files.
            subprocess.run(["rm", "-rf", str(root / "root")], check=False)


def run_container(ctr: Ctr, image: str, args: Sequence[str] = (), runc: Path | None = None,
                  mounts: Sequence[tuple[Path, Path]] = (), env: Sequence[str] = (), timeout: float = 300,
                  name: str | None = None) -> subprocess.CompletedProcess[str]:
    """`ctr run --rm` of `image`, read-only bind `mounts` (host, container); returns the finished process (its exit
    code and output). Non-empty `args` replace the image's entrypoint and command alike (ctr's rule, not Docker's)."""
    runc = runc or build.bin_dir() / "runc"
    argv = ["run", "--rm", "--runc-binary", str(runc), "--snapshotter", "overlayfs"]
    for host, inside in mounts:
        argv += ["--mount", f"type=bind,src={host},dst={inside},options=rbind:ro"]
    for e in env:
        argv += ["--env", e]
    argv += [image, name or f"disagg-check-{os.getpid()}-{time.monotonic_ns()}", *args]
    return subprocess.run(ctr.argv(*argv), capture_output=True, text=True, timeout=timeout)
