"""The vLLM CPU engine image, by the development shortcut issue 13 allows: the lean base image, with the host's
vLLM environment mounted read-only at the same paths (hostPath volumes), instead of a 7 GB image per change.

The host's environment is a venv (`~/.cache/disagg/vllm-venv`, see vllm_env.py) whose python is a symlink into a
pyenv build (`/root/.pyenv/versions/3.11.7`): a pod mounts both, read-only, at their host paths. The image is the
base's layer with its own config (no BuildKit: nothing runs at build time, so the OCI writer does it in
milliseconds): `DISAGG_PYTHON` (what the operator's launch script execs) names the venv's python, and the venv's
bin/ leads PATH. The base holds every shared library that python, torch, vLLM and NIXL load (both are bookworm),
which `verify` proves by importing vllm and nixl in a chroot of the base with those mounts.

Images made this way run only on this machine (or one with the same paths); the label `io.disagg.host-mounts`
lists the paths a pod must mount.
"""
from __future__ import annotations

import configparser
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .. import vllm_env
from . import base, oci
from .artifact import Image, ensure_layout
from .cache import key_of

MOUNTS_LABEL = "io.disagg.host-mounts"
ENGINE_BASE = base.BaseSpec(packages=(*base.BaseSpec().packages, "g++"))
"""The engine's base: vLLM's CPU platform compiles small kernels with torch inductor when a request first needs them
(logprobs, vllm/v1/sample/ops/logprobs.py; top-k/top-p sampling), and inductor needs a C++ compiler, as vLLM's own
CPU image has. Without one the engine core dies on the first request that asks for logprobs."""


@dataclass(frozen=True)
class HostEnv:
    """The host's vLLM environment: the venv and the Python installation its interpreter links to."""
    venv: Path
    python_home: Path  # the installation prefix (pyvenv.cfg's home is its bin/)

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def mounts(self) -> tuple[Path, Path]:
        return (self.python_home, self.venv)


def host_env_of(venv: Path, pyvenv_cfg: str) -> HostEnv:
    """Read a venv's pyvenv.cfg: `home` is the bin/ of the Python it was made from."""
    cfg = configparser.ConfigParser()
    cfg.read_string("[venv]\n" + pyvenv_cfg)
    return HostEnv(venv, Path(cfg["venv"]["home"]).parent)


def host_env() -> HostEnv:
    venv = vllm_env.venv_dir()
    return host_env_of(venv, (venv / "pyvenv.cfg").read_text())


def run_config(env: HostEnv) -> oci.RunConfig:
    path = f"{env.venv}/bin:" + dict(base.BaseSpec().env)["PATH"]
    return oci.RunConfig(
        env=(f"PATH={path}", "LANG=C.UTF-8", f"VIRTUAL_ENV={env.venv}", f"DISAGG_PYTHON={env.python}"),
        cmd=(str(env.python), "-m", "vllm.entrypoints.openai.api_server", "--help"),
        labels={MOUNTS_LABEL: ",".join(str(m) for m in env.mounts)},
    )


def image(env: HostEnv | None = None, spec: base.BaseSpec | None = None) -> Image:
    env, spec = env or host_env(), spec or ENGINE_BASE
    run = run_config(env)
    return Image("vllm-cpu", key_of("engine", base.image(spec).key, vllm_env.RECIPE, run.env, run.cmd,
                                    dict(run.labels)))


def ensure(spec: base.BaseSpec | None = None, progress: bool = True) -> Image:
    spec = spec or ENGINE_BASE
    env = host_env()
    return ensure_layout(image(env, spec), lambda: base.layers(spec, progress), run_config(env))


def chroot_script(rootfs: Path, env: HostEnv, command: str) -> str:
    """A shell script for `unshare --mount`: a tmpfs over the rootfs' /root (so the cached rootfs gets no mount
    points), the host paths bound read-only at their own paths, /proc, /dev and /sys, then `command` in a chroot.
    The mounts live in the private namespace only and go with it."""
    lines = ["set -e", "mount --make-rprivate /", f"R={rootfs}", 'mount -t tmpfs tmpfs "$R/root"']
    for m in env.mounts:
        lines += [f'mkdir -p "$R{m}"', f'mount --bind "{m}" "$R{m}"', f'mount -o remount,bind,ro "$R{m}"']
    lines += ['mount -t proc proc "$R/proc"', 'mount --rbind /dev "$R/dev"', 'mount --rbind /sys "$R/sys"',
              'mkdir -p "$R/tmp"', 'mount -t tmpfs tmpfs "$R/tmp"',
              f'exec chroot "$R" /usr/bin/env -i {" ".join(run_config(env).env)} HOME=/root sh -c \'{command}\'']
    return "\n".join(lines)


VERIFY = ('$DISAGG_PYTHON -c "import vllm, nixl, torch; '
          'doubled = torch.compile(lambda x: x * 2, backend=\\"inductor\\")(torch.ones(3)); '
          'assert doubled.tolist() == [2.0, 2.0, 2.0], doubled; '
          'print(\\"vllm\\", vllm.__version__, \\"torch\\", torch.__version__, \\"nixl and inductor ok\\")"')


def verify(spec: base.BaseSpec | None = None, timeout: float = 300) -> str:
    """Import vllm, nixl and torch with the engine image's environment in a chroot of the base root filesystem
    with the host mounts, and compile a kernel with torch inductor: proof that the base holds every shared library
    they load and the compiler vLLM's CPU sampler needs. Returns the output."""
    rootfs = base.ensure_rootfs(spec or ENGINE_BASE)
    out = subprocess.run(["unshare", "--mount", "sh", "-c", chroot_script(rootfs, host_env(), VERIFY)],
                         capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"importing vLLM in the engine image's root filesystem failed (exit {out.returncode}):\n"
                           f"{out.stderr[-3000:]}")
    return out.stdout.strip()
