"""The demo's real path: the tiny-cpu example applied with kubectl, served by the operator's own pods on the real
node, reached through the router's Service.

For each mode, the example CR (with the dev engine image's host mounts: the documented shortcut) and its model
volume are applied; the demo follows the CR to Ready (pods, then conditions), streams one completion through the
router Service (its ClusterIP, which kube-proxy routes from this host), prints the answer as it streams, the
client-measured TTFT, the router's handoff for that one request, the engines that served it (the router's
response headers) and `kubectl get dinf -o wide`, then deletes the CR so the next mode's engines get the cores.
"""
from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import yaml
from lightkube import Client, codecs
from lightkube.generic_resource import create_namespaced_resource
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Namespace, PersistentVolume, Pod, Service

from disagg.operator import api, names

from . import tinymodel, vllm_env
from .cluster import LocalCluster
from .demo_engines import (
    MAX_TOKENS,
    TIMING_HEADER,
    DemoFailed,
    Result,
    printable,
    timing_row,
    traced_request,
)
from .node import models, workloads

EXAMPLE = Path(__file__).resolve().parents[1] / "manifests" / "examples" / "tiny-cpu.yaml"
NAMESPACE = "tiny"
READY_TIMEOUT = 420.0
Dinf = create_namespaced_resource(api.GROUP, api.VERSION, api.KIND, api.PLURAL)


def _say(msg: str) -> None:
    print(f"\n==> {msg}", flush=True)


def _note(msg: str) -> None:
    print(f"    {msg}", flush=True)


def _kubectl(c: LocalCluster, *args: str, stdin: str | None = None) -> None:
    subprocess.run([str(c.bin / "kubectl"), f"--kubeconfig={c.kubeconfig}", *args], check=True, text=True,
                   input=stdin)


def _status(obj: Any) -> dict[str, Any]:
    status: dict[str, Any] = (obj.status if obj is not None else None) or {}
    return status


def _condition(obj: Any, ctype: str) -> dict[str, Any] | None:
    conditions = _status(obj).get("conditions") or []
    return next((c for c in conditions if c["type"] == ctype), None)


DEGRADED_GRACE = 30.0
"""Seconds a Degraded condition may hold before waiting for Ready gives up on it. The kubelet retries what it
reports: a FailedMount can be the node authorizer's graph not yet knowing the new pod's PersistentVolumeClaim
(`no relationship found between node ... and this object`), gone at the next try."""


def follow_ready(client: Client, name: str, timeout: float) -> None:
    """Print each change of the CR's Ready condition and of its pods' phases until Ready (or fail naming why: not
    Ready in `timeout`, or Degraded for DEGRADED_GRACE seconds without a break)."""
    deadline = time.monotonic() + timeout
    seen: set[str] = set()
    degraded_since: float | None = None
    while time.monotonic() < deadline:
        dinf = client.get(Dinf, name, namespace=NAMESPACE)
        for pod in client.list(Pod, namespace=NAMESPACE, labels={names.LABEL_INSTANCE: name}):
            statuses = pod.status.containerStatuses or [] if pod.status else []
            state = "Ready" if statuses and all(s.ready for s in statuses) else (
                pod.status.phase if pod.status else "Pending")
            line = f"pod {pod.metadata.name if pod.metadata else '?'}: {state}"
            if line not in seen:
                seen.add(line)
                _note(line)
        ready = _condition(dinf, "Ready")
        if ready is not None:
            line = f"Ready={ready['status']} ({ready.get('reason', '')})"
            if line not in seen:
                seen.add(line)
                _note(f"{name}: {line} {ready.get('message', '')}".rstrip())
            observed = _status(dinf).get("observedGeneration")
            if ready["status"] == "True" and dinf.metadata is not None and observed == dinf.metadata.generation:
                return
        degraded = _condition(dinf, "Degraded")
        if degraded is not None and degraded["status"] == "True":
            line = f"Degraded ({degraded.get('reason')}): {degraded.get('message')}"
            if line not in seen:
                seen.add(line)
                _note(f"{name}: {line}")
            degraded_since = degraded_since if degraded_since is not None else time.monotonic()
            if time.monotonic() - degraded_since >= DEGRADED_GRACE:
                raise DemoFailed(f"{name} is {line}")
        else:
            degraded_since = None
        time.sleep(1)  # progress printing: a watch would need a second loop for pods
    raise DemoFailed(f"{name} not Ready within {timeout:.0f}s; `kubectl -n {NAMESPACE} describe pods`")


def service_url(client: Client, service: str) -> str:
    spec = client.get(Service, service, namespace=NAMESPACE).spec
    if spec is None or not spec.ports:
        raise DemoFailed(f"Service {NAMESPACE}/{service} has no ports")
    return f"http://{spec.clusterIP}:{spec.ports[0].port}"


