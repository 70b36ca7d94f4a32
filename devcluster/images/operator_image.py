"""The operator image, built from the project's Dockerfile by BuildKit, its `FROM ${PYTHON_IMAGE}` served by the
local base image through a named context (`context:python:3.11-slim-bookworm=oci-layout://...`), so nothing comes
from Docker Hub. The RUN steps fetch the Python dependencies from PyPI.

The Dockerfile's `# syntax=docker/dockerfile:1` line would make BuildKit's builtin Dockerfile frontend forward the
build to the `docker/dockerfile:1` image from Docker Hub. The builtin frontend forwards only while the frontend
option `cmdline` is unset (frontend/dockerfile/builder/build.go: `if _, ok := opts["cmdline"]; !ok {...}`; a forwarded
frontend gets it set, which is how it knows not to forward again), so setting it keeps the build in the builtin
frontend and the Dockerfile unchanged for `docker build`.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from .. import build
from . import base, buildkit
from .artifact import Image
from .cache import images_dir, key_of, locked, tree_digest

REPO = Path(__file__).resolve().parents[2]
# Exactly what the Dockerfile copies (its .dockerignore lets in nothing else), and the Dockerfile itself.
CONTEXT = ("pyproject.toml", "README.md", "cli", "operator", "connector", "devcluster", "compare")
BUILD_FILES = ("Dockerfile", ".dockerignore")
# The Dockerfile's default PYTHON_IMAGE: the named context replaces it.
FROM = "python:3.11-slim-bookworm"


def image(spec: base.BaseSpec | None = None, repo: Path = REPO) -> Image:
    return Image("disagg", key_of("operator", tree_digest(repo, CONTEXT + BUILD_FILES), base.image(spec).key,
                                  build.BUILDKIT_VERSION))


def stage_context(repo: Path, dest: Path) -> Path:
    """A build context holding only what the Dockerfile copies, without caches (__pycache__, *.pyc)."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in CONTEXT + BUILD_FILES:
        src = repo / name
        if src.is_dir():
            shutil.copytree(src, dest / name, symlinks=True, ignore=ignore)
        else:
            shutil.copy2(src, dest / name)
    return dest


def frontend_opts(base_digest: str) -> list[str]:
    return [
        "filename=Dockerfile",
        f"context:{FROM}=oci-layout://base@{base_digest}",
        "cmdline=dockerfile.v0",  # keep the builtin frontend: see the module docstring
    ]


def ensure(spec: base.BaseSpec | None = None, progress: bool = True, bin_dir: Path | None = None,
           repo: Path = REPO) -> Image:
    img = image(spec, repo)
    if img.is_built():
        return img
    with locked("buildkit"):  # one buildkitd per cache: its root and socket are there
        if img.is_built():
            return img
        return _build(img, spec, progress, bin_dir, repo)


def _build(img: Image, spec: base.BaseSpec | None, progress: bool, bin_dir: Path | None, repo: Path) -> Image:
    if not (repo / "Dockerfile").exists():
        raise FileNotFoundError(f"no Dockerfile in {repo}: the operator image is built from a checkout")
    base_img = base.ensure(spec, progress)
    base_digest = _manifest_digest(base_img.layout)
    work = images_dir() / "work" / f"disagg-{img.key}"
    context = stage_context(repo, work / "context")
    img.tar.parent.mkdir(parents=True, exist_ok=True)
    partial = img.tar.with_name(img.tar.name + ".partial")
    start = time.monotonic()
    with buildkit.running(bin_dir) as daemon:
        if progress:
            print(f"[disagg] buildkitd up ({daemon.address}); building the Dockerfile", flush=True)
        argv = buildkit.build_argv(daemon, context, context, frontend_opts(base_digest),
                                   [f"base={base_img.layout}"], f"type=oci,dest={partial},name={img.reference}")
        buildkit.run_build(argv, "disagg", work / "build.log", progress)
    partial.rename(img.tar)
    shutil.rmtree(context)
    if progress:
        print(f"[disagg] built {img.reference} in {time.monotonic() - start:.0f}s: {img.tar}", flush=True)
    return img


def _manifest_digest(layout: Path) -> str:
    digest: str = json.loads((layout / "index.json").read_text())["manifests"][0]["digest"]
    return digest
