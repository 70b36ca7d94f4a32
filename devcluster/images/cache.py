"""Where the images and their parts are cached, and the input keys they are cached by (pure, apart from reading
the files a key covers)."""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from .. import build


def images_dir() -> Path:
    """$DISAGG_CACHE/images: base root filesystems, OCI layout tars, the pause binary, BuildKit's state."""
    return build.cache_dir() / "images"


def key_of(*parts: object) -> str:
    """A short stable hash of JSON-serialisable parts: the cache key of anything built from them."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def tree_digest(root: Path, paths: Iterable[str]) -> str:
    """A hash over the files under `root/<path>` for each path (a file or a folder, walked in sorted order): names,
    executable bits and contents, skipping __pycache__ and *.pyc as .dockerignore does."""
    h = hashlib.sha256()
    for top in paths:
        base = root / top
        files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file() or p.is_symlink())
        for f in files:
            rel = f.relative_to(root).as_posix()
            if "__pycache__" in f.parts or rel.endswith(".pyc"):
                continue
            h.update(rel.encode() + b"\0")
            if f.is_symlink():
                h.update(b"L" + os.readlink(f).encode())
            else:
                h.update(b"X" if os.access(f, os.X_OK) else b"F")
                h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:16]


def replace_dir(staged: Path, final: Path) -> None:
    """Move a fully built `staged` directory into place, so a half-built one is never taken for a cached one."""
    if final.exists():
        shutil.rmtree(final)
    staged.rename(final)


@contextmanager
def locked(name: str) -> Iterator[None]:
    """An exclusive lock on `images/<name>.lock` for the block: worktrees share the cache, and two debootstraps into
    one directory, or two buildkitds on one socket, would break each other. Callers check the cache again inside."""
    path = images_dir() / f"{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
