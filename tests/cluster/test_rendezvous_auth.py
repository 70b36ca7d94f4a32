"""`disagg rendezvous --auth kubernetes` against the real apiserver: pod-bound ServiceAccount tokens from the
TokenRequest API, verified by the rendezvous with TokenReviews; first as the test cluster's admin, then as the
ServiceAccount the operator creates and binds for a deployment's rendezvous."""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from lightkube.models.authentication_v1 import BoundObjectReference, TokenRequestSpec
from lightkube.models.core_v1 import Container, PodSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Pod, ServiceAccount
from lightkube.resources.rbac_authorization_v1 import ClusterRoleBinding

from disagg import cli
from disagg.connector.rendezvous.server import build_server
from disagg.connector.wire.env import TOKEN_AUDIENCE as DEFAULT_AUDIENCE
from disagg.operator.names import rendezvous_binding_name
from support.dinf import Dinf, create, engine_pod_name, is_ready, small
from support.kube import token_kubeconfig, watch_until
from support.operator import OperatorProcess
from support.rendezvous import advert_json
from support.tools import can_i

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


async def test_pod_bound_tokens_are_verified_with_token_reviews(cluster, namespace):
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

    async with asyncio.timeout(60):
        await scenario()


# -- end to end: the identity the operator gives a deployment's rendezvous ----------------------------------
@pytest.fixture
def operator(cluster, crd_installed, tmp_path):
    op = OperatorProcess(cluster.kubeconfig, tmp_path / "operator.log")
    op.start()
    yield op
    op.stop()


def _engine_token(cluster, pod: Pod) -> str:
    """What the kubelet projects into an engine pod (spec.rendezvous.auth: kubernetes): a token of the pod's
    ServiceAccount, bound to the pod, for the rendezvous' audience. kwok runs no kubelet, so ask the TokenRequest
    API for the same token the projected volume would hold."""
    [volume] = [v for v in pod.spec.volumes if v.name == "rendezvous-token"]
    source = volume.projected.sources[0].serviceAccountToken
    spec = TokenRequestSpec(audiences=[source.audience], expirationSeconds=source.expirationSeconds,
                            boundObjectRef=BoundObjectReference(kind="Pod", apiVersion="v1", name=pod.metadata.name,
                                                                uid=pod.metadata.uid))
    return cluster.client.create(ServiceAccount.Token(metadata=ObjectMeta(), spec=spec),
                                 name=pod.spec.serviceAccountName, namespace=pod.metadata.namespace).status.token


def _await_allowed(kubeconfig, *args: str, timeout: float = 30) -> None:
    """The apiserver's RBAC authorizer follows bindings through an informer; nothing to watch for its cache, so
    ask until it answers yes."""
    deadline = time.monotonic() + timeout
    while not can_i(kubeconfig, *args):
        assert time.monotonic() < deadline, f"{kubeconfig} still may not {args} after {timeout}s"
        time.sleep(0.2)


async def test_the_operators_binding_lets_the_rendezvous_verify_its_engines_tokens(cluster, operator, namespace,
                                                                                    tmp_path):
    """A rendezvous runs here as the ServiceAccount the operator made for deployment alpha (a TokenRequest token,
    as its pod would have), in `--auth kubernetes` mode. Tokens of alpha's engine pods register; a token of
    deployment beta's engine pod is refused with 403. The same rendezvous as a ServiceAccount without the
    operator's binding cannot verify anything (503): the binding is what makes it work."""
    alpha, beta = (create(cluster, namespace, small(n)) for n in ("alpha", "beta"))
    for name in (alpha, beta):  # watch_until runs its own event loop: in a thread, beside this test's
        await asyncio.to_thread(watch_until, cluster, Dinf, name, is_ready, namespace=namespace, timeout=60,
                                what="Ready")
    await asyncio.to_thread(watch_until, cluster, ClusterRoleBinding, rendezvous_binding_name(namespace, alpha),
                            lambda b: True, timeout=30)
    a_prefill, a_decode, b_decode = (engine_pod_name(cluster, namespace, cr, role)
                                     for cr, role in ((alpha, "prefill"), (alpha, "decode"), (beta, "decode")))
    pods = {p: cluster.client.get(Pod, p, namespace=namespace) for p in (a_prefill, a_decode, b_decode)}
    tokens = {p: _engine_token(cluster, pod) for p, pod in pods.items()}

    as_alpha = token_kubeconfig(cluster, namespace, f"{alpha}-rendezvous", tmp_path / "alpha")
    cluster.client.create(ServiceAccount(metadata=ObjectMeta(name="unbound", namespace=namespace)))
    as_unbound = token_kubeconfig(cluster, namespace, "unbound", tmp_path / "unbound")
    _await_allowed(as_alpha, "create", "tokenreviews.authentication.k8s.io")
    assert not can_i(as_unbound, "create", "tokenreviews.authentication.k8s.io")

    def server_as(kubeconfig):
        return build_server(cli.parser().parse_args([
            "rendezvous", "--auth", "kubernetes", "--deployment", alpha, "--namespace", namespace,
            "--kubeconfig", str(kubeconfig), "--heartbeat-seconds", "1"]))

    def adv(pod_name: str) -> dict:
        pod = pods[pod_name]
        role = pod.metadata.labels["serving.disagg.io/role"]
        return advert_json(f"{pod_name}-{pod.metadata.uid}", role=role, deployment=alpha, pod_name=pod_name,
                           pod_uid=pod.metadata.uid)

    async def scenario():
        servers = {"alpha": server_as(as_alpha), "unbound": server_as(as_unbound)}
        urls = {k: await s.start("127.0.0.1", 0) for k, s in servers.items()}
        try:
            async with aiohttp.ClientSession() as http:
                async def put(server: str, pod_name: str) -> tuple[int, dict]:
                    body = adv(pod_name)
                    async with http.put(f"{urls[server]}/v1/engines/{body['engine_id']}", data=json.dumps(body),
                                        headers={"Authorization": f"Bearer {tokens[pod_name]}"}) as resp:
                        return resp.status, json.loads(await resp.read())

                for pod_name in (a_prefill, a_decode):
                    status, body = await put("alpha", pod_name)
                    assert status == 201, body
                status, body = await put("alpha", b_decode)
                assert status == 403 and f"not an engine of deployment '{alpha}'" in body["error"], body
                status, body = await put("unbound", a_prefill)
                assert status == 503 and body["reason"] == "auth_unavailable", body
            assert sorted(a.pod_name for a in servers["alpha"].registry.engines()) == \
                [a_decode, a_prefill]
            assert len(servers["unbound"].registry) == 0
        finally:
            for s in servers.values():
                await s.stop()

    async with asyncio.timeout(60):
        await scenario()