def tiny_cr(images: dict[str, str], mounts: tuple[Path, ...], mode: str) -> dict[str, Any]:
    """The tiny-cpu example as the dev cluster runs it: `tiny-<mode>`, the engine image's host mounts, the model
    at its directory on the model volume."""
    cr = workloads.on_dev_node(yaml.safe_load(EXAMPLE.read_text()), images["vllm-cpu"], mounts, name=f"tiny-{mode}",
                               mode=mode)
    cr["spec"]["model"]["source"]["pvc"]["path"] = f"/{tinymodel.model_dir().name}"
    return cr


def serve(c: LocalCluster, images: dict[str, str], mounts: tuple[Path, ...], mode: str) -> Result:
    client = c.client()
    name = f"tiny-{mode}"
    _say(f"{mode} mode: kubectl apply of {EXAMPLE.name} (cpu profile, 1 prefill + 1 decode, model from a PVC)")
    _kubectl(c, "apply", "-n", NAMESPACE, "-f", "-", stdin=yaml.safe_dump(tiny_cr(images, mounts, mode)))
    t0 = time.monotonic()
    follow_ready(client, name, READY_TIMEOUT)
    _note(f"Ready after {time.monotonic() - t0:.0f}s (most of it vLLM starting in the engine pods)")
    router = service_url(client, names.router_name(name))
    _say(f"{mode} mode: a streamed completion through the router Service {router} (greedy, {MAX_TOKENS} tokens)")
    print("    answer: ", end="", flush=True)
    text, first, served = traced_request(router, mode, lambda t: print(printable(t), end="", flush=True))
    print(flush=True)
    again, warm, _ = traced_request(router, mode, lambda _t: None)
    _note(TIMING_HEADER)
    _note(timing_row("first request", first))
    _note(timing_row("again (warm)", warm, "same answer" if again == text else f"DIFFERENT: {printable(again)!r}"))
    _note("handoff: prefill finished to decode's first token, for that one request (the router's metrics)")
    _note(f"served by prefill {served[0]} -> decode {served[1]} (router response headers)")
    _say(f"kubectl get dinf {name} -o wide")
    _kubectl(c, "get", "dinf", name, "-n", NAMESPACE, "-o", "wide")
    verified = _condition(client.get(Dinf, name, namespace=NAMESPACE), "TransportVerified") or {}
    _note(f"TransportVerified={verified.get('status')} ({verified.get('reason')}): {verified.get('message', '')}")
    _kubectl(c, "delete", "dinf", name, "-n", NAMESPACE, "--wait=true")
    _await_no_pods(client, name)
    return Result(mode, text, first, warm, served)


def _await_no_pods(client: Client, name: str, timeout: float = 120) -> None:
    _await_gone(client, {names.LABEL_INSTANCE: name}, f"the pods of {name}", timeout)


def await_engines_gone(client: Client, name: str, timeout: float = 120) -> None:
    """Until no engine pod of the CR `name` exists (after scaling its roles to 0): their cores are free."""
    for role in names.ENGINE_ROLES:
        _await_gone(client, names.selector_labels(name, role), f"the {role} pods of {name}", timeout)


def _await_gone(client: Client, labels: dict[str, str], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    selector: dict[str, Any] = dict(labels)
    while list(client.list(Pod, namespace=NAMESPACE, labels=selector)):  # (a lazy iterator)
        if time.monotonic() > deadline:
            raise DemoFailed(f"{what} did not go within {timeout:.0f}s")
        time.sleep(1)  # the next engines need these cores


def prepare(c: LocalCluster, node: str) -> None:
    """The namespace and the tiny model (generated unless it exists) as a local PersistentVolume on the node,
    with its claim."""
    client = c.client()
    client.apply(Namespace(metadata=ObjectMeta(name=NAMESPACE)), field_manager="disagg-demo")
    # A local volume's path must exist before the kubelet mounts it; it retries only every two minutes.
    model = tinymodel.ensure_model(vllm_env.python())
    for doc in models.model_volume(NAMESPACE, model.parent, node):
        client.apply(codecs.from_dict(doc), field_manager="disagg-demo")
    _note(f"model volume: PersistentVolume {models.CLAIM}-{NAMESPACE} (local, {model.parent} on {node}) "
          f"bound to the claim {NAMESPACE}/{models.CLAIM}")


def cleanup(c: LocalCluster) -> None:
    client = c.client()
    for pv in client.list(PersistentVolume, labels={"serving.disagg.io/models-for": NAMESPACE}):
        if pv.metadata is not None and pv.metadata.name:
            client.delete(PersistentVolume, pv.metadata.name)

