"""A built image as the cache holds it: an OCI layout directory (BuildKit reads it as a named context) and the same
layout as a tar (what `ctr images import` reads), both named by the image's input key."""
from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import oci
from .cache import images_dir, locked

REGISTRY = "disagg.local"
# Every image also gets this tag in containerd: the name manifests and pods use (imagePullPolicy Never/IfNotPresent).
STABLE_TAG = "dev"


@dataclass(frozen=True)
class Image:
    """One image: `reference` is `disagg.local/<name>:<key>`, `stable` the same image tagged `dev`."""
    name: str
    key: str

    @property
    def repository(self) -> str:
        return f"{REGISTRY}/{self.name}"

    @property
    def reference(self) -> str:
        return f"{self.repository}:{self.key}"

    @property
    def stable(self) -> str:
        return f"{self.repository}:{STABLE_TAG}"

    @property
    def layout(self) -> Path:
        return images_dir() / "oci" / f"{self.name}-{self.key}"

    @property
    def tar(self) -> Path:
        return images_dir() / "oci" / f"{self.name}-{self.key}.tar"

    def is_built(self) -> bool:
        return self.tar.exists()


def ensure_layout(image: Image, layers: Callable[[], list[oci.Layer]], run: oci.RunConfig) -> Image:
    """Write `image`'s layout and tar from the layers `layers()` returns, unless both are cached."""
    if image.tar.exists() and (image.layout / "index.json").exists():
        return image
    with locked(f"oci-{image.name}-{image.key}"):
        if not (image.tar.exists() and (image.layout / "index.json").exists()):
            _write(image, layers, run)
    return image


def _write(image: Image, layers: Callable[[], list[oci.Layer]], run: oci.RunConfig) -> None:
    staged = image.layout.with_name(image.layout.name + ".partial")
    oci.write_layout(staged, image.reference, layers(), run)
    if image.layout.exists():
        shutil.rmtree(image.layout)
    staged.rename(image.layout)
    oci.pack(image.layout, image.tar)
