"""BuildKit (buildkitd and buildctl, built from Go modules by `disagg cluster build`) run as a child for one build.

buildkitd runs its OCI worker with our runc (cgo, seccomp) and host networking, so the Dockerfile's RUN steps reach
PyPI; its root and socket live under the images cache, and it stops when the build is done (and dies with us).
"""
from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .. import build
from ..cluster import ComponentFailed, Process
from .cache import images_dir


@dataclass(frozen=True)
class Daemon:
    address: str
    buildctl: Path
    log: Path


def tools_dir(bin_dir: Path) -> Path:
    """The directory holding buildkitd and buildctl (the node's bin directory), or a FileNotFoundError."""
    missing = [b for b in ("buildkitd", "buildctl") if not (bin_dir / b).exists()]
    if missing:
        raise FileNotFoundError(f"{' and '.join(missing)} missing in {bin_dir}: run `disagg cluster build`")
    return bin_dir


def daemon_argv(bin_dir: Path, root: Path, address: str) -> list[str]:
    return [
        str(tools_dir(bin_dir) / "buildkitd"), "--root", str(root), "--addr", address,
        "--oci-worker=true", "--containerd-worker=false",
        "--oci-worker-binary", str(bin_dir / "runc"), "--oci-worker-net", "host",
        "--oci-worker-snapshotter", "overlayfs",
        # No /etc/buildkit/buildkitd.toml of the host's: everything is on the command line.
        "--config", "/dev/null",
    ]


@contextmanager
def running(bin_dir: Path | None = None, startup_timeout: float = 60) -> Iterator[Daemon]:
    """A buildkitd for the duration of the block."""
    bin_dir = bin_dir or build.bin_dir()
    if not (bin_dir / "runc").exists():
        raise FileNotFoundError(f"runc is missing in {bin_dir}: run `disagg cluster build`")
    buildctl = tools_dir(bin_dir) / "buildctl"
    home = images_dir() / "buildkit"
    (home / "root").mkdir(parents=True, exist_ok=True)
    sock = home / "buildkitd.sock"
    sock.unlink(missing_ok=True)
    address = f"unix://{sock}"
    log = home / "buildkitd.log"
    log.write_text("")
    proc = Process("buildkitd", daemon_argv(bin_dir, home / "root", address), log).start()
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            code = proc.exited()
            if code is not None:
                raise ComponentFailed("buildkitd", f"exited with code {code}", log)
            ok = sock.exists() and subprocess.run(
                [str(buildctl), "--addr", address, "debug", "workers"], capture_output=True,
                timeout=10).returncode == 0
            if ok:
                break
            if time.monotonic() > deadline:
                raise ComponentFailed("buildkitd", f"no worker after {startup_timeout:.0f}s", log)
            time.sleep(0.2)
        yield Daemon(address, buildctl, log)
    finally:
        proc.stop(grace=20)


def build_argv(daemon: Daemon, context: Path, dockerfile_dir: Path, opts: Sequence[str], oci_layouts: Sequence[str],
               output: str) -> list[str]:
    argv = [str(daemon.buildctl), "--addr", daemon.address, "build", "--progress", "plain",
            "--frontend", "dockerfile.v0", "--local", f"context={context}", "--local", f"dockerfile={dockerfile_dir}",
            "--output", output]
    for o in opts:
        argv += ["--opt", o]
    for layout in oci_layouts:
        argv += ["--oci-layout", layout]
    return argv


# `--progress plain` starts each step with `#N [stage n/m] INSTRUCTION` (or `#N [internal] ...`) and then prints
# its output under `#N`; the step lines are the progress worth showing.
_STEP = re.compile(r"#\d+ \[|#\d+ exporting|#\d+ (DONE|CACHED)")


def run_build(argv: list[str], label: str, log: Path, progress: bool = True) -> None:
    """Run buildctl, printing the steps as they start (`#N [stage n/m] ...`) and errors; the rest goes to `log`."""
    start = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            out.flush()
            text = line.rstrip()
            if progress and (_STEP.match(text) or "ERROR" in text or text.startswith("error")):
                print(f"[{label}] {time.monotonic() - start:4.0f}s {text}", flush=True)
    if proc.wait() != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-30:])
        raise RuntimeError(f"[{label}] buildctl failed (exit {proc.returncode}); log {log}:\n{tail}")
