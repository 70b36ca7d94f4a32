"""The base image: what `python:3.11-slim-bookworm` gives the Dockerfile, made from Debian's own packages with
debootstrap (Docker Hub is out of reach here; deb.debian.org is not).

Bookworm's python3 is 3.11, like the official image's. Differences that matter to a Dockerfile are undone: `python`
and `pip` are on PATH (python-is-python3, python3-pip) and PEP 668's EXTERNALLY-MANAGED marker is removed, as the
official image (whose Python is not Debian's) has none. The extras are what vLLM's CPU build loads at run time
(libgomp1, libnuma1, numactl) and what pods' probes and people use (procps, ca-certificates).

The image trusts the CA certificates the host trusts beyond Debian's own: a second, small layer appends them to
/etc/ssl/certs/ca-certificates.crt (and keeps them in /usr/local/share/ca-certificates, so update-ca-certificates in
a derived image keeps them). Without it, a host whose egress goes through a TLS-intercepting proxy (this one does)
builds an image whose pip cannot reach PyPI: "certificate verify failed: self-signed certificate in certificate
chain". On a host with none, there is no such layer. The image's key includes them.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from . import oci
from .artifact import Image, ensure_layout
from .cache import images_dir, key_of, locked, replace_dir

# Bump when the steps below change what the root filesystem holds.
SCRIPT_VERSION = 1
MIRROR = "http://deb.debian.org/debian"


@dataclass(frozen=True)
class BaseSpec:
    suite: str = "bookworm"
    packages: tuple[str, ...] = (
        "python3", "python3-pip", "python-is-python3", "ca-certificates", "procps", "libgomp1", "libnuma1", "numactl",
    )
    # The official image's environment; LANG too, so Python's stdio is UTF-8 in the container.
    env: tuple[tuple[str, str], ...] = (
        ("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"),
        ("LANG", "C.UTF-8"),
    )

    @property
    def key(self) -> str:
        return key_of("base", self.suite, sorted(self.packages), SCRIPT_VERSION)

    def debootstrap_argv(self, target: Path) -> list[str]:
        return ["debootstrap", "--variant=minbase", f"--include={','.join(self.packages)}", self.suite, str(target),
                MIRROR]


def rootfs_dir(spec: BaseSpec) -> Path:
    return images_dir() / "rootfs" / f"base-{spec.key}"


def ensure_rootfs(spec: BaseSpec, progress: bool = True) -> Path:
    """The base root filesystem for `spec`, made with debootstrap unless cached; a few minutes cold."""
    final = rootfs_dir(spec)
    if (final / ".disagg-complete").exists():
        return final
    with locked(f"base-{spec.key}"):
        if (final / ".disagg-complete").exists():
            return final
        return _debootstrap(spec, final, progress)


def _debootstrap(spec: BaseSpec, final: Path, progress: bool) -> Path:
    debootstrap = shutil.which("debootstrap") or ("/usr/sbin/debootstrap" if Path("/usr/sbin/debootstrap").exists()
                                                  else None)
    if debootstrap is None:
        raise SystemExit("debootstrap is not installed: apt-get install debootstrap")
    if os.geteuid() != 0:
        raise SystemExit("debootstrap needs root (it chroots and creates device nodes)")
    staged = final.with_name(final.name + ".partial")
    if staged.exists():
        shutil.rmtree(staged)
    staged.parent.mkdir(parents=True, exist_ok=True)
    log = final.with_name(final.name + ".log")
    argv = spec.debootstrap_argv(staged)
    argv[0] = debootstrap
    start = time.monotonic()
    _say(progress, f"[base] debootstrap {spec.suite} ({len(spec.packages)} packages) into {staged}; log {log}")
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        last = start
        for line in proc.stdout:
            out.write(line)
            # debootstrap prints one `I: Retrieving|Validating|Unpacking|Configuring <pkg>` line per package and step:
            # show the phases, and the current step at most every 10 s.
            now = time.monotonic()
            phase = line.startswith(("I: Retrieving Release", "I: Resolving", "I: Installing core",
                                     "I: Unpacking the base", "I: Configuring the base", "I: Base system installed"))
            if line.startswith("I: ") and (phase or now - last >= 10):
                last = now
                _say(progress, f"[base] {now - start:4.0f}s {line[3:].strip()}")
    if proc.wait() != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-20:])
        raise SystemExit(f"[base] debootstrap failed (exit {proc.returncode}); log {log}:\n{tail}")
    finish_rootfs(staged)
    (staged / ".disagg-complete").write_text(spec.key)
    replace_dir(staged, final)
    _say(progress, f"[base] root filesystem ready in {time.monotonic() - start:.0f}s: {final}")
    return final


def finish_rootfs(root: Path) -> None:
    """What makes Debian's root filesystem behave like the official slim image for a Dockerfile, minus caches."""
    for marker in (root / "usr" / "lib").glob("python3*/EXTERNALLY-MANAGED"):
        marker.unlink()
    for junk in ("var/cache/apt/archives", "var/lib/apt/lists", "var/log"):
        d = root / junk
        if d.is_dir():
            for child in d.iterdir():
                if child.is_file() or child.is_symlink():
                    child.unlink()
    # debootstrap copies the host's resolver and name; the runtime supplies its own.
    for f in ("etc/resolv.conf", "etc/hostname"):
        p = root / f
        if p.is_file() or p.is_symlink():
            p.unlink()


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(msg, flush=True)


