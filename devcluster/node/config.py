"""Every configuration file a real node's components read, rendered from one NodeLayout. Pure: no I/O.

The settings that matter here, and why:
- containerd keeps root, state and sockets under the node's directory, pins the locally imported sandbox image
  (no registry is reachable), and restricts oom_score_adj: root in this VM lacks CAP_SYS_RESOURCE, and runc
  otherwise fails to raise a container's score.
- the kubelet runs with cgroupfs on a cgroup v1 host (`failCgroupV1: false`), authenticates callers with x509
  (the apiserver's kubelet-client certificate) and tokens, and authorizes them with SubjectAccessReviews
  (webhook), as kubeadm sets it up; eviction thresholds are low because the host disk is shared.
- kube-proxy may not change conntrack sysctls in this VM (`maxPerCore: 0`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

CLUSTER_DOMAIN = "cluster.local"
POD_CIDR = "10.88.0.0/16"
SERVICE_DNS_IP = "10.96.0.10"
"""The kube-dns Service's ClusterIP (the tenth address of the service CIDR, as kubeadm picks)."""
CNI_PLUGINS = ("bridge", "loopback", "host-local", "portmap")


@dataclass(frozen=True)
class NodeLayout:
    """Where a node keeps its state, and the addresses it uses. Everything but `containerd_root`'s images dies
    with the cluster."""

    dir: Path
    name: str
    ip: str
    bin_dir: Path
    sandbox_image: str
    kubelet_port: int = 10250

    @property
    def containerd_socket(self) -> Path:
        return self.dir / "containerd" / "containerd.sock"

    @property
    def cni_conf_dir(self) -> Path:
        return self.dir / "cni" / "net.d"

    @property
    def cni_bin_dir(self) -> Path:
        return self.dir / "cni" / "bin"

    @property
    def kubelet_root(self) -> Path:
        return self.dir / "kubelet"

    def path(self, name: str) -> Path:
        return self.dir / name


def containerd_config(n: NodeLayout) -> str:
    """containerd's config (version 3). TOML is written by hand: it is short, flat, and a TOML writer would be a
    dependency for one file."""
    d = n.dir / "containerd"
    return f"""version = 3
root = '{d / "root"}'
state = '{d / "state"}'

[grpc]
  address = '{n.containerd_socket}'

[ttrpc]
  address = '{n.containerd_socket}.ttrpc'

[plugins.'io.containerd.cri.v1.images']
  snapshotter = 'overlayfs'

[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = '{n.sandbox_image}'

[plugins.'io.containerd.cri.v1.runtime']
  restrict_oom_score_adj = true

[plugins.'io.containerd.cri.v1.runtime'.containerd]
  default_runtime_name = 'runc'

[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
  runtime_type = 'io.containerd.runc.v2'

[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
  BinaryName = '{n.bin_dir / "runc"}'
  Root = '{d / "runc"}'
  SystemdCgroup = false

[plugins.'io.containerd.cri.v1.runtime'.cni]
  bin_dirs = ['{n.cni_bin_dir}']
  conf_dir = '{n.cni_conf_dir}'
"""


def cni_conflist(n: NodeLayout) -> dict[str, Any]:
    """A bridge with host-local IPAM on the pod CIDR (state under the node's directory) and portmap."""
    return {
        "cniVersion": "1.0.0",
        "name": "disagg-node",
        "plugins": [
            {"type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": True, "hairpinMode": True,
             "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_CIDR}]], "routes": [{"dst": "0.0.0.0/0"}],
                      "dataDir": str(n.dir / "cni" / "ipam")}},
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def kubeconfig(server: str, ca: Path, cert: Path, key: Path, user: str) -> str:
    return yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "node",
        "clusters": [{"name": "local", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": {"client-certificate": str(cert), "client-key": str(key)}}],
        "contexts": [{"name": "node", "context": {"cluster": "local", "user": user}}],
    })


def kubelet_config(n: NodeLayout, ca: Path, serving_cert: Path, serving_key: Path,
                   taints: list[dict[str, str]]) -> dict[str, Any]:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "address": n.ip, "port": n.kubelet_port, "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1", "healthzPort": 0,
        "tlsCertFile": str(serving_cert), "tlsPrivateKeyFile": str(serving_key),
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                           "x509": {"clientCAFile": str(ca)}},
        "authorization": {"mode": "Webhook"},
        "cgroupDriver": "cgroupfs", "failSwapOn": False, "failCgroupV1": False,
        "containerRuntimeEndpoint": f"unix://{n.containerd_socket}",
        "podLogsDir": str(n.dir / "pod-logs"),
        "clusterDomain": CLUSTER_DOMAIN, "clusterDNS": [SERVICE_DNS_IP],
        "resolvConf": "/etc/resolv.conf",
        "registerWithTaints": taints,
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                         "nodefs.inodesFree": "1%"},
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        # The kubelet's default: a fleet of engine emulators (34 pods for 16P16D with its router and rendezvous)
        # must fit the one real node; real engines are bounded by its two cores long before.
        "serializeImagePulls": False, "maxPods": 110,
        "shutdownGracePeriod": "0s",
    }


def kube_proxy_config(n: NodeLayout, kubeconfig_path: Path, metrics_port: int, healthz_port: int) -> dict[str, Any]:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
        "mode": "iptables", "clusterCIDR": POD_CIDR, "hostnameOverride": n.name,
        "clientConnection": {"kubeconfig": str(kubeconfig_path)},
        "conntrack": {"maxPerCore": 0, "min": 0},
        "metricsBindAddress": f"127.0.0.1:{metrics_port}", "healthzBindAddress": f"127.0.0.1:{healthz_port}",
        "bindAddress": n.ip,
    }


def corefile(n: NodeLayout, kubeconfig_path: Path, health_port: int, ready_port: int) -> str:
    """CoreDNS answers for Services and pods from the apiserver (its kubernetes plugin), on the node's address,
    which the kube-dns Service fronts; anything else goes to the host's resolvers."""
    return f""".:53 {{
    bind {n.ip}
    errors
    health 127.0.0.1:{health_port}
    ready 127.0.0.1:{ready_port}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig_path} node
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
    forward . /etc/resolv.conf
    cache 30
}}
"""


def kube_dns_objects(node_ip: str) -> list[dict[str, Any]]:
    """The kube-dns Service at SERVICE_DNS_IP and its endpoints: CoreDNS on the node's address (it runs on the
    host, not as a pod, so the Service has no selector and its EndpointSlice is ours)."""
    ports = [{"name": "dns", "port": 53, "protocol": "UDP"}, {"name": "dns-tcp", "port": 53, "protocol": "TCP"}]
    meta = {"name": "kube-dns", "namespace": "kube-system", "labels": {"k8s-app": "kube-dns"}}
    return [
        {"apiVersion": "v1", "kind": "Service", "metadata": meta,
         "spec": {"clusterIP": SERVICE_DNS_IP, "ports": [{**p, "targetPort": 53} for p in ports]}},
        {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
         "metadata": {"name": "kube-dns-node", "namespace": "kube-system",
                      "labels": {"kubernetes.io/service-name": "kube-dns",
                                 "endpointslice.kubernetes.io/managed-by": "disagg-devcluster"}},
         "addressType": "IPv4", "endpoints": [{"addresses": [node_ip], "conditions": {"ready": True}}],
         "ports": ports},
    ]
