"""Run a real local control plane: etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok,
all as child processes of this one, plus the simulated fleet from `fleet.py`.

Children die with their parent (PR_SET_PDEATHSIG), so a killed test run leaves nothing behind. When a
component fails to start, the error names it and points at its log.
"""
from __future__ import annotations

import ctypes
import json
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Self

import yaml
from lightkube import Client, KubeConfig, codecs
from lightkube.resources.core_v1 import Node

from . import build
from .fleet import FleetSpec, build_nodes
from .pki import SERVICE_CIDR, Credentials, KeyPair, ensure_credentials, issue

if TYPE_CHECKING:
    from .node.node import NodeSpec, RealNode

STAGES_FILE = Path(__file__).resolve().parent / "kwok-stages.yaml"


class ComponentFailed(RuntimeError):
    """A control-plane component did not come up. The message names it and its log."""

    def __init__(self, component: str, reason: str, log: Path):
        tail = ""
        if log.exists():
            lines = log.read_text(errors="replace").splitlines()[-15:]
            tail = "\n  | " + "\n  | ".join(lines) if lines else ""
        super().__init__(f"{component} failed to start: {reason}; log: {log}{tail}")
        self.component, self.log = component, log


LISTEN_PORTS = range(20000, 30000)
"""Where free_port looks: below the kernel's ephemeral range (32768 and up by default), so an outgoing
connection's local port never takes a port between free_port's check and the child's bind, and below the NodePort
range (30000-32767)."""
_handed_out: set[int] = set()


def free_port() -> int:
    """A port nothing listens on now, in LISTEN_PORTS, and not handed out by this process before: each child binds
    its own, after this returns, so two asking in turn must not get the same.

    The gap can be long: vLLM binds its NIXL side channel only once the model is loaded, tens of seconds after
    start, when a pair's engines have picked six ports between them. A port from the ephemeral range (what binding
    port 0 gives) could meanwhile become some connection's local port, and a port merely checked free could be
    picked again for the other engine; either way vLLM's side-channel listener dies on bind and its engine core
    waits for it forever."""
    start = random.randrange(len(LISTEN_PORTS))
    for i in range(len(LISTEN_PORTS)):
        port = LISTEN_PORTS[(start + i) % len(LISTEN_PORTS)]
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise OSError(f"no free port in {LISTEN_PORTS}")


