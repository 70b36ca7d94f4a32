"""Start and stop a real node's components as children of the local cluster, in dependency order:
containerd (with the images imported), the kubelet (until its Node is Ready), kube-proxy (until its rules are
synced), CoreDNS (until it has read the Services) behind the kube-dns Service.

Security as kubeadm sets it up: the kubelet runs as system:node:<name> in system:nodes (the Node authorizer
and NodeRestriction bound what it may touch), kube-proxy as system:kube-proxy, CoreDNS as system:coredns with
read access to Services and EndpointSlices; the apiserver reaches the kubelet with its own client certificate,
which the kubelet checks against the cluster CA and authorizes with a SubjectAccessReview.

One real node per host: it owns host-wide things (the cni0 bridge, iptables, ports 53 and 10250). A lock file
makes a second one fail with a message instead of breaking the first.
"""
from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

import yaml
from lightkube import ApiError, codecs
from lightkube.resources.core_v1 import Node

from .. import build
from ..cluster import Process, await_component, free_port
from ..pki import KeyPair, issue
from . import config
from .host import HostSnapshot, kill_pod_processes, processes_mentioning, write_sysctl

if TYPE_CHECKING:
    from ..cluster import LocalCluster

ImportImages = Callable[[Path, str], dict[str, str]]
"""Imports the node's images into containerd's k8s.io namespace, given the `ctr` binary and containerd's address;
returns image name -> the reference pods use (`devcluster.images.catalog.ensure_images`)."""


def snapshot_path() -> Path:
    return build.cache_dir() / "node" / "host-snapshot.json"


def lock_path() -> Path:
    return build.cache_dir() / "node" / "node.lock"


class NodeBusy(RuntimeError):
    """Another real node runs on this host."""


@dataclass
class NodeSpec:
    name: str = "disagg-node"
    labels: dict[str, str] = field(default_factory=dict)
    taints: list[dict[str, str]] = field(default_factory=list)
    sandbox_image: str = "disagg.local/pause:dev"
    import_images: ImportImages | None = None
    ready_timeout: float = 120.0


def recover(progress: Callable[[str], None] = lambda _m: None) -> list[str]:
    """Undo what a node that was killed left on the host (its snapshot is still on disk). Returns problems."""
    path = snapshot_path()
    if not path.exists():
        return []
    snap = HostSnapshot.load(path)
    progress(f"restoring the host settings a previous node left (snapshot {path})")
    for pid in processes_mentioning(snap.node_dir):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    problems = snap.restore()
    path.unlink()
    return problems


