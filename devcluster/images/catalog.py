"""Every image the real node needs, built (cached) in order, and `ensure_images`, which also imports them."""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from . import base, containerd, engine, operator_image, sandbox
from .artifact import Image

# name -> builder; the base comes first: the operator image's FROM and the engine's layer are made from it.
BUILDERS: dict[str, Callable[[bool], Image]] = {
    "python": lambda progress: base.ensure(progress=progress),
    "pause": lambda progress: sandbox.ensure(progress=progress),
    "vllm-cpu": lambda progress: engine.ensure(progress=progress),
    "disagg": lambda progress: operator_image.ensure(progress=progress),
}


def planned() -> list[Image]:
    """The images with their current input keys, without building anything."""
    return [base.image(), sandbox.image(), engine.image(), operator_image.image()]


def build_all(names: list[str] | None = None, progress: bool = True) -> list[Image]:
    out = []
    for name, builder in BUILDERS.items():
        if names and name not in names:
            continue
        start = time.monotonic()
        img = builder(progress)
        if progress:
            print(f"[images] {img.reference} ready ({time.monotonic() - start:.1f}s; {img.tar})", flush=True)
        out.append(img)
    return out


def ensure_images(ctr_binary: Path | str, containerd_address: str, namespace: str = "k8s.io",
                  names: list[str] | None = None, progress: bool = True) -> dict[str, str]:
    """Build what is stale, import into containerd what it lacks under the current input key, and tag each
    `disagg.local/<name>:dev`. Returns image name -> keyed reference (`disagg.local/disagg:<key>`)."""
    images = build_all(names, progress)
    return containerd.import_images(containerd.Ctr(Path(ctr_binary), containerd_address, namespace), images, progress)
