"""Scale to zero and back with real vLLM engines on the real node (issue 35): the smallest real case of
tests/node/test_autoscale_e2e.py's emulated one. The tiny-cpu example with the built-in planner and an idle window:
with no traffic both roles go to 0 and their pods away; the first request after that is held by the router, not
failed, until the planner has brought a pair back, and its greedy answer equals a single engine's, with its KV
carried from prefill to decode."""
from __future__ import annotations

import time

import pytest
from lightkube.resources.core_v1 import Pod

from disagg.operator import names
from support.dinf import Dinf
from support.engines import PROMPTS, advertised, completion, metric, post, text_of
from support.kube import watch_until
from support.node import deploy

pytestmark = [pytest.mark.cluster, pytest.mark.node, pytest.mark.engines]

IDLE_SECONDS = 60  # the shortest idle window spec.autoscaling.scaleToZero takes


def _desired(dinf: object) -> tuple[int | None, int | None]:
    d = dinf.to_dict() if hasattr(dinf, "to_dict") else dinf  # type: ignore[union-attr]
    s = d.get("status") or {}
    return s.get("prefill", {}).get("desired"), s.get("decode", {}).get("desired")


def engine_pods(cluster, namespace: str, name: str) -> list[Pod]:
    return [p for p in cluster.client.list(Pod, namespace=namespace, labels={names.LABEL_INSTANCE: name})
            if (p.metadata.labels or {}).get(names.LABEL_COMPONENT) in names.ENGINE_ROLES]


def test_an_idle_tiny_cpu_deployment_goes_to_zero_and_its_first_request_is_held_and_served(
        cluster, real_node, operator_release, module_namespace, reference):
    d = deploy(cluster, real_node, module_namespace, "tiny-zero", "push", router={"pairWaitSeconds": 300},
               autoscaling={"prefill": {"minReplicas": 1, "maxReplicas": 1},
                            "decode": {"minReplicas": 1, "maxReplicas": 1},
                            "scaleToZero": {"idleSeconds": IDLE_SECONDS}})
    assert d is not None
    watch_until(cluster, Dinf, d.name, lambda x: _desired(x) == (0, 0), namespace=module_namespace,
                timeout=IDLE_SECONDS + 240, what="scaled to zero after the idle window")
    deadline = time.monotonic() + 240
    while pods := engine_pods(cluster, module_namespace, d.name):
        assert time.monotonic() < deadline, f"engine pods still there: {[p.metadata.name for p in pods]}"
        watch_until(cluster, Pod, pods[0].metadata.name, lambda p: False, namespace=module_namespace,
                    timeout=240, what="deleted", gone_ok=True)

    t0 = time.monotonic()
    status, resp = post(d.router_url + "/v1/completions", completion(PROMPTS[0]), timeout=330)
    waited = time.monotonic() - t0
    assert status == 200, resp
    assert text_of(resp) == reference[("completion", 0)]
    assert _desired(cluster.client.get(Dinf, d.name, namespace=module_namespace)) == (1, 1)
    # The engines' own warm-up requests are local: KV received from prefill is this request's.
    (decode,) = [a for a in advertised(d.rendezvous_url).values() if a.role == "decode"]
    assert metric(decode.http_url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") > 0
    print(f"the first request after scale to zero waited {waited:.1f} s for a pair of real engines")