def host_address() -> str:
    """The address of the interface the default route leaves by: where a real node's pods reach the apiserver
    (a UDP connect only picks the route; nothing is sent). 127.0.0.1 on a host without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.254", 9))  # TEST-NET-1: any routable address picks the default route
        except OSError:
            return "127.0.0.1"
        address: str = s.getsockname()[0]
        return address


def await_component(proc: Process, check: Callable[[], bool], what: str, timeout: float,
                    transient: tuple[type[BaseException], ...] = (OSError, ValueError)) -> None:
    """Poll `check` (another process's state: there is no event) until it holds; a `transient` error counts as
    not yet. Raises ComponentFailed naming the component and its log if it exits first or `timeout` passes."""
    deadline = time.monotonic() + timeout
    delay = 0.05
    while time.monotonic() < deadline:
        code = proc.exited()
        if code is not None:
            raise ComponentFailed(proc.name, f"exited with code {code} before becoming {what}", proc.log)
        try:
            if check():
                return
        except transient:
            pass
        time.sleep(delay)
        delay = min(delay * 1.5, 0.5)
    raise ComponentFailed(proc.name, f"not {what} after {timeout:.0f}s", proc.log)


def die_with_parent() -> None:
    """preexec_fn for children that must not outlive this process, however it ends."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class Process:
    name: str
    argv: list[str]
    log: Path
    popen: subprocess.Popen[bytes] | None = None
    env: dict[str, str] | None = None  # None: this process's environment
    cwd: str | None = None

    def start(self) -> Self:
        with self.log.open("ab") as out:
            self.popen = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env=self.env, cwd=self.cwd, start_new_session=True,
                                          preexec_fn=die_with_parent)
        return self

    def exited(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def stop(self, grace: float = 10.0) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        try:
            os.killpg(self.popen.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.popen.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()


@dataclass
class ClusterConfig:
    name: str = "disagg"
    fleet: FleetSpec = field(default_factory=FleetSpec)
    state_dir: Path | None = None
    bin_dir: Path | None = None
    # Ports are normally picked free at start; tests pin one to provoke a real bind failure.
    etcd_port: int | None = None
    startup_timeout: float = 120.0
    # Write an apiserver audit log (metadata level) to logs/audit.log: benchmarks count requests with it.
    audit: bool = False
    # Log only these users' requests (empty: everyone's). Logging every request of a large kwok fleet (each node
    # renews its lease every 10 s) costs the apiserver CPU that a benchmark is measuring something else with.
    audit_users: tuple[str, ...] = ()
    # Serve the apiserver's /debug/pprof (admin only): benchmarks profile where the control plane's CPU goes.
    profiling: bool = False
    # The kwok nodes' lease duration (they renew it every quarter of it), and how long the node-lifecycle
    # controller waits for a renewal before it marks a node Unknown and taints it. The defaults are a kubelet's.
    # A large fleet on two cores cannot renew at that rate under load: its leases lapse, the nodes flap and
    # kwok re-patches them, which loads the control plane further. Benchmarks of large fleets lengthen both.
    node_lease_seconds: int = 40
    node_monitor_grace_seconds: int = 50
    # Also run a real node (devcluster/node): kubelet, containerd, CNI, kube-proxy and CoreDNS on this host.
    real_node: bool = False


class LocalCluster:
    def __init__(self, config: ClusterConfig | None = None):
        self.config = config or ClusterConfig()
        self.dir = self.config.state_dir or (build.cache_dir() / "clusters" / self.config.name)
        self.bin = self.config.bin_dir or build.bin_dir()
        self.processes: list[Process] = []
        self.kubeconfig = self.dir / "kubeconfig"
        self.creds: Credentials | None = None
        self.server = ""
        self.host_ip = host_address()
        self.node: RealNode | None = None

    # -- lifecycle ---------------------------------------------------------------------------------------
    def start(self, progress: Callable[[str], None] = lambda _m: None) -> LocalCluster:
        missing = [b for b in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
                   if not (self.bin / b).exists()]
        if missing:
            raise FileNotFoundError(f"control-plane binaries missing in {self.bin}: {', '.join(missing)}; "
                                    f"run `disagg cluster build`")
        if self.dir.exists():
            shutil.rmtree(self.dir)
        (self.dir / "logs").mkdir(parents=True)
        self.creds = ensure_credentials(self.dir / "pki", extra_ips=(self.host_ip,))
        t0 = time.monotonic()
        try:
            self._start_etcd(progress)
            self._start_apiserver(progress)
            self._write_kubeconfig()
            self._start_controllers(progress)
            self._create_fleet(progress)
            if self.config.real_node:
                self.add_real_node(progress=progress)
        except BaseException:
            self.stop()
            raise
        progress(f"cluster {self.config.name} up in {time.monotonic() - t0:.1f}s; KUBECONFIG={self.kubeconfig}")
        return self

    def wait(self) -> None:
        """Block until the first component (etcd) exits: a cluster run in the foreground until Ctrl-C."""
        popen = self.processes[0].popen if self.processes else None
        if popen is None:
            raise RuntimeError(f"cluster {self.config.name} is not started")
        popen.wait()

    def add_real_node(self, spec: NodeSpec | None = None,
                      progress: Callable[[str], None] = lambda _m: None) -> RealNode:
        """Start a real node next to the kwok fleet (one per host); it stops with the cluster."""
        from .node.node import RealNode, default_spec

        if self.node is None:
            self.node = RealNode(self, spec or default_spec()).start(progress)
        return self.node

    def stop(self) -> None:
        if self.node is not None:
            for problem in self.node.stop():
                print(f"real node: could not restore {problem}", flush=True)
            self.node = None
        for p in reversed(self.processes):
            p.stop()
        self.processes.clear()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def credentials(self) -> Credentials:
        if self.creds is None:
            raise RuntimeError(f"cluster {self.config.name} is not started")
        return self.creds

    @property
    def pids(self) -> list[int]:
        return [p.popen.pid for p in self.processes if p.popen is not None]

    # -- components --------------------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Process:
        p = Process(name, argv, self.dir / "logs" / f"{name}.log", env=env)
        p.start()
        self.processes.append(p)
        return p

    def _await(self, proc: Process, check: Callable[[], bool], what: str) -> None:
        await_component(proc, check, what, self.config.startup_timeout)

    def _start_etcd(self, progress: Callable[[str], None]) -> None:
        client, peer = self.config.etcd_port or free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        progress(f"starting etcd on {self.etcd_url}")
        p = self._spawn("etcd", [
            str(self.bin / "etcd"), "--name", "default", "--data-dir", str(self.dir / "etcd"),
            "--listen-client-urls", self.etcd_url, "--advertise-client-urls", self.etcd_url,
            "--listen-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"default=http://127.0.0.1:{peer}",
            # A throwaway test store: durability is not worth an fsync per write on a shared 2-core box.
            "--unsafe-no-fsync", "--quota-backend-bytes", str(4 << 30), "--log-level", "warn",
        ])
        self._await(p, lambda: json.load(urllib.request.urlopen(f"{self.etcd_url}/health", timeout=2))
                    .get("health") == "true", "healthy")

    def _tls(self) -> ssl.SSLContext:
        assert self.creds is not None
        return ssl.create_default_context(cafile=str(self.creds.ca_cert))

    def _get(self, url: str, token: str | None = None, tls: ssl.SSLContext | None = None) -> bytes:
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
        ctx = tls
        if ctx is None and url.startswith("https"):
            ctx = ssl._create_unverified_context()  # components' self-signed health endpoints
        body: bytes = urllib.request.urlopen(req, timeout=2, context=ctx).read()
        return body

    def _start_apiserver(self, progress: Callable[[str], None]) -> None:
        assert self.creds is not None
        port = free_port()
        self.server = f"https://127.0.0.1:{port}"
        progress(f"starting kube-apiserver on {self.server}")
        c = self.creds
        kubelet_client = self._kubelet_client_pair()
        front_proxy = issue(c, "front-proxy-client", "front-proxy-client")
        p = self._spawn("kube-apiserver", [
            str(self.bin / "kube-apiserver"),
            # On every address, advertising the host's: a real node's pods reach it through the `kubernetes`
            # Service, whose endpoint is the advertised address.
            f"--etcd-servers={self.etcd_url}", f"--secure-port={port}", "--bind-address=0.0.0.0",
            f"--advertise-address={self.host_ip}", f"--tls-cert-file={c.serving_cert}",
            f"--tls-private-key-file={c.serving_key}", f"--client-ca-file={c.ca_cert}",
            f"--token-auth-file={c.token_file}", "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction",
            # How it calls kubelets (logs, exec, port-forward), as kubeadm sets it up.
            f"--kubelet-client-certificate={kubelet_client.cert}", f"--kubelet-client-key={kubelet_client.key}",
            f"--kubelet-certificate-authority={c.ca_cert}", "--kubelet-preferred-address-types=InternalIP,Hostname",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={c.sa_pub}", f"--service-account-signing-key-file={c.sa_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            # EFA pods need privileged or IPC_LOCK; the apiserver must allow the former to test it.
            "--allow-privileged=true",
            f"--cert-dir={self.dir / 'apiserver-certs'}",
            # The aggregation layer, as kubeadm sets it up (one CA here): extension API servers such as KEDA's
            # external-metrics adapter trust the proxied identity headers of the front-proxy client only. Routed
            # to the Service's endpoints, not its ClusterIP: this host is no node, it has no kube-proxy rules.
            f"--requestheader-client-ca-file={c.ca_cert}", "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User", "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-", f"--proxy-client-cert-file={front_proxy.cert}",
            f"--proxy-client-key-file={front_proxy.key}", "--enable-aggregator-routing=true",
            f"--profiling={str(self.config.profiling).lower()}", "--v=1",
            *self._audit_flags(),
        ])
        self._await(p, lambda: self._get(f"{self.server}/readyz", c.admin_token, self._tls()) == b"ok", "ready")

    def start_keda(self, progress: Callable[[str], None] = lambda _m: None) -> list[Process]:
        """KEDA's operator and external-metrics adapter as host processes that stop with the cluster, or before
        it by their `stop()` (devcluster/keda.py); returns them once `external.metrics.k8s.io` answers through the
        apiserver."""
        from . import keda

        assert self.creds is not None
        creds = self.creds
        bins = build.ensure_built(["keda-operator", "keda-adapter"], quiet=True)
        certs = self.dir / "keda-certs"
        certs.mkdir(exist_ok=True)
        pair = issue(creds, "keda", "keda", dns_names=keda.serving_names(), ips=("127.0.0.1", self.host_ip))
        shutil.copy(pair.cert, certs / "tls.crt")
        shutil.copy(pair.key, certs / "tls.key")
        shutil.copy(creds.ca_cert, certs / "ca.crt")
        (certs / "ca").mkdir(exist_ok=True)
        shutil.copy(creds.ca_cert, certs / "ca" / "ca.crt")
        ports = keda.Ports(*(free_port() for _ in range(5)))
        client = self.client()
        progress(f"installing KEDA {build.KEDA_VERSION}'s CRDs and its external metrics APIService")
        for doc in keda.crds(keda.module_dir()) + keda.api_objects(self.host_ip, ports, creds.ca_cert.read_bytes()):
            client.apply(codecs.from_dict(doc), field_manager="disagg-devcluster")
        env = {**os.environ, **keda.env(self.kubeconfig)}
        op = self._spawn("keda-operator", keda.operator_argv(bins / "keda-operator", certs, ports), env=env)
        self._await(op, lambda: self._get(f"http://127.0.0.1:{ports.operator_health}/readyz") == b"ok", "ready")
        adapter = self._spawn("keda-adapter", keda.adapter_argv(bins / "keda-adapter", certs, self.kubeconfig,
                                                                ports), env=env)
        self._await(adapter, lambda: bool(self._get(f"{self.server}/apis/external.metrics.k8s.io/v1beta1",
                                                    creds.admin_token, self._tls())),
                    "serving external.metrics.k8s.io through the apiserver")
        progress("KEDA is up")
        return [adapter, op]

    def stop_keda(self, processes: list[Process]) -> None:
        """Stop what start_keda started and withdraw its APIService: an aggregated API whose server is gone makes
        every client's discovery incomplete (helm refuses to install with it), so the cluster must not keep one."""
        from lightkube.resources.apiregistration_v1 import APIService

        from . import keda

        for p in processes:
            p.stop()
        self.client().delete(APIService, keda.API_SERVICE)

    def _kubelet_client_pair(self) -> KeyPair:
        return issue(self.credentials, "apiserver-kubelet-client", "kube-apiserver-kubelet-client")

    @property
    def audit_log(self) -> Path:
        return self.dir / "logs" / "audit.log"

    def _audit_flags(self) -> list[str]:
        if not self.config.audit:
            return []
        policy = self.dir / "audit-policy.yaml"
        users = list(self.config.audit_users)
        rules = [{"level": "Metadata", "users": users}, {"level": "None"}] if users else [{"level": "Metadata"}]
        policy.write_text(yaml.safe_dump({"apiVersion": "audit.k8s.io/v1", "kind": "Policy",
                                          "omitStages": ["RequestReceived"], "rules": rules}))
        return [f"--audit-policy-file={policy}", f"--audit-log-path={self.audit_log}", "--audit-log-maxsize=0"]

    def kubeconfig_for(self, user: str) -> Path:
        """A kubeconfig for one of the static-token users (`admin`, `disagg-operator`)."""
        assert self.creds is not None
        path = self.kubeconfig if user == "admin" else self.dir / f"kubeconfig-{user}"
        cfg = {
            "apiVersion": "v1", "kind": "Config", "current-context": self.config.name,
            "clusters": [{"name": self.config.name, "cluster": {
                "server": self.server, "certificate-authority": str(self.creds.ca_cert)}}],
            "users": [{"name": user, "user": {"token": self.creds.token(user)}}],
            "contexts": [{"name": self.config.name, "context": {"cluster": self.config.name, "user": user,
                                                                "namespace": "default"}}],
        }
        path.write_text(yaml.safe_dump(cfg))
        path.chmod(0o600)
        return path

    def _write_kubeconfig(self) -> None:
        self.kubeconfig_for("admin")

    def _start_controllers(self, progress: Callable[[str], None]) -> None:
        assert self.creds is not None
        kc = str(self.kubeconfig)
        kcm_port, sched_port, kwok_port = free_port(), free_port(), free_port()
        progress("starting kube-controller-manager, kube-scheduler and kwok")
        kcm = self._spawn("kube-controller-manager", [
            str(self.bin / "kube-controller-manager"), f"--kubeconfig={kc}", "--leader-elect=false",
            f"--service-account-private-key-file={self.creds.sa_key}", f"--root-ca-file={self.creds.ca_cert}",
            f"--cluster-name={self.config.name}", "--bind-address=127.0.0.1", f"--secure-port={kcm_port}",
            f"--service-cluster-ip-range={SERVICE_CIDR}", "--v=1",
            # The default 20 QPS makes pod creation, not the operator, the bottleneck of a 100-CR benchmark.
            "--kube-api-qps=200", "--kube-api-burst=400",
            f"--node-monitor-grace-period={self.config.node_monitor_grace_seconds}s",
        ])
        sched = self._spawn("kube-scheduler", [
            str(self.bin / "kube-scheduler"), f"--kubeconfig={kc}", "--leader-elect=false",
            "--bind-address=127.0.0.1", f"--secure-port={sched_port}", "--v=1",
            "--kube-api-qps=200", "--kube-api-burst=400",
        ])
        kwok = self._spawn("kwok", [
            str(self.bin / "kwok"), f"--kubeconfig={kc}", f"--config={STAGES_FILE}",
            "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
            f"--server-address=127.0.0.1:{kwok_port}",
            f"--node-lease-duration-seconds={self.config.node_lease_seconds}",
            "--cidr=10.244.0.0/16",
        ])
        self._await(kcm, lambda: self._get(f"https://127.0.0.1:{kcm_port}/healthz") == b"ok", "healthy")
        self._await(sched, lambda: self._get(f"https://127.0.0.1:{sched_port}/healthz") == b"ok", "healthy")
        self._await(kwok, lambda: self._get(f"http://127.0.0.1:{kwok_port}/healthz") == b"ok", "healthy")
        # Pods need the `default` ServiceAccount, which the controller-manager creates asynchronously.
        creds = self.creds  # narrowed to Credentials for the lambda
        self._await(kcm, lambda: bool(self._get(f"{self.server}/api/v1/namespaces/default/serviceaccounts/default",
                                                creds.admin_token, self._tls())), "serving ServiceAccounts")

    def client(self) -> Client:
        return Client(KubeConfig.from_file(self.kubeconfig))

    def _create_fleet(self, progress: Callable[[str], None]) -> None:
        nodes = build_nodes(self.config.fleet)
        progress(f"creating {len(nodes)} simulated nodes")
        client = self.client()
        for node in nodes:
            client.create(codecs.from_dict(node))
        kwok = next(p for p in self.processes if p.name == "kwok")

        def schedulable(n: Node) -> bool:
            # Ready, and the node-lifecycle controller has lifted the not-ready taint it puts on new nodes. (A node
            # read back without status or spec is not ready yet.)
            conditions = (n.status.conditions if n.status is not None else None) or []
            taints = (n.spec.taints if n.spec is not None else None) or []
            return any(c.type == "Ready" and c.status == "True" for c in conditions) and \
                not any(t.key.startswith("node.kubernetes.io/") for t in taints)

        def all_ready() -> bool:
            return sum(1 for n in client.list(Node) if schedulable(n)) == len(nodes)

        self._await(kwok, all_ready, f"reporting all {len(nodes)} nodes Ready")
