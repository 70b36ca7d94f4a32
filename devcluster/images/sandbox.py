"""The pod sandbox (pause) image: containerd needs one locally, and registry.k8s.io is out of reach. (The module is not
named pause.py: `pause/` is the Go program's folder, and a module beside a folder of the same name confuses mypy.)

The program (`pause/main.go`) is its own Go module with no dependencies, not a command in devcluster/gobuild: a file
there would change the build key of every control-plane binary and rebuild them all.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from . import oci
from .artifact import Image, ensure_layout
from .cache import images_dir, key_of, tree_digest

SOURCE = Path(__file__).resolve().parent / "pause"
# Kubernetes' own pause image runs as 65535 (nobody); the sandbox needs no privilege.
RUN = oci.RunConfig(entrypoint=("/pause",), user="65535:65535")


def _go_version() -> str:
    return subprocess.run(["go", "env", "GOVERSION"], capture_output=True, text=True, check=True).stdout.strip()


def image(go_version: str | None = None) -> Image:
    return Image("pause", key_of("pause", tree_digest(SOURCE, ["go.mod", "main.go"]), go_version or _go_version(),
                                 RUN.entrypoint, RUN.user))


def ensure(progress: bool = True) -> Image:
    img = image()
    if img.is_built():
        return img
    root = images_dir() / "rootfs" / f"pause-{img.key}"
    root.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, CGO_ENABLED="0", GOFLAGS="-buildvcs=false")
    out = subprocess.run(["go", "build", "-trimpath", "-ldflags", "-s -w", "-o", str(root / "pause"), "."],
                         cwd=SOURCE, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"[pause] go build failed (exit {out.returncode}):\n{out.stderr}")
    if progress:
        print(f"[pause] built {root / 'pause'}", flush=True)
    return ensure_layout(img, lambda: [oci.write_layer(root, images_dir() / "layers" / f"pause-{img.key}.tar")], RUN)
