"""The real node itself, before any product pod: it registers with its real capacity under its own
Node-authorized identity, runs pods with their own IPs that find Services by name, and its kubelet admits only
callers the apiserver vouches for."""
from __future__ import annotations

import ipaddress
import os
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from lightkube import ApiError, Client, KubeConfig, codecs
from lightkube.resources.core_v1 import Node, Pod, Secret, Service

from disagg.devcluster.node import config
from disagg.operator.profiles import CPU_ENGINES_LABEL, CPU_ENGINES_TAINT, CPU_ENGINES_VALUE
from support.kube import pod_ready, service_account_token, watch_until

pytestmark = [pytest.mark.cluster, pytest.mark.node]


def _on_node(name: str, image: str, command: list[str], labels: dict[str, str] | None = None,
             restart: str = "Always", probe_port: int | None = None) -> dict:
    container: dict = {"name": "main", "image": image, "imagePullPolicy": "Never", "command": command}
    if probe_port:
        container["readinessProbe"] = {"tcpSocket": {"port": probe_port}, "periodSeconds": 1}
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels or {}},
        "spec": {"nodeSelector": {CPU_ENGINES_LABEL: CPU_ENGINES_VALUE},
                 "tolerations": [{**CPU_ENGINES_TAINT, "operator": "Equal"}],
                 "restartPolicy": restart, "terminationGracePeriodSeconds": 1, "containers": [container]},
    }


def test_node_is_ready_with_its_real_capacity_labels_and_taint(cluster, real_node):
    node = cluster.client.get(Node, real_node.name)
    assert node.status.capacity["cpu"] == str(os.cpu_count())
    mem_kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal:"))
    assert node.status.capacity["memory"] == f"{mem_kib}Ki"
    assert node.metadata.labels[CPU_ENGINES_LABEL] == CPU_ENGINES_VALUE
    assert [(t.key, t.value, t.effect) for t in node.spec.taints] == \
        [(CPU_ENGINES_TAINT["key"], CPU_ENGINES_TAINT["value"], CPU_ENGINES_TAINT["effect"])]
    assert node.status.nodeInfo.kubeletVersion == "v1.36.3"
    assert node.status.nodeInfo.containerRuntimeVersion == "containerd://2.4.2"
    assert [a.address for a in node.status.addresses if a.type == "InternalIP"] == [real_node.ip]


def test_pods_get_their_own_ips_and_reach_a_service_by_name(cluster, real_node, namespace):
    image = real_node.images["python"]
    server = _on_node("echo", image, ["python3", "-m", "http.server", "8080"], {"app": "echo"}, probe_port=8080)
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "echo"},
               "spec": {"selector": {"app": "echo"}, "ports": [{"port": 80, "targetPort": 8080}]}}
    # kube-proxy programs the Service's new endpoint a moment after the pod turns Ready (another process's
    # state, nothing to watch from inside the pod): the client retries a refused connection for up to 30 s.
    script = ("import socket, time, urllib.request\n"
              "print('kubernetes', socket.gethostbyname('kubernetes.default.svc.cluster.local'))\n"
              "print('echo', socket.gethostbyname('echo'))\n"
              "deadline = time.monotonic() + 30\n"
              "while True:\n"
              "    try:\n"
              "        status = urllib.request.urlopen('http://echo/', timeout=10).status\n"
              "        break\n"
              "    except OSError:\n"
              "        if time.monotonic() > deadline:\n"
              "            raise\n"
              "        time.sleep(0.2)\n"
              "print('status', status)\n")
    client_pod = _on_node("client", image, ["python3", "-c", script], restart="Never")
    for doc in (server, service):
        cluster.client.create(codecs.from_dict(doc), namespace=namespace)
    server_pod = watch_until(cluster, Pod, "echo", pod_ready, namespace=namespace, timeout=120, what="Ready")
    cluster.client.create(codecs.from_dict(client_pod), namespace=namespace)
    done = watch_until(cluster, Pod, "client", lambda p: p.status.phase in ("Succeeded", "Failed"),
                       namespace=namespace, timeout=120, what="finished")
    log = "".join(cluster.client.log("client", namespace=namespace))  # the apiserver calls the kubelet for it
    assert done.status.phase == "Succeeded", log
    pod_cidr = ipaddress.ip_network(config.POD_CIDR)
    ips = {server_pod.status.podIP, done.status.podIP}
    assert len(ips) == 2 and all(ipaddress.ip_address(ip) in pod_cidr for ip in ips), ips
    svc_ip = cluster.client.get(Service, "echo", namespace=namespace).spec.clusterIP
    assert log.splitlines() == ["kubernetes 10.96.0.1", f"echo {svc_ip}", "status 200"]


def _kubelet_get(real_node, path: str, token: str | None = None) -> int:
    req = urllib.request.Request(f"https://{real_node.ip}:10250{path}",
                                 headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10, context=ssl._create_unverified_context()) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_kubelet_admits_only_callers_the_apiserver_vouches_for(cluster, real_node, namespace):
    assert _kubelet_get(real_node, "/pods") == 401  # anonymous
    assert _kubelet_get(real_node, "/pods", "not-a-token") == 401
    assert _kubelet_get(real_node, "/pods", cluster.local.credentials.admin_token) == 200
    # A real ServiceAccount token: authenticated (TokenReview), but not authorized (SubjectAccessReview).
    assert _kubelet_get(real_node, "/pods", service_account_token(cluster, namespace, "default")) == 403


def test_the_node_runs_under_its_own_node_authorized_identity(cluster, real_node):
    kubelet = Client(KubeConfig.from_file(cluster.local.dir / "node" / "kubelet.kubeconfig"))
    assert kubelet.get(Node, real_node.name).metadata.name == real_node.name
    with pytest.raises(ApiError) as denied:
        list(kubelet.list(Secret, namespace="kube-system"))
    assert denied.value.status.code == 403
    other = next(n.metadata.name for n in cluster.client.list(Node) if n.metadata.name != real_node.name)
    with pytest.raises(ApiError) as denied:
        kubelet.patch(Node, other, {"metadata": {"labels": {"stolen": "yes"}}})
    assert denied.value.status.code == 403
