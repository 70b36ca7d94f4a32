"""A push-mode DisaggregatedInference, applied as a user would, served by the operator's own pods on the real node:
the operator from its chart, the rendered engine pods (launch script, preflight, plugin init container, projected
token), the router and rendezvous Deployments and their Services. One CR for the module: two engines are what
two cores hold.

Day-2 operations are made for real under a steady request stream, and none may fail a request: `kubectl delete
pod` (SIGTERM and the grace period) of the decode, the prefill, a router (of two), the rendezvous and the operator;
a node drain of the engine pods; and `helm upgrade` of the operator to a new image and a new flag. Each engine role
has one replica here (two engines are what two cores hold), so requests wait for the replacement engine within the
router's pair wait. Only a crash (a force delete: SIGKILL) may fail requests, and only the one in flight on the
crashed engine, fast and with a clean error.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest
from lightkube.resources.core_v1 import ConfigMap, Pod

from disagg.operator import names
from support.dinf import revision
from support.engines import Load, check_outputs, completion, metric
from support.kube import pod_ready, watch_until
from support.node import Deployed, deploy, deployed_kv, transport_verdict

pytestmark = [pytest.mark.cluster, pytest.mark.node, pytest.mark.engines]

FAIL_FAST_SECONDS = 30.0
"""A request in flight on a deleted engine must fail within this, never hang."""


@pytest.fixture(scope="module")
def push(cluster, real_node, operator_release, module_namespace, reference) -> Deployed:
    # Requests wait for a pair while the decode restarts (vLLM takes a minute to start on a shared core).
    # Two routers: deleting one loses nothing while the other serves.
    return deploy(cluster, real_node, module_namespace, "tiny-push", "push",
                  router={"pairWaitSeconds": 240, "replicas": 2})


def engine_pod(cluster, d: Deployed, role: str) -> Pod:
    (pod,) = cluster.client.list(Pod, namespace=d.namespace, labels={
        names.LABEL_INSTANCE: d.name, names.LABEL_COMPONENT: role})
    return pod


def test_engines_run_as_pods_on_the_node_and_the_transport_is_verified(cluster, real_node, push):
    for role in ("prefill", "decode"):
        pod = engine_pod(cluster, push, role)
        assert pod.spec.nodeName == real_node.name and pod_ready(pod)
        assert [s.state.terminated.exitCode for s in pod.status.initContainerStatuses] == [0]  # install-plugin
    verified = transport_verdict(cluster, push)
    assert (verified["status"], verified["reason"]) == ("True", "TransportMatches"), verified


def test_greedy_outputs_through_the_router_service_equal_a_single_engines(push, reference):
    check_outputs(push.router_url, reference, deployed_kv(push, "push"))


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def test_logprobs_and_sampled_requests_are_served_by_the_engine_pods(push):
    """vLLM's CPU sampler compiles kernels with torch inductor for logprobs and top-k/top-p on first use: the engine
    image must hold the compiler they need, or the engine core dies on the first such request."""
    body = {**completion("the engine image holds a compiler"), "logprobs": 2}
    answer = _post(push.router_url + "/v1/completions", body)["choices"][0]
    tops = answer["logprobs"]["top_logprobs"]
    assert len(tops) == body["max_tokens"] and all(len(t) == 2 for t in tops), tops
    assert "".join(max(t, key=t.get) for t in tops) == answer["text"]  # greedy: each token is its step's top one
    sampled = {**completion("sampled, not greedy"), "temperature": 0.8, "top_k": 5, "top_p": 0.9, "seed": 7}
    assert len(_post(push.router_url + "/v1/completions", sampled)["choices"][0]["text"]) > 0


def _advertised(d: Deployed) -> dict[str, dict]:
    with urllib.request.urlopen(d.rendezvous_url + "/v1/engines", timeout=10) as r:
        return {e["engine_id"]: e for e in json.load(r)["engines"]}


def test_a_pod_bound_token_of_another_deployments_pod_is_refused(cluster, real_node, push, namespace):
    from disagg.connector.wire.env import TOKEN_AUDIENCE
    from support.tools import kubectl

    intruder = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "intruder"}, "spec": {
        **_node_placement(), "terminationGracePeriodSeconds": 1,
        "containers": [{"name": "main", "image": real_node.images["python"], "imagePullPolicy": "Never",
                        "command": ["sleep", "3600"],
                        "volumeMounts": [{"name": "token", "mountPath": "/var/run/token", "readOnly": True}]}],
        "volumes": [{"name": "token", "projected": {"sources": [{"serviceAccountToken": {
            "audience": TOKEN_AUDIENCE, "expirationSeconds": 3600, "path": "token"}}]}}]}}
    from lightkube import codecs
    cluster.client.create(codecs.from_dict(intruder), namespace=namespace)
    watch_until(cluster, Pod, "intruder", pod_ready, namespace=namespace, timeout=60, what="Ready")
    token = kubectl("exec", "-n", namespace, "intruder", "--", "cat", "/var/run/token/token", cluster=cluster).stdout
    (engine_id, adv), *_ = _advertised(push).items()
    req = urllib.request.Request(f"{push.rendezvous_url}/v1/engines/{engine_id}", method="PUT",
                                 data=json.dumps(adv).encode(),
                                 headers={"Authorization": f"Bearer {token.strip()}",
                                          "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=10)
    assert refused.value.code == 403, refused.value.read()
    assert _advertised(push)[engine_id] == adv


def _node_placement() -> dict:
    from disagg.operator.profiles import CPU_ENGINES_LABEL, CPU_ENGINES_TAINT, CPU_ENGINES_VALUE

    return {"nodeSelector": {CPU_ENGINES_LABEL: CPU_ENGINES_VALUE},
            "tolerations": [{**CPU_ENGINES_TAINT, "operator": "Equal"}]}


def _delete_pod(cluster, namespace: str, name: str) -> None:
    cluster.client.delete(Pod, name, namespace=namespace)


class Stream(Load):
    """The steady request stream, with each request's duration."""

    def run(self) -> None:
        from support.engines import post

        while not self.halt.is_set():
            start = time.monotonic()
            try:
                status, resp = post(self.url, self.body, timeout=300)
            except OSError as e:  # refused, reset or timed out: a failed request as a client sees it
                status, resp = 0, repr(e)
            with self._done:
                self.results.append((status, f"{time.monotonic() - start:.1f}s {'' if status == 200 else resp}"))
                self._done.notify_all()


