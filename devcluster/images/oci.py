"""An OCI image layout writer (image-spec v1.1): a root filesystem becomes one uncompressed layer, plus a config and
a manifest, in a layout directory or tar that `ctr images import` and BuildKit's `oci-layout://` contexts read.

Only the stdlib: `tarfile` keeps modes, numeric owners, symlinks and hard links (it links a second path to an
inode it has already written), `hashlib` gives the digests. crane or umoci would add a Go build for what this
does in a hundred lines (real-node.md: a short script was enough for containerd).

The JSON documents are built by pure functions (`image_config`, `manifest`, `index`); writing is separate.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
CONFIG = "application/vnd.oci.image.config.v1+json"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
INDEX = "application/vnd.oci.image.index.v1+json"
# containerd's importer names the image after this annotation (real-node.md); BuildKit's oci-layout store looks
# manifests up by the standard ref.name.
CONTAINERD_NAME = "io.containerd.image.name"
REF_NAME = "org.opencontainers.image.ref.name"
# Never part of an image: the runtime mounts them. The marker is the cache's own.
SKIPPED_CONTENT = ("dev", "proc", "sys")
SKIPPED_FILES = (".disagg-complete",)


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str  # sha256:<hex>
    size: int
    annotations: Mapping[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"mediaType": self.media_type, "digest": self.digest, "size": self.size}
        if self.annotations:
            d["annotations"] = dict(self.annotations)
        return d


@dataclass(frozen=True)
class Layer:
    """An uncompressed layer tar on disk: its digest is also its diff ID."""
    path: Path
    digest: str
    size: int

    @property
    def descriptor(self) -> Descriptor:
        return Descriptor(LAYER_TAR, self.digest, self.size)


@dataclass(frozen=True)
class RunConfig:
    """The parts of an image config a runtime uses (image-spec `config`)."""
    env: Sequence[str] = ()
    entrypoint: Sequence[str] = ()
    cmd: Sequence[str] = ()
    user: str = ""
    working_dir: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)


class _HashingWriter:
    """A write-only file that hashes and counts what passes through it to the real file."""

    def __init__(self, out: BinaryIO):
        self.out, self.sha, self.size = out, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.out.write(data)


def _walk(root: Path) -> Iterable[tuple[str, Path]]:
    """(archive name, path) for everything under root, parents first, in a stable order."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        here = Path(dirpath)
        rel = here.relative_to(root).as_posix()
        if rel in SKIPPED_CONTENT:
            dirnames[:] = []
            filenames = []
        for name in sorted(dirnames + filenames):
            arc = name if rel == "." else f"{rel}/{name}"
            if arc in SKIPPED_FILES:
                continue
            yield arc, here / name


def _anonymous(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """Numeric owners only: the host's user names mean nothing in the image."""
    info.uname = info.gname = ""
    return info


def write_layer(rootfs: Path, dest: Path) -> Layer:
    """The whole of `rootfs` as one uncompressed layer tar at `dest` (PAX, so long names and big files fit)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".partial")
    with tmp.open("wb") as raw:
        out = _HashingWriter(raw)
        with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
            for arc, path in _walk(rootfs):
                tar.add(path, arcname=arc, recursive=False, filter=_anonymous)
    tmp.rename(dest)
    return Layer(dest, f"sha256:{out.sha.hexdigest()}", out.size)


def layer_of(path: Path) -> Layer:
    """A Layer for a layer tar already on disk."""
    sha = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
    return Layer(path, f"sha256:{sha.hexdigest()}", path.stat().st_size)


def image_config(run: RunConfig, diff_ids: Sequence[str], created: str = "1970-01-01T00:00:00Z",
                 architecture: str = "amd64") -> dict[str, Any]:
    config: dict[str, Any] = {}
    if run.env:
        config["Env"] = list(run.env)
    if run.entrypoint:
        config["Entrypoint"] = list(run.entrypoint)
    if run.cmd:
        config["Cmd"] = list(run.cmd)
    if run.user:
        config["User"] = run.user
    if run.working_dir:
        config["WorkingDir"] = run.working_dir
    if run.labels:
        config["Labels"] = dict(run.labels)
    return {
        "created": created,
        "architecture": architecture,
        "os": "linux",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": list(diff_ids)},
        "history": [{"created": created, "created_by": "disagg.devcluster.images.oci"} for _ in diff_ids],
    }


def manifest(config: Descriptor, layers: Sequence[Descriptor],
             annotations: Mapping[str, str] | None = None) -> dict[str, Any]:
    m: dict[str, Any] = {"schemaVersion": 2, "mediaType": MANIFEST, "config": config.to_json(),
                         "layers": [d.to_json() for d in layers]}
    if annotations:
        m["annotations"] = dict(annotations)
    return m


def index(manifest_desc: Descriptor) -> dict[str, Any]:
    return {"schemaVersion": 2, "mediaType": INDEX, "manifests": [manifest_desc.to_json()]}


def name_annotations(reference: str) -> dict[str, str]:
    """containerd's name for the image, and the tag BuildKit's `oci-layout://<store>:<tag>` finds it by."""
    tag = reference.rsplit(":", 1)[1] if ":" in reference.rsplit("/", 1)[-1] else "latest"
    return {CONTAINERD_NAME: reference, REF_NAME: tag}


def canonical(doc: Mapping[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def descriptor_of(media_type: str, blob: bytes, annotations: Mapping[str, str] | None = None) -> Descriptor:
    return Descriptor(media_type, f"sha256:{hashlib.sha256(blob).hexdigest()}", len(blob), annotations or {})


def write_layout(dest: Path, reference: str, layers: Sequence[Layer], run: RunConfig) -> Descriptor:
    """An OCI layout directory at `dest` holding one image named `reference`; returns its manifest's descriptor.
    Layer blobs are hard-linked from their tars when they are on the same filesystem (they are large)."""
    if dest.exists():
        shutil.rmtree(dest)
    blobs = dest / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    for layer in layers:
        target = blobs / layer.digest.split(":", 1)[1]
        try:
            os.link(layer.path, target)
        except OSError:
            shutil.copyfile(layer.path, target)
    cfg = canonical(image_config(run, [layer.digest for layer in layers]))
    cfg_desc = descriptor_of(CONFIG, cfg)
    man = canonical(manifest(cfg_desc, [layer.descriptor for layer in layers]))
    man_desc = descriptor_of(MANIFEST, man, name_annotations(reference))
    for desc, blob in ((cfg_desc, cfg), (man_desc, man)):
        (blobs / desc.digest.split(":", 1)[1]).write_bytes(blob)
    (dest / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    (dest / "index.json").write_bytes(canonical(index(man_desc)))
    return man_desc


def pack(layout: Path, dest: Path) -> Path:
    """The layout directory as a tar (what `ctr images import` reads), index.json and oci-layout first."""
    tmp = dest.with_name(dest.name + ".partial")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        for name in ("oci-layout", "index.json"):
            tar.add(layout / name, arcname=name, filter=_anonymous)
        tar.add(layout / "blobs", arcname="blobs", filter=_anonymous)
    tmp.rename(dest)
    return dest
