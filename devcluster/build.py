"""Build and cache the control-plane binaries from Go modules.

Every binary is keyed by a hash of what it is built from (module versions, go.mod/go.sum, ldflags, Go
version), so a warm run is a few stat calls and a cold run builds only what changed. Progress is reported
per component as packages compiled out of packages needed, because a cold build takes many minutes.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

KUBE_VERSION = "v1.36.3"
KWOK_VERSION = "v0.8.0"
HELM_VERSION = "v3.21.4"
ETCD_VERSION = "v3.6.8"  # whatever k8s.io/kubernetes requires; see gobuild/go.mod
# The real node's parts (devcluster/node): container runtime, OCI runtime, CNI plugins, DNS, image builder.
CONTAINERD_VERSION = "v2.4.2"
RUNC_VERSION = "v1.5.3"
CNI_PLUGINS_VERSION = "v1.10.0"
COREDNS_VERSION = "v1.15.0"
BUILDKIT_VERSION = "v0.34.2"
KEDA_VERSION = "v2.21.0"  # devcluster/gobuild-keda/go.mod requires it

GOBUILD_DIR = Path(__file__).resolve().parent / "gobuild"
BUILDKIT_DIR = Path(__file__).resolve().parent / "gobuild-buildkit"
KEDA_DIR = Path(__file__).resolve().parent / "gobuild-keda"
PROMETHEUS_DIR = Path(__file__).resolve().parent / "gobuild-prometheus"  # its go.mod pins Prometheus 3.16


def cache_dir() -> Path:
    return Path(os.environ.get("DISAGG_CACHE", Path.home() / ".cache" / "disagg"))


def bin_dir() -> Path:
    return cache_dir() / "bin"


def _kube_ldflags() -> str:
    major, minor = KUBE_VERSION.lstrip("v").split(".")[:2]
    flags = []
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [
            f"-X {pkg}.gitVersion={KUBE_VERSION}",
            f"-X {pkg}.gitMajor={major}",
            f"-X {pkg}.gitMinor={minor}",
            f"-X {pkg}.gitTreeState=clean",
        ]
    return "-s -w " + " ".join(flags)


def _helm_ldflags() -> str:
    major, minor = KUBE_VERSION.lstrip("v").split(".")[:2]
    flags = [f"-X helm.sh/helm/v3/internal/version.version={HELM_VERSION}"]
    for pkg in ("helm.sh/helm/v3/pkg/lint/rules", "helm.sh/helm/v3/pkg/chartutil"):
        flags += [f"-X {pkg}.k8sVersionMajor={major}", f"-X {pkg}.k8sVersionMinor={minor}"]
    return "-s -w " + " ".join(flags)


@dataclass(frozen=True)
class Binary:
    name: str
    package: str  # import path, or path@version for `go install`
    ldflags: str = "-s -w"
    in_wrapper: bool = True  # built inside a wrapper module (shares its module graph) or via `go install pkg@ver`
    cgo: bool = False
    wrapper: Path = GOBUILD_DIR
    tags: str = ""
    inputs: tuple[str, ...] = field(default=())


def binaries() -> list[Binary]:
    kube = _kube_ldflags()
    return [
        Binary("kube-apiserver", "k8s.io/kubernetes/cmd/kube-apiserver", kube),
        Binary("kube-controller-manager", "k8s.io/kubernetes/cmd/kube-controller-manager", kube),
        Binary("kube-scheduler", "k8s.io/kubernetes/cmd/kube-scheduler", kube),
        Binary("kubectl", "k8s.io/kubernetes/cmd/kubectl", kube),
        Binary("etcd", "./cmd/etcd", f"-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA={ETCD_VERSION}"),
        Binary("kwok", f"sigs.k8s.io/kwok/cmd/kwok@{KWOK_VERSION}", in_wrapper=False),
        Binary("helm", f"helm.sh/helm/v3/cmd/helm@{HELM_VERSION}", _helm_ldflags(), in_wrapper=False),
        *node_binaries(),
    ]


def node_binaries() -> list[Binary]:
    """What the real node runs. The containerd shim must sit on containerd's PATH (the bin directory);
    runc needs cgo and the seccomp tag (libseccomp-dev), or every container with a seccomp profile fails."""
    kube = _kube_ldflags()
    ctrd = "github.com/containerd/containerd/v2"
    ctrd_ld = f"-s -w -X {ctrd}/version.Version={CONTAINERD_VERSION}"
    cni = "github.com/containernetworking/plugins/plugins"
    return [
        Binary("kubelet", "k8s.io/kubernetes/cmd/kubelet", kube),
        Binary("kube-proxy", "k8s.io/kubernetes/cmd/kube-proxy", kube),
        Binary("containerd", f"{ctrd}/cmd/containerd@{CONTAINERD_VERSION}", ctrd_ld, in_wrapper=False),
        Binary("ctr", f"{ctrd}/cmd/ctr@{CONTAINERD_VERSION}", ctrd_ld, in_wrapper=False),
        Binary("containerd-shim-runc-v2", f"{ctrd}/cmd/containerd-shim-runc-v2@{CONTAINERD_VERSION}", ctrd_ld,
               in_wrapper=False),
        Binary("runc", f"github.com/opencontainers/runc@{RUNC_VERSION}",
               f"-s -w -X main.version={RUNC_VERSION.lstrip('v')}", in_wrapper=False, cgo=True, tags="seccomp"),
        *(Binary(name, f"{cni}/{kind}/{name}@{CNI_PLUGINS_VERSION}", in_wrapper=False)
          for kind, name in (("main", "bridge"), ("main", "loopback"), ("ipam", "host-local"),
                             ("meta", "portmap"))),
        Binary("coredns", f"github.com/coredns/coredns@{COREDNS_VERSION}", in_wrapper=False),
        # In a wrapper module of its own: BuildKit's go.mod has excludes, which `go install pkg@version` refuses.
        Binary("buildkitd", "github.com/moby/buildkit/cmd/buildkitd", wrapper=BUILDKIT_DIR),
        Binary("buildctl", "github.com/moby/buildkit/cmd/buildctl", wrapper=BUILDKIT_DIR),
    ]


def addon_binaries() -> list[Binary]:
    """Built only when named (`disagg cluster build keda-operator keda-adapter prometheus promtool`, or a test that runs
    them): what a user may run beside the product, not what the control plane needs."""
    keda = "github.com/kedacore/keda/v2"
    ld = f"-s -w -X {keda}/version.Version={KEDA_VERSION.lstrip('v')}"
    return [Binary("keda-operator", f"{keda}/cmd/operator", ld, wrapper=KEDA_DIR),
            Binary("keda-adapter", f"{keda}/cmd/adapter", ld, wrapper=KEDA_DIR),
            Binary("prometheus", "github.com/prometheus/prometheus/cmd/prometheus", wrapper=PROMETHEUS_DIR),
            Binary("promtool", "github.com/prometheus/prometheus/cmd/promtool", wrapper=PROMETHEUS_DIR)]


def _go_version() -> str:
    return subprocess.run(["go", "env", "GOVERSION"], capture_output=True, text=True, check=True).stdout.strip()


def _key(b: Binary, go_version: str) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([b.name, b.package, b.ldflags, b.cgo, b.tags, go_version]).encode())
    if b.in_wrapper:
        for f in sorted(b.wrapper.rglob("*")):
            if f.is_file():
                h.update(f.relative_to(b.wrapper).as_posix().encode())
                h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _stamp(b: Binary) -> Path:
    return bin_dir() / f".{b.name}.key"


def is_current(b: Binary, go_version: str) -> bool:
    return (bin_dir() / b.name).exists() and _stamp(b).exists() and _stamp(b).read_text() == _key(b, go_version)


def _env(b: Binary) -> dict[str, str]:
    env = dict(os.environ)
    env["CGO_ENABLED"] = "1" if b.cgo else "0"
    env.setdefault("GOFLAGS", "-buildvcs=false")
    return env


def _count_deps(b: Binary) -> int:
    """How many packages the binary needs, stdlib included (-trimpath rebuilds it): the progress denominator."""
    if b.in_wrapper:
        cmd, cwd = ["go", "list", "-deps", "-f", "x", b.package], b.wrapper
    else:
        # `go list` cannot take pkg@version; the count is only for progress, so estimate after download.
        return 0
    out = subprocess.run(cmd, cwd=cwd, env=_env(b), capture_output=True, text=True)
    return out.stdout.count("x") if out.returncode == 0 else 0


def build_one(b: Binary, index: int, total: int, go_version: str) -> None:
    out = bin_dir() / b.name
    label = f"[{index}/{total} {b.name}]"
    needed = _count_deps(b)
    if b.in_wrapper:
        cmd = ["go", "build", "-v", "-trimpath", "-ldflags", b.ldflags, "-o", str(out), b.package]
        cwd = b.wrapper
    else:
        cmd = ["go", "install", "-v", "-trimpath", "-ldflags", b.ldflags, b.package]
        cwd = cache_dir()
    if b.tags:
        cmd[3:3] = ["-tags", b.tags]
    env = _env(b)
    if not b.in_wrapper:
        env["GOBIN"] = str(bin_dir())
    print(f"{label} building {b.package}" + (f" ({needed} packages)" if needed else ""), flush=True)
    start = last = time.monotonic()
    compiled = 0
    log_lines: list[str] = []
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        log_lines.append(line)
        if line.startswith("go: downloading"):
            continue
        compiled += 1
        now = time.monotonic()
        if now - last >= 15:
            last = now
            pct = f" ({min(99, 100 * compiled // needed)}%)" if needed else ""
            print(f"{label} compiled {compiled}{'/' + str(needed) if needed else ''} packages{pct}, "
                  f"{now - start:.0f}s", flush=True)
    if proc.wait() != 0:
        sys.stderr.write("".join(log_lines[-60:]))
        raise SystemExit(f"{label} go build failed (exit {proc.returncode}); command: {' '.join(cmd)}")
    _stamp(b).write_text(_key(b, go_version))
    print(f"{label} done in {time.monotonic() - start:.0f}s ({compiled} packages compiled, rest cached)", flush=True)


def ensure_built(names: list[str] | None = None, quiet: bool = False) -> Path:
    """Build whatever is missing or stale; return the bin directory."""
    if shutil.which("go") is None:
        raise SystemExit("go is not on PATH: the local control plane is built from Go modules")
    bin_dir().mkdir(parents=True, exist_ok=True)
    go_version = _go_version()
    wanted = binaries() if names is None else [b for b in binaries() + addon_binaries() if b.name in names]
    unknown = set(names or ()) - {b.name for b in wanted}
    if unknown:
        raise SystemExit(f"no such binary: {', '.join(sorted(unknown))}")
    stale = [b for b in wanted if not is_current(b, go_version)]
    if not stale:
        if not quiet:
            print(f"control-plane binaries are current in {bin_dir()}", flush=True)
        return bin_dir()
    t0 = time.monotonic()
    for i, b in enumerate(stale, 1):
        build_one(b, i, len(stale), go_version)
    print(f"built {len(stale)} binaries in {time.monotonic() - t0:.0f}s into {bin_dir()}", flush=True)
    return bin_dir()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="disagg cluster build", description=__doc__)
    p.add_argument("names", nargs="*", help="binaries to build (default: the control plane's and the real node's; "
                   "KEDA's, keda-operator and keda-adapter, only when named)")
    args = p.parse_args(argv)
    ensure_built(args.names or None)


if __name__ == "__main__":
    main()