def _failures(results: list[tuple[int, str]]) -> list[tuple[int, str]]:
    return [r for r in results if r[0] != 200]


def test_deleting_the_decode_pod_deregisters_its_engine_and_serving_resumes(cluster, push):
    old = engine_pod(cluster, push, "decode")
    old_ids = set(_advertised(push))
    deregistered = metric(push.rendezvous_url, "disagg_rendezvous_deregistrations_total")
    expired = metric(push.rendezvous_url, "disagg_rendezvous_expiries_total")
    load = Stream(push.router_url + "/v1/completions", completion("steady stream " * 20))
    load.start()
    try:
        load.await_results(3)
        _delete_pod(cluster, push.namespace, old.metadata.name)
        new = watch_until(cluster, Pod, old.metadata.name,
                          lambda p: p.metadata.uid != old.metadata.uid and pod_ready(p),
                          namespace=push.namespace, timeout=300, what="replaced and Ready")
        new_id = _await_new_engine(push, old_ids)
        served = len(load.results)
        load.await_results(served + 5, timeout=120)
    finally:
        results = load.stop()
    assert new.metadata.uid != old.metadata.uid and new_id not in old_ids
    assert metric(push.rendezvous_url, "disagg_rendezvous_deregistrations_total") >= deregistered + 1
    assert metric(push.rendezvous_url, "disagg_rendezvous_expiries_total") == expired
    # The decode finished what it held and left the rendezvous first; the requests sent meanwhile waited for
    # the new decode.
    assert _failures(results) == []


def test_deleting_the_prefill_pod_fails_no_request(cluster, push):
    old = engine_pod(cluster, push, "prefill")
    old_ids = set(_advertised(push))
    load = Stream(push.router_url + "/v1/completions", completion("steady stream " * 20))
    load.start()
    try:
        load.await_results(3)
        _delete_pod(cluster, push.namespace, old.metadata.name)
        watch_until(cluster, Pod, old.metadata.name, lambda p: p.metadata.uid != old.metadata.uid and pod_ready(p),
                    namespace=push.namespace, timeout=300, what="replaced and Ready")
        _await_new_engine(push, old_ids)
        load.await_results(len(load.results) + 5, timeout=120)
    finally:
        results = load.stop()
    assert _failures(results) == []


