"""The product on the real node: deploy the tiny-cpu example as a user would and reach it as clients do."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml
from lightkube import codecs

EXAMPLE = Path(__file__).resolve().parents[2] / "manifests" / "examples" / "tiny-cpu.yaml"


@dataclass
class Deployed:
    """A DisaggregatedInference served by real engine pods on the node."""
    name: str
    namespace: str
    router_url: str  # the router Service's ClusterIP, reached from the host through kube-proxy
    rendezvous_url: str


def deployed_kv(d: Deployed, mode: str):
    """KvMoved for a deployment's two engine pods, reached at their advertised addresses (pod IPs route from the
    host over the node's bridge)."""
    from support.engines import KvMoved, advertised

    urls = {adv.role: adv.http_url for adv in advertised(d.rendezvous_url).values()}
    return KvMoved(urls["prefill"], urls["decode"], mode)


def serving(dinf) -> bool:
    """Ready on its current spec, and every engine the status counts Ready is advertised too. Ready is about
    pods: an engine advertises itself only after its own warm-up requests, seconds after its pod is Ready, and
    the router pairs advertised engines only."""
    from support.dinf import is_ready

    if not is_ready(dinf):
        return False
    revisions = (dinf.status or {}).get("revisions", [])
    return bool(revisions) and all(r.get(role, {}).get("ready", 0) == r.get(role, {}).get("advertised", 0)
                                   for r in revisions for role in ("prefill", "decode"))


def deploy(cluster, real_node, namespace: str, name: str, mode: str, timeout: float = 420, wait: bool = True,
           **overrides) -> Deployed | None:
    """Apply the tiny-cpu example (as on any cluster, plus the dev engine image's host mounts) with its model
    volume, and wait until it is `serving` (unless not `wait`). `overrides` replace spec fields,
    merged over the example's (a role's podTemplate over the host mounts)."""
    from lightkube.resources.core_v1 import Service

    from disagg.devcluster import tinymodel
    from disagg.devcluster.images import engine
    from disagg.devcluster.node import models, workloads
    from disagg.operator import names
    from support.dinf import Dinf, create
    from support.kube import watch_until

    model = tinymodel.model_dir()
    for doc in models.model_volume(namespace, model.parent, real_node.name):
        cluster.client.create(codecs.from_dict(doc))
    cr = workloads.on_dev_node(yaml.safe_load(EXAMPLE.read_text()), real_node.images["vllm-cpu"],
                               engine.host_env().mounts, name=name, mode=mode)
    cr["spec"]["model"]["source"]["pvc"]["path"] = f"/{model.name}"
    from disagg.operator.merge import deep_merge

    cr["spec"] = deep_merge(cr["spec"], overrides)
    create(cluster, namespace, cr)
    if not wait:
        return None
    watch_until(cluster, Dinf, name, serving, namespace=namespace, timeout=timeout,
                what="Ready with every engine advertised")
    def url(service: str) -> str:
        svc = cluster.client.get(Service, service, namespace=namespace)
        return f"http://{svc.spec.clusterIP}:{svc.spec.ports[0].port}"

    return Deployed(name, namespace, url(names.router_name(name)), url(names.rendezvous_name(name)))


def transport_verdict(cluster, deployed: Deployed) -> dict:
    """The deployment's TransportVerified condition once it is no longer Unknown. Ready is about pods; the engines'
    reported transport follows from the next rendezvous read (forced as soon as a Ready engine is not listed),
    within seconds."""
    from support.dinf import Dinf, cond
    from support.kube import watch_until

    dinf = watch_until(cluster, Dinf, deployed.name,
                       lambda d: (cond(d, "TransportVerified") or {}).get("status") != "Unknown",
                       namespace=deployed.namespace, timeout=30, what="a transport verdict")
    return cond(dinf, "TransportVerified")
