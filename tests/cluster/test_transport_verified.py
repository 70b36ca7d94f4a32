"""TransportVerified on the real cluster: the operator reads what the engines report to a real `disagg rendezvous`
process and says whether KV moves over the backend the CR asked for.

No vLLM here: the advertisements the plugin would send are registered by hand, with the rendezvous' write token.
The operator runs out of cluster, so --rendezvous-url-template points it at the local rendezvous.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import yaml
from lightkube.resources.core_v1 import Event

from disagg.connector.rendezvous.client import RendezvousClient
from support.dinf import Dinf, cond, create, is_ready
from support.engines import Service
from support.kube import watch_list_until, watch_until
from support.operator import OperatorProcess
from support.rendezvous import advert
from support.tools import kubectl

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
TOKEN = "transport-test-token"


def transport(dinf) -> dict:
    return cond(dinf, "TransportVerified") or {}


def register(url: str, name: str, transport: str | None) -> None:
    """What each engine's plugin does: PUT its advertisement (here with the transport we want it to report)."""
    async def put() -> None:
        async with RendezvousClient(url, token=TOKEN) as client:
            for role in ("prefill", "decode"):
                await client.register(advert(f"{name}-{role}-0-uid{role}", role=role, deployment=name,
                                             pod_name=f"{name}-{role}-0", transport=transport, lease_seconds=600))
    asyncio.run(put())


def test_transport_verified_follows_what_engines_report(cluster, crd_installed, namespace, tmp_path):
    manifest = yaml.safe_load((REPO / "manifests" / "examples" / "qwen3-32b-p5en.yaml").read_text())
    name = manifest["metadata"]["name"]
    assert "efa" not in manifest["spec"].get("accelerator", {}) or manifest["spec"]["accelerator"]["efa"] != "off"

    rendezvous = Service("rendezvous", ["rendezvous", "--auth", "token", "--token", TOKEN, "--deployment", name,
                                        "--heartbeat-seconds", "1"], tmp_path).start()
    operator = OperatorProcess(cluster.kubeconfig, tmp_path / "operator.log", resync_seconds=2, extra=[
        "-n", namespace, "--rendezvous-url-template", rendezvous.url, "--transport-poll-seconds", "1"]).start()
    try:
        create(cluster, namespace, manifest)
        dinf = watch_until(cluster, Dinf, name, lambda d: transport(d).get("reason") == "NoEnginesReported",
                           namespace=namespace, timeout=60, what="TransportVerified NoEnginesReported")
        assert dinf.status["backend"] == "LIBFABRIC", "the p5en example uses EFA"
        assert transport(dinf)["status"] == "Unknown"

        # Both engines report UCX: NIXL's LIBFABRIC backend did not start and KV moves over TCP. They register one
        # after the other, so a status pass between the two names only the first: await the one that names both.
        register(rendezvous.url, name, "UCX")
        dinf = watch_until(cluster, Dinf, name, lambda d: transport(d).get("status") == "False"
                           and f"{name}-decode-0" in transport(d)["message"],
                           namespace=namespace, timeout=60, what="TransportVerified False for both engines")
        t = transport(dinf)
        assert t["reason"] == "TransportMismatch"
        assert t["message"].startswith(f"engines {name}-decode-0, {name}-prefill-0 report UCX, but LIBFABRIC was "
                                       "requested: KV moves over TCP instead of EFA"), t["message"]
        degraded = cond(dinf, "Degraded")
        assert (degraded["status"], degraded["reason"], degraded["message"]) == ("True", "TransportMismatch",
                                                                                 t["message"])
        warning = watch_list_until(cluster, Event, lambda e: e.reason == "TransportMismatch", namespace=namespace,
                                   timeout=30, what="a TransportMismatch Event")
        assert warning.type == "Warning" and warning.involvedObject.name == name
        assert "KV moves over TCP instead of EFA" in warning.message
        wide = kubectl("--kubeconfig", str(cluster.kubeconfig), "get", "dinf", name, "-n", namespace, "-o", "wide"
                       ).stdout.splitlines()
        assert wide[0].split()[-2:] == ["TRANSPORT", "AGE"] and wide[1].split()[-2] == "TransportMismatch"
        operator.await_quiet(rounds=2)  # more passes while False: the Warning must not repeat

        # The engines come back with EFA working.
        register(rendezvous.url, name, "LIBFABRIC")
        dinf = watch_until(cluster, Dinf, name, lambda d: transport(d).get("status") == "True",
                           namespace=namespace, timeout=60, what="TransportVerified True")
        assert transport(dinf)["reason"] == "TransportMatches"
        assert transport(dinf)["message"] == "all 2 advertised engines report LIBFABRIC, as requested"
        assert cond(dinf, "Degraded")["reason"] != "TransportMismatch"
        watch_list_until(cluster, Event, lambda e: e.reason == "TransportMatches" and e.type == "Normal",
                         namespace=namespace, timeout=30, what="a TransportMatches Event")
        mismatches = [e for e in cluster.client.list(Event, namespace=namespace) if e.reason == "TransportMismatch"]
        assert len(mismatches) == 1 and (mismatches[0].count or 1) == 1, "one Warning per transition"

        # The rendezvous goes away: Unknown, and reconciling goes on (the CR still becomes Ready).
        rendezvous.stop()
        dinf = watch_until(cluster, Dinf, name,
                           lambda d: transport(d).get("reason") == "RendezvousUnreachable" and is_ready(d),
                           namespace=namespace, timeout=90, what="RendezvousUnreachable and Ready")
        assert transport(dinf)["status"] == "Unknown"
        assert transport(dinf)["message"] == (f"cannot read the engines' transport from the rendezvous at "
                                              f"{rendezvous.url}: connection failed")
    finally:
        operator.stop()
        rendezvous.stop()