def test_deleting_a_router_pod_fails_no_request(cluster, push):
    """Two routers behind the Service: the deleted one turns unready, serves through its stop delay, drains what
    it holds and goes; the other takes every new connection."""
    routers = cluster.client.list(Pod, namespace=push.namespace, labels={
        names.LABEL_INSTANCE: push.name, names.LABEL_COMPONENT: names.ROUTER})
    old = sorted(routers, key=lambda p: p.metadata.name)[0]
    load = Stream(push.router_url + "/v1/completions", completion("steady stream " * 20))
    load.start()
    try:
        load.await_results(3)
        _delete_pod(cluster, push.namespace, old.metadata.name)
        _await_replacement(cluster, push.namespace, names.ROUTER, push.name, old.metadata.uid)
        watch_until(cluster, Pod, old.metadata.name, lambda p: False, namespace=push.namespace, timeout=120,
                    what="gone", gone_ok=True)
        load.await_results(len(load.results) + 5, timeout=120)
    finally:
        results = load.stop()
    assert _failures(results) == []


def test_draining_the_engine_pods_off_the_node_fails_no_request(cluster, real_node, push):
    """`kubectl drain` (the eviction API, which the operator's PodDisruptionBudgets admit one pod per role at a
    time) of this deployment's engine pods; the node stays cordoned until both are evicted, so for a while no
    engine runs at all, and requests wait for the pair wait. Only the engine pods are drained: on this one-node
    bed the router's pods live on the same node, where a deployment spread over many nodes keeps them."""
    from support.tools import kubectl

    old = {role: engine_pod(cluster, push, role) for role in ("prefill", "decode")}
    old_ids = set(_advertised(push))
    selector = f"{names.LABEL_INSTANCE}={push.name},{names.LABEL_COMPONENT} in (prefill,decode)"
    load = Stream(push.router_url + "/v1/completions", completion("steady stream " * 20))
    load.start()
    try:
        load.await_results(3)
        try:
            kubectl("drain", real_node.name, "--pod-selector", selector, "--ignore-daemonsets",
                    "--delete-emptydir-data", "--timeout", "240s", cluster=cluster, timeout=300)
        finally:
            kubectl("uncordon", real_node.name, cluster=cluster)
        for role, pod in old.items():
            watch_until(cluster, Pod, pod.metadata.name,
                        lambda p, uid=pod.metadata.uid: p.metadata.uid != uid and pod_ready(p),
                        namespace=push.namespace, timeout=300, what=f"the {role} back and Ready")
        _await_new_engine(push, old_ids)
        load.await_results(len(load.results) + 5, timeout=120)
    finally:
        results = load.stop()
    assert _failures(results) == []


def test_a_crashed_decode_fails_at_most_the_request_it_held_and_fast(cluster, push):
    """A force delete kills the decode without a grace period (SIGKILL): only the request in flight on it may fail,
    within seconds and with an error answer, never a hang; the requests after it wait for the new decode."""
    old = engine_pod(cluster, push, "decode")
    old_ids = set(_advertised(push))
    load = Stream(push.router_url + "/v1/completions", completion("steady stream " * 20))
    load.start()
    try:
        load.await_results(3)
        cluster.client.delete(Pod, old.metadata.name, namespace=push.namespace, grace_period=0)
        watch_until(cluster, Pod, old.metadata.name, lambda p: p.metadata.uid != old.metadata.uid and pod_ready(p),
                    namespace=push.namespace, timeout=300, what="replaced and Ready")
        _await_new_engine(push, old_ids)
        load.await_results(len(load.results) + 5, timeout=120)
    finally:
        results = load.stop()
    failed = _failures(results)
    assert len(failed) <= 1, failed  # the Stream sends one request at a time: at most one was in flight
    assert all(status >= 500 and float(msg.split("s ")[0]) < FAIL_FAST_SECONDS for status, msg in failed), failed