class RealNode:
    def __init__(self, cluster: LocalCluster, spec: NodeSpec | None = None):
        self.cluster = cluster
        self.spec = spec or NodeSpec()
        self.dir = cluster.dir / "node"
        self.bin = cluster.bin
        self.processes: list[Process] = []
        self._lock: IO[str] | None = None
        self._snapshot: HostSnapshot | None = None
        self.images: dict[str, str] = {}
        self.layout = config.NodeLayout(dir=self.dir, name=self.spec.name, ip=cluster.host_ip, bin_dir=self.bin,
                                        sandbox_image=self.spec.sandbox_image)

    # -- lifecycle ---------------------------------------------------------------------------------------
    def start(self, progress: Callable[[str], None] = lambda _m: None) -> RealNode:
        missing = [b for b in ("kubelet", "kube-proxy", "containerd", "containerd-shim-runc-v2", "ctr", "runc",
                               *config.CNI_PLUGINS, "coredns") if not (self.bin / b).exists()]
        if missing:
            raise FileNotFoundError(f"node binaries missing in {self.bin}: {', '.join(missing)}; "
                                    f"run `disagg cluster build`")
        self._take_lock()
        t0 = time.monotonic()
        try:
            for problem in recover(progress):
                progress(f"  could not restore: {problem}")
            self._snapshot = HostSnapshot.capture(self.dir)
            self._snapshot.save(snapshot_path())
            write_sysctl("net.ipv4.ip_forward", "1")  # pods' traffic to Services and the outside is routed
            self._prepare()
            self._start_containerd(progress)
            self._start_kubelet(progress)
            self._start_kube_proxy(progress)
            self._start_coredns(progress)
        except BaseException:
            self.stop()
            raise
        progress(f"node {self.spec.name} Ready at {self.layout.ip} in {time.monotonic() - t0:.1f}s")
        return self

    def stop(self) -> list[str]:
        """Stop every component and put the host back; return what could not be restored. The host is restored
        even when a step before it fails (that failure is returned as a problem)."""
        problems: list[str] = []
        try:
            self._stop_components()
        except Exception as e:  # noqa: BLE001 - the host must be restored whatever went wrong before
            problems.append(f"stopping the node's components: {type(e).__name__}: {e}")
        if self._snapshot is not None:
            problems += self._snapshot.restore()
            snapshot_path().unlink(missing_ok=True)
            self._snapshot = None
        self._delete_node_object()
        if self._lock is not None:
            self._lock.close()
            self._lock = None
        return problems

    def _stop_components(self) -> None:
        by_name = {p.name: p for p in self.processes}
        for name in ("coredns", "kube-proxy", "kubelet"):
            if name in by_name:
                by_name[name].stop()
        if self._snapshot is not None:
            kill_pod_processes(self._snapshot.absent_cgroups)
        if "containerd" in by_name:
            by_name["containerd"].stop()
        # containerd's shims daemonize: neither their parent's death nor containerd's stop ends them.
        for pid in processes_mentioning(str(self.dir)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.processes.clear()
        if "kube-proxy" in by_name:
            subprocess.run([str(self.bin / "kube-proxy"), "--cleanup"], capture_output=True)

    # -- steps -------------------------------------------------------------------------------------------
    def _take_lock(self) -> None:
        lock_path().parent.mkdir(parents=True, exist_ok=True)
        f = lock_path().open("a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip()
            f.close()
            raise NodeBusy(f"another real node runs on this host ({holder or 'unknown'}); one host, one node: "
                           f"it owns cni0, iptables and ports 53 and 10250") from None
        f.truncate(0)
        f.write(f"pid {os.getpid()}, cluster {self.cluster.config.name}\n")
        f.flush()
        self._lock = f

    def _creds(self) -> dict[str, KeyPair]:
        creds = self.cluster.credentials
        n = self.spec.name
        return {
            "kubelet": issue(creds, "node-kubelet", f"system:node:{n}", ("system:nodes",)),
            "kubelet-serving": issue(creds, "node-kubelet-serving", f"system:node:{n}", ("system:nodes",),
                                     client=False, dns_names=(n,), ips=(self.layout.ip,)),
            "kube-proxy": issue(creds, "node-kube-proxy", "system:kube-proxy"),
            "coredns": issue(creds, "node-coredns", "system:coredns"),
        }

    def _prepare(self) -> None:
        d = self.dir
        for sub in ("containerd", "cni/net.d", "cni/bin", "cni/ipam", "kubelet", "pod-logs", "logs"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        for plugin in config.CNI_PLUGINS:
            link = self.layout.cni_bin_dir / plugin
            if not link.exists():
                link.symlink_to(self.bin / plugin)
        (self.layout.cni_conf_dir / "10-disagg.conflist").write_text(json.dumps(config.cni_conflist(self.layout)))
        (d / "containerd" / "config.toml").write_text(config.containerd_config(self.layout))
        self.pairs = self._creds()
        ca = self.cluster.credentials.ca_cert
        for who, pair in self.pairs.items():
            if who != "kubelet-serving":
                (d / f"{who}.kubeconfig").write_text(config.kubeconfig(self.cluster.server, ca, pair.cert, pair.key,
                                                                       who))
        self._apply_rbac()

    def _apply_rbac(self) -> None:
        """What kubeadm creates: the apiserver may call every kubelet API; CoreDNS may read what it serves."""
        docs = [
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
             "metadata": {"name": "disagg-node:apiserver-kubelet-client"},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                         "name": "system:kubelet-api-admin"},
             "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                           "name": "kube-apiserver-kubelet-client"}]},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
             "metadata": {"name": "system:coredns"},
             "rules": [{"apiGroups": [""], "resources": ["endpoints", "services", "pods", "namespaces"],
                        "verbs": ["list", "watch"]},
                       {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                        "verbs": ["list", "watch"]}]},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
             "metadata": {"name": "system:coredns"},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:coredns"},
             "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "system:coredns"}]},
        ]
        client = self.cluster.client()
        for doc in docs:
            client.apply(codecs.from_dict(doc), field_manager="disagg-devcluster")

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Process:
        p = Process(name, argv, self.dir / "logs" / f"{name}.log", env=env)
        p.start()
        self.processes.append(p)
        return p

    def _await(self, proc: Process, check: Callable[[], bool], what: str) -> None:
        await_component(proc, check, what, self.spec.ready_timeout,
                        transient=(OSError, ValueError, ApiError, subprocess.CalledProcessError))

    def ctr(self) -> list[str]:
        return [str(self.bin / "ctr"), "--address", str(self.layout.containerd_socket), "--namespace", "k8s.io"]

    def _start_containerd(self, progress: Callable[[str], None]) -> None:
        progress("starting containerd")
        # The shim and runc are found on containerd's PATH.
        env = {**os.environ, "PATH": f"{self.bin}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
        p = self._spawn("containerd", [str(self.bin / "containerd"), "--config",
                                       str(self.dir / "containerd" / "config.toml")], env=env)
        self._await(p, lambda: subprocess.run([*self.ctr(), "version"], capture_output=True).returncode == 0,
                    "serving on its socket")
        if self.spec.import_images is not None:
            self.images = self.spec.import_images(self.bin / "ctr", str(self.layout.containerd_socket))

    def _start_kubelet(self, progress: Callable[[str], None]) -> None:
        progress(f"starting the kubelet (node {self.spec.name})")
        serving = self.pairs["kubelet-serving"]
        cfg = config.kubelet_config(self.layout, self.cluster.credentials.ca_cert, serving.cert, serving.key,
                                    self.spec.taints)
        (self.dir / "kubelet-config.yaml").write_text(yaml.safe_dump(cfg))
        labels = ",".join(f"{k}={v}" for k, v in sorted(self.spec.labels.items()))
        p = self._spawn("kubelet", [
            str(self.bin / "kubelet"), f"--config={self.dir / 'kubelet-config.yaml'}",
            f"--kubeconfig={self.dir / 'kubelet.kubeconfig'}", f"--root-dir={self.layout.kubelet_root}",
            f"--cert-dir={self.dir / 'kubelet-pki'}", f"--node-ip={self.layout.ip}",
            f"--hostname-override={self.spec.name}", *([f"--node-labels={labels}"] if labels else []), "--v=1",
        ])
        client = self.cluster.client()

        def ready() -> bool:
            node = client.get(Node, self.spec.name)
            conditions = (node.status.conditions if node.status else None) or []
            taints = (node.spec.taints if node.spec else None) or []
            return any(c.type == "Ready" and c.status == "True" for c in conditions) and \
                not any(t.key.startswith("node.kubernetes.io/") for t in taints)

        self._await(p, ready, "a Ready node")

    def _start_kube_proxy(self, progress: Callable[[str], None]) -> None:
        progress("starting kube-proxy (iptables)")
        metrics, healthz = free_port(), free_port()
        cfg = config.kube_proxy_config(self.layout, self.dir / "kube-proxy.kubeconfig", metrics, healthz)
        (self.dir / "kube-proxy-config.yaml").write_text(yaml.safe_dump(cfg))
        p = self._spawn("kube-proxy", [str(self.bin / "kube-proxy"),
                                       f"--config={self.dir / 'kube-proxy-config.yaml'}", "--v=1"])
        self._await(p, lambda: urllib.request.urlopen(f"http://127.0.0.1:{healthz}/healthz", timeout=2).status == 200,
                    "synced (healthz)")

    def _start_coredns(self, progress: Callable[[str], None]) -> None:
        progress(f"starting CoreDNS behind kube-dns ({config.SERVICE_DNS_IP})")
        health, ready = free_port(), free_port()
        corefile = self.dir / "Corefile"
        corefile.write_text(config.corefile(self.layout, self.dir / "coredns.kubeconfig", health, ready))
        p = self._spawn("coredns", [str(self.bin / "coredns"), "-conf", str(corefile)])
        client = self.cluster.client()
        for doc in config.kube_dns_objects(self.layout.ip):
            client.apply(codecs.from_dict(doc), field_manager="disagg-devcluster")
        self._await(p, lambda: urllib.request.urlopen(f"http://127.0.0.1:{ready}/ready", timeout=2).status == 200,
                    "ready (its kubernetes plugin has synced)")

    def _delete_node_object(self) -> None:
        try:
            self.cluster.client().delete(Node, self.spec.name)
        except (ApiError, OSError):
            pass  # never registered, or the apiserver is already gone


def default_spec(import_images: ImportImages | None = None) -> NodeSpec:
    """The dev cluster's node: labelled and tainted for the `cpu` profile, so only CPU engines (and the pods that
    tolerate the taint) land on the one node that runs containers. Its images are built here (BuildKit, debootstrap)
    and imported unless `import_images` says otherwise."""
    from disagg.operator.profiles import CPU_ENGINES_LABEL, CPU_ENGINES_TAINT, CPU_ENGINES_VALUE

    from ..images import catalog

    if import_images is None:
        import_images = catalog.ensure_images
    return NodeSpec(labels={CPU_ENGINES_LABEL: CPU_ENGINES_VALUE, "node.kubernetes.io/instance-type": "local"},
                    taints=[dict(CPU_ENGINES_TAINT)], import_images=import_images)
