"""`disagg rendezvous --auth kubernetes` against the real apiserver: pod-bound ServiceAccount tokens from the
TokenRequest API, verified by the rendezvous with TokenReviews (using the test cluster's admin kubeconfig)."""
from __future__ import annotations

import json

import aiohttp
import pytest
from lightkube.models.authentication_v1 import BoundObjectReference, TokenRequestSpec
from lightkube.models.core_v1 import Container, PodSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Pod, ServiceAccount

from disagg import cli
from disagg.connector.rendezvous import DEFAULT_AUDIENCE, build_server
from support.rendezvous import advert_json, run_async

pytestmark = pytest.mark.cluster

DEPLOYMENT = "qwen"
SA = "engine"


def _pod(cluster, namespace: str, name: str) -> Pod:
    pod = Pod(metadata=ObjectMeta(name=name, namespace=namespace),
              spec=PodSpec(serviceAccountName=SA, automountServiceAccountToken=False,
                           containers=[Container(name="engine", image="registry.invalid/engine:0")]))
    return cluster.client.create(pod)


def _token(cluster, namespace: str, pod: Pod | None, audience: str | None = DEFAULT_AUDIENCE) -> str:
    spec = TokenRequestSpec(audiences=[audience] if audience else None, expirationSeconds=600)
    if pod is not None:
        spec.boundObjectRef = BoundObjectReference(kind="Pod", apiVersion="v1", name=pod.metadata.name,
                                                   uid=pod.metadata.uid)
    req = cluster.client.create(ServiceAccount.Token(metadata=ObjectMeta(), spec=spec), name=SA, namespace=namespace)
    return req.status.token


def test_pod_bound_tokens_are_verified_with_token_reviews(cluster, namespace):
    cluster.client.create(ServiceAccount(metadata=ObjectMeta(name=SA, namespace=namespace)))
    prefill = _pod(cluster, namespace, f"{DEPLOYMENT}-prefill-0")
    decode = _pod(cluster, namespace, f"{DEPLOYMENT}-decode-0")
    stranger = _pod(cluster, namespace, "other-decode-0")
    tokens = {
        "prefill": _token(cluster, namespace, prefill),
        "decode": _token(cluster, namespace, decode),
        "stranger": _token(cluster, namespace, stranger),
        "unbound": _token(cluster, namespace, None),
        "apiserver-audience": _token(cluster, namespace, prefill, audience=None),
    }
    args = cli.parser().parse_args(["rendezvous", "--auth", "kubernetes", "--deployment", DEPLOYMENT,
                                    "--namespace", namespace, "--kubeconfig", str(cluster.kubeconfig),
                                    "--heartbeat-seconds", "1"])

    def adv(pod: Pod, role: str, **over) -> dict:
        return advert_json(f"{pod.metadata.name}-{pod.metadata.uid}", role=role, deployment=DEPLOYMENT,
                           **{"pod_name": pod.metadata.name, "pod_uid": pod.metadata.uid, **over})

    @run_async(60)
    async def scenario():
        server = build_server(args)
        url = await server.start("127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as http:
                async def put(token: str, body: dict) -> tuple[int, dict | None]:
                    async with http.put(f"{url}/v1/engines/{body['engine_id']}", data=json.dumps(body),
                                        headers={"Authorization": f"Bearer {token}"}) as resp:
                        data = await resp.read()
                        return resp.status, json.loads(data) if data else None

                status, body = await put(tokens["prefill"], adv(prefill, "prefill"))
                assert status == 201, body
                assert body["engine"]["pod_uid"] == prefill.metadata.uid
                reviews = server.auth.reviews
                assert (await put(tokens["prefill"], adv(prefill, "prefill")))[0] == 200
                assert server.auth.reviews == reviews  # the renewal was served from the review cache
                assert (await put(tokens["decode"], adv(decode, "decode")))[0] == 201

                # The same valid token, naming another pod (or another role, or another uid): 403.
                status, body = await put(tokens["prefill"], adv(decode, "decode"))
                assert status == 403 and "token belongs to pod qwen-prefill-0" in body["error"], body
                status, body = await put(tokens["prefill"], adv(prefill, "decode"))
                assert status == 403 and "may not advertise a decode engine" in body["error"], body
                status, body = await put(tokens["prefill"], adv(prefill, "prefill", pod_uid="0000-1111"))
                assert status == 403, body
                # A pod of another deployment: 403.
                status, body = await put(tokens["stranger"], adv(stranger, "decode"))
                assert status == 403 and "not an engine of deployment 'qwen'" in body["error"], body
                # A ServiceAccount token not bound to a pod: 403.
                status, body = await put(tokens["unbound"], adv(prefill, "prefill"))
                assert status == 403 and "not bound to a pod" in body["error"], body
                # Not a token at all, or a token for the API server's audience instead of the rendezvous': 401.
                for bad in ("garbage", tokens["apiserver-audience"]):
                    status, body = await put(bad, adv(prefill, "prefill"))
                    assert status == 401 and body["reason"] == "unauthenticated", body

                # The prefill pod deletes its own entry, but not decode's.
                async with http.delete(f"{url}/v1/engines/{adv(decode, 'decode')['engine_id']}",
                                       headers={"Authorization": f"Bearer {tokens['prefill']}"}) as resp:
                    assert resp.status == 403
                async with http.delete(f"{url}/v1/engines/{adv(prefill, 'prefill')['engine_id']}",
                                       headers={"Authorization": f"Bearer {tokens['prefill']}"}) as resp:
                    assert resp.status == 204
            assert [a.pod_name for a in server.registry.engines()] == ["qwen-decode-0"]
        finally:
            await server.stop()

    scenario()