def _await_new_engine(d: Deployed, old_ids: set[str], timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = set(_advertised(d))
        fresh = now - old_ids
        if fresh and len(now) == 2:
            return fresh.pop()
        time.sleep(0.5)  # the rendezvous is another process; its watch is what the router follows
    raise TimeoutError(f"no new engine advertised in {timeout}s: {_advertised(d).keys()}")


def test_deleting_the_rendezvous_pod_fails_no_request(cluster, push):
    (old,) = cluster.client.list(Pod, namespace=push.namespace, labels={
        names.LABEL_INSTANCE: push.name, names.LABEL_COMPONENT: names.RENDEZVOUS})
    load = Stream(push.router_url + "/v1/completions", completion("steady stream " * 20))
    load.start()
    try:
        load.await_results(3)
        _delete_pod(cluster, push.namespace, old.metadata.name)
        _await_replacement(cluster, push.namespace, names.RENDEZVOUS, push.name, old.metadata.uid)
        _await_engines(push, 2)
        load.await_results(len(load.results) + 5, timeout=120)
    finally:
        results = load.stop()
    assert _failures(results) == []


def _await_replacement(cluster, namespace: str, component: str, instance: str, old_uid: str,
                       timeout: float = 180) -> Pod:
    from support.kube import watch_list_until

    return watch_list_until(cluster, Pod, lambda p: p.metadata.uid != old_uid and pod_ready(p) and
                            (p.metadata.labels or {}).get(names.LABEL_COMPONENT) == component and
                            (p.metadata.labels or {}).get(names.LABEL_INSTANCE) == instance and
                            p.metadata.deletionTimestamp is None,
                            namespace=namespace, timeout=timeout, what=f"a new Ready {component} pod")


def _await_engines(d: Deployed, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = _advertised(d)
            if len(last) == n:  # type: ignore[arg-type]
                return
        except OSError as e:
            last = e
        time.sleep(0.5)  # another process's state: nothing to await
    raise TimeoutError(f"{n} engines not advertised in {timeout}s: {last}")


def test_deleting_the_operator_pod_fails_no_request_and_it_converges_again(cluster, push, operator_release):
    (old,) = cluster.client.list(Pod, namespace=operator_release.namespace)
    load = Stream(push.router_url + "/v1/completions", completion("steady stream " * 20))
    load.start()
    try:
        load.await_results(3)
        _delete_pod(cluster, operator_release.namespace, old.metadata.name)
        watch_until(cluster, Pod, old.metadata.name, lambda p: False, namespace=operator_release.namespace,
                    timeout=60, what="gone", gone_ok=True)
        # Converges: a child removed while no operator ran is put back by the new one.
        launch = names.launch_configmap_name(push.name, revision(cluster, push.namespace, push.name))
        cluster.client.delete(ConfigMap, launch, namespace=push.namespace)
        watch_until(cluster, ConfigMap, launch, lambda _cm: True, namespace=push.namespace, timeout=180,
                    what="recreated")
        load.await_results(len(load.results) + 5, timeout=120)
    finally:
        results = load.stop()
    assert _failures(results) == []


def test_upgrading_the_operator_to_a_new_image_and_flag_changes_no_engine_and_fails_no_request(
        cluster, real_node, push, operator_release):
    """`helm upgrade` of the operator to another image (the same build under a second tag, as a new release's
    image would be) and a new flag value. Engines keep their pods: they take the new plugin at their next rollout.
    The router and the rendezvous run the operator's image and roll to it, a new router Ready before an old one
    stops."""
    from lightkube.resources.apps_v1 import Deployment, StatefulSet

    from disagg.operator.merge import deep_merge

    repository = real_node.images["disagg"].rsplit(":", 1)[0]
    upgraded = deep_merge(operator_release.values, {"image": {"operator": {"tag": "dev"}},
                                                    "operator": {"resyncSeconds": 31}})
    engines = {p.metadata.name: p.metadata.uid for role in ("prefill", "decode")
               for p in [engine_pod(cluster, push, role)]}
    sets = {s.metadata.name: s.metadata.generation for s in cluster.client.list(
        StatefulSet, namespace=push.namespace, labels={names.LABEL_INSTANCE: push.name})}

    def rolled(deployment) -> bool:
        st = deployment.status
        return (deployment.spec.template.spec.containers[0].image == f"{repository}:dev" and st is not None
                and st.observedGeneration == deployment.metadata.generation
                and st.updatedReplicas == st.replicas == st.readyReplicas == deployment.spec.replicas)

    load = Stream(push.router_url + "/v1/completions", completion("steady stream " * 20))
    load.start()
    try:
        load.await_results(3)
        operator_release.upgrade(cluster, upgraded)
        for deployment in (names.router_name(push.name), names.rendezvous_name(push.name)):
            watch_until(cluster, Deployment, deployment, rolled, namespace=push.namespace, timeout=300,
                        what=f"{deployment} on the new image")
        _await_engines(push, 2)
        load.await_results(len(load.results) + 5, timeout=120)
    finally:
        results = load.stop()
        operator_release.upgrade(cluster, operator_release.values)
    assert _failures(results) == []
    assert {p.metadata.name: p.metadata.uid for role in ("prefill", "decode")
            for p in [engine_pod(cluster, push, role)]} == engines
    assert {s.metadata.name: s.metadata.generation for s in cluster.client.list(
        StatefulSet, namespace=push.namespace, labels={names.LABEL_INSTANCE: push.name})} == sets