HOST_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
STOCK_CAS = Path("/usr/share/ca-certificates")  # where Debian's ca-certificates keeps the certificates it ships
_PEM = re.compile(r"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.S)


def pem_blocks(text: str) -> list[str]:
    """The certificates in a PEM text, each normalised (no blank or indented lines) so equal ones compare equal."""
    return ["\n".join(line.strip() for line in block.splitlines() if line.strip()) for block in _PEM.findall(text)]


def extra_cas(bundle: str, stock: list[str]) -> list[str]:
    """The certificates of `bundle` that are not among `stock`, in bundle order, once each (pure)."""
    known = {b for text in stock for b in pem_blocks(text)}
    out: list[str] = []
    for block in pem_blocks(bundle):
        if block not in known and block not in out:
            out.append(block)
    return out


def host_extra_cas() -> list[str]:
    if not HOST_BUNDLE.exists():
        return []
    stock = [p.read_text(errors="replace") for p in sorted(STOCK_CAS.rglob("*.crt"))] if STOCK_CAS.is_dir() else []
    return extra_cas(HOST_BUNDLE.read_text(errors="replace"), stock)


def cas_digest(cas: list[str]) -> str:
    return hashlib.sha256("\n".join(cas).encode()).hexdigest()[:16] if cas else ""


def ca_layer(spec: BaseSpec, cas: list[str], progress: bool = True) -> oci.Layer:
    """A layer with the base's CA bundle plus `cas`, and `cas` as local certificates."""
    digest = cas_digest(cas)
    path = images_dir() / "layers" / f"base-{spec.key}-ca-{digest}.tar"
    if path.exists():
        return oci.layer_of(path)
    rootfs = ensure_rootfs(spec, progress)
    staged = images_dir() / "rootfs" / f"ca-{spec.key}-{digest}"
    if staged.exists():
        shutil.rmtree(staged)
    (staged / "etc" / "ssl" / "certs").mkdir(parents=True, mode=0o755)
    local = staged / "usr" / "local" / "share" / "ca-certificates"
    local.mkdir(parents=True, mode=0o755)
    bundle = (rootfs / "etc" / "ssl" / "certs" / "ca-certificates.crt").read_text()
    (staged / "etc" / "ssl" / "certs" / "ca-certificates.crt").write_text(
        bundle.rstrip("\n") + "\n" + "".join(f"{c}\n" for c in cas))
    for i, cert in enumerate(cas):
        (local / f"disagg-host-{i}.crt").write_text(cert + "\n")
    for d in [staged, *(p for p in staged.rglob("*") if p.is_dir())]:
        d.chmod(0o755)
    _say(progress, f"[base] {len(cas)} CA certificate(s) the host trusts beyond Debian's go in a layer of their own")
    return oci.write_layer(staged, path)


def layers(spec: BaseSpec, progress: bool = True) -> list[oci.Layer]:
    """The base image's layers: the root filesystem, then the host's extra CAs if it has any."""
    cas = host_extra_cas()
    with locked(f"layers-{spec.key}"):  # the base and the engine image share them
        return [base_layer(spec, progress), *([ca_layer(spec, cas, progress)] if cas else [])]


# The official image's CMD; `python` and `pip` come from python-is-python3 and python3-pip.
RUN = oci.RunConfig(env=tuple(f"{k}={v}" for k, v in BaseSpec().env), cmd=("python3",))


def base_layer(spec: BaseSpec, progress: bool = True) -> oci.Layer:
    """The root filesystem as one layer tar, cached beside it (the base and the engine image share it)."""
    path = images_dir() / "layers" / f"base-{spec.key}.tar"
    if path.exists():
        return oci.layer_of(path)
    rootfs = ensure_rootfs(spec, progress)
    _say(progress, f"[base] writing the layer {path}")
    return oci.write_layer(rootfs, path)


def image(spec: BaseSpec | None = None) -> Image:
    spec = spec or BaseSpec()
    return Image("python", key_of(spec.key, RUN.env, RUN.cmd, cas_digest(host_extra_cas())))


def ensure(spec: BaseSpec | None = None, progress: bool = True) -> Image:
    spec = spec or BaseSpec()
    return ensure_layout(image(spec), lambda: layers(spec, progress), RUN)
