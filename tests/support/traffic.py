"""Steady traffic through a deployment's router, for tests that change the deployment under it, and the state
those tests await."""
from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable

from support.engines import await_status, completion


def routed_url(cluster, namespace: str, name: str, timeout: float = 60) -> str:
    """The URL of a CR's router Service once the Service routes to it. Ready follows the router Deployment; kube-proxy
    programs the Service's rules a moment later, and until then its ClusterIP refuses connections."""
    from lightkube.resources.core_v1 import Service

    from disagg.operator import names

    svc = cluster.client.get(Service, names.router_name(name), namespace=namespace)
    url = f"http://{svc.spec.clusterIP}:{svc.spec.ports[0].port}"
    await_status(url + "/health", 200, timeout=timeout)
    return url


class Stream:
    """One request after another through the router's Service, each outcome with the decode engine that served it
    (the router's response header)."""

    def __init__(self, url: str) -> None:
        self.url, self.results, self.halt = url, [], threading.Event()
        self._done = threading.Condition()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = json.dumps(completion("steady stream " * 20)).encode()
        while not self.halt.is_set():
            req = urllib.request.Request(self.url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=300) as r:
                    r.read()
                    outcome = (r.status, r.headers.get("X-Disagg-Decode-Engine", ""))
            except urllib.error.HTTPError as e:
                outcome = (e.code, e.read().decode(errors="replace")[:200])
            except OSError as e:
                outcome = (0, repr(e))
            with self._done:
                self.results.append(outcome)
                self._done.notify_all()

    def start(self) -> Stream:
        self._thread.start()
        return self

    def await_more(self, n: int, timeout: float = 120) -> None:
        with self._done:
            want = len(self.results) + n
            assert self._done.wait_for(lambda: len(self.results) >= want, timeout), \
                f"{len(self.results)} of {want} requests in {timeout} s"

    def stop(self) -> list[tuple[int, str]]:
        self.halt.set()
        self._thread.join(320)
        return self.results


def settled(prefill: int, decode: int) -> Callable[[object], bool]:
    """The CR Ready on its current spec, one revision left, every wanted engine ready and advertised."""
    def check(dinf: object) -> bool:
        d = dinf.to_dict() if hasattr(dinf, "to_dict") else dinf  # type: ignore[union-attr]
        status = d.get("status") or {}
        conds = {c["type"]: c for c in status.get("conditions", [])}
        revisions = status.get("revisions", [])
        return (status.get("observedGeneration") == d["metadata"].get("generation")
                and conds.get("Ready", {}).get("status") == "True" and len(revisions) == 1
                and all(tuple(revisions[0].get(role, {}).get(k) for k in ("replicas", "ready", "advertised"))
                        == (n, n, n) for role, n in (("prefill", prefill), ("decode", decode))))
    return check


def emulated_autoscaled(cluster, namespace: str, name: str, autoscaling: dict) -> str:
    """A push CR of engine emulators (cpu-kv64k) with `autoscaling`, settled at 1P1D; its router's URL (the
    Service's ClusterIP, reached from the host through kube-proxy)."""

    from support.dinf import Dinf, create
    from support.kube import watch_until

    create(cluster, namespace, {
        "apiVersion": "serving.disagg.io/v1alpha1", "kind": "DisaggregatedInference", "metadata": {"name": name},
        "spec": {"model": {"name": "tiny"}, "accelerator": {"profile": "cpu"},
                 "engine": {"emulator": {"profile": "cpu-kv64k"}}, "kvTransfer": {"mode": "push"},
                 "router": {"pairWaitSeconds": 150}, "autoscaling": autoscaling}})
    watch_until(cluster, Dinf, name, settled(1, 1), namespace=namespace, timeout=300, what="settled at 1P1D")
    return routed_url(cluster, namespace, name)
