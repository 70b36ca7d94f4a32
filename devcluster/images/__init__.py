"""Container images for the real node, built on this machine without a registry and imported into containerd.

- `base`: a `python:3.11-slim-bookworm` equivalent made by debootstrap from Debian's packages;
- `oci`: writes a root filesystem as an OCI image layout (one uncompressed layer), as `ctr images import` takes it;
- `sandbox`: the pause (sandbox) image, a tiny static Go program;
- `operator_image`: the project's Dockerfile built by BuildKit, its FROM served by the local base;
- `engine`: the vLLM CPU engine image (the base; the host's vLLM environment is mounted read-only);
- `containerd`: imports them, skipping what containerd already holds under the same input key.

`python -m disagg.devcluster.images build` builds all of them (cached by their inputs).
"""
from .catalog import build_all, ensure_images

__all__ = ["build_all", "ensure_images"]
