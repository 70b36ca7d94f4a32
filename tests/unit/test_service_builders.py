"""The router and rendezvous children (operator/service_builders.py), and the rendezvous auth they carry."""
from __future__ import annotations

import pytest

from disagg.operator import names
from disagg.operator.builders import OperatorImages, build_children, endpoint_url
from disagg.operator.profiles import CPU_ENGINES_LABEL
from support.crs import UID, child, engine, env_of, make_cr, pod, statefulset


def test_router_and_rendezvous():
    cr = make_cr({"router": {"replicas": 2, "serviceType": "LoadBalancer", "port": 80},
                  "rendezvous": {"heartbeatSeconds": 7}})
    children = build_children(cr, images=OperatorImages("img:1"))
    router = child(children, "Deployment", "qwen-router")
    assert router["spec"]["replicas"] == 2
    # An operator upgrade rolls the routers: a new one Ready before an old one stops.
    assert router["spec"]["strategy"] == {"type": "RollingUpdate",
                                          "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    [c] = router["spec"]["template"]["spec"]["containers"]
    assert c["image"] == "img:1"
    assert c["command"] == ["disagg", "router", "--mode", "push", "--rendezvous",
                            "http://qwen-rendezvous.ml.svc:8080", "--port", "8000", "--pair-wait-seconds", "30",
                            "--stop-delay-seconds", "5", "--drain-seconds", "60", "--max-inflight", "1024",
                            "--max-inflight-per-engine", "256", "--max-queue", "256", "--queue-wait-seconds", "1",
                            "--served-model-name", "Qwen/Qwen3-32B", "--access-log", "-"]
    # SIGTERM: 5 s more of serving while the Service's endpoints catch up, 60 s for the requests in flight, and the
    # kubelet's SIGKILL only after both.
    assert router["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 75
    # Ready once it knows the engines, pair or not: an unready router would take the Service's endpoint away.
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    # Liveness never depends on the engines: a router restarted while they start would not help them.
    assert c["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert c["resources"]["requests"] == {"cpu": "100m", "memory": "128Mi"}
    svc = child(children, "Service", "qwen-router")["spec"]
    assert svc["type"] == "LoadBalancer"
    assert svc["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]
    assert endpoint_url(cr) == "http://qwen-router.ml.svc:80"

    quiet = build_children(make_cr({"router": {"accessLog": False}}), images=OperatorImages("img:1"))
    [c] = child(quiet, "Deployment", "qwen-router")["spec"]["template"]["spec"]["containers"]
    assert "--access-log" not in c["command"]

    rdv = child(children, "Deployment", "qwen-rendezvous")
    assert rdv["spec"]["replicas"] == 1 and rdv["spec"]["strategy"] == {"type": "Recreate"}
    [c] = rdv["spec"]["template"]["spec"]["containers"]
    assert c["command"][:4] == ["disagg", "rendezvous", "--port", "8080"]
    assert c["command"][4:6] == ["--heartbeat-seconds", "7"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    svc = child(children, "Service", "qwen-rendezvous")["spec"]
    assert svc["type"] == "ClusterIP" and svc["ports"][0]["port"] == 8080

def test_the_router_gets_its_overload_bounds_from_the_cr_and_its_defaults_are_the_routers_own():
    import argparse

    from disagg.connector.router import flags

    cr = make_cr({"router": {"maxInflight": 0, "maxInflightPerEngine": 8, "maxQueue": 3, "queueWaitSeconds": 0.25}})
    [c] = child(build_children(cr), "Deployment", "qwen-router")["spec"]["template"]["spec"]["containers"]
    command = c["command"]
    assert [command[command.index(f) + 1] for f in ("--max-inflight", "--max-inflight-per-engine", "--max-queue",
                                                   "--queue-wait-seconds")] == ["0", "8", "3", "0.25"]
    p = argparse.ArgumentParser()
    flags.add_arguments(p)
    ours = p.parse_args(command[2:])  # what the router makes of it
    assert (ours.max_inflight, ours.max_inflight_per_engine, ours.max_queue, ours.queue_wait_seconds) == (0, 8, 3, 0.25)
    default = make_cr().spec.router
    assert (default.max_inflight, default.max_inflight_per_engine, default.max_queue, default.queue_wait_seconds) == \
        (flags.DEFAULT_MAX_INFLIGHT, flags.DEFAULT_MAX_INFLIGHT_PER_ENGINE, flags.DEFAULT_MAX_QUEUE,
         flags.DEFAULT_QUEUE_WAIT_SECONDS)


def test_a_prefix_aware_cr_tells_its_routers_and_a_least_loaded_one_leaves_their_command_as_it_was():
    import argparse

    from disagg.connector.router import flags

    def command(router: dict) -> list[str]:
        [c] = child(build_children(make_cr({"router": router})), "Deployment", "qwen-router")["spec"]["template"][
            "spec"]["containers"]
        return c["command"]

    default = command({})
    assert "--policy" not in default and command({"policy": "least-loaded"}) == default
    aware = command({"policy": "prefix-aware"})
    i = aware.index("--policy")
    assert aware[i:i + 8] == ["--policy", "prefix-aware", "--prefill-hit-weight", "1", "--decode-hit-weight", "0.5",
                              "--decode-only-share", "0.9"]
    assert aware[:i] + aware[i + 8:] == default  # nothing else changes
    p = argparse.ArgumentParser()
    flags.add_arguments(p)
    assert p.parse_args(aware[2:]).policy == "prefix-aware" and p.parse_args(default[2:]).policy == "least-loaded"
    # The CRD's bounds are the router's: whatever admission accepts, the router starts with.
    for prefix in ({"prefillHitWeight": 0, "decodeHitWeight": 1000, "decodeOnlyShare": 2},
                   {"prefillHitWeight": 2.5, "decodeHitWeight": 0, "decodeOnlyShare": 0.01}):
        args = p.parse_args(command({"policy": "prefix-aware", "prefix": prefix})[2:])
        assert (args.prefill_hit_weight, args.decode_hit_weight, args.decode_only_share) == \
            (prefix["prefillHitWeight"], prefix["decodeHitWeight"], prefix["decodeOnlyShare"])
    for bad in ({"prefillHitWeight": -1}, {"decodeHitWeight": 1001}, {"decodeOnlyShare": 0}, {"decodeOnlyShare": 3}):
        with pytest.raises(ValueError):
            make_cr({"router": {"policy": "prefix-aware", "prefix": bad}})


@pytest.mark.parametrize("router", [{"maxInflight": -1}, {"maxQueue": "many"}, {"queueWaitSeconds": 3601},
                                    {"maxInflightPerEngine": 1.5}])
def test_junk_overload_bounds_are_refused(router):
    with pytest.raises(ValueError):
        make_cr({"router": router})


def test_rendezvous_auth_kubernetes_is_the_default():
    """Engines present their pod's projected ServiceAccount token; the rendezvous, as its own ServiceAccount bound
    to system:auth-delegator, verifies it with a TokenReview. No shared Secret anywhere."""
    cr = make_cr()
    assert cr.spec.rendezvous.auth == "kubernetes"
    children = build_children(cr)
    rdv = child(children, "Deployment", "qwen-rendezvous")["spec"]["template"]["spec"]
    [c] = rdv["containers"]
    assert c["command"] == ["disagg", "rendezvous", "--port", "8080", "--heartbeat-seconds", "5", "--auth",
                            "kubernetes", "--deployment", "qwen"]
    assert c["env"] == [{"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}]
    assert rdv["serviceAccountName"] == "qwen-rendezvous" and rdv["automountServiceAccountToken"] is True

    sa = child(children, "ServiceAccount", "qwen-rendezvous")
    assert sa["metadata"]["namespace"] == "ml" and sa["metadata"]["ownerReferences"][0]["uid"] == UID
    binding = child(children, "ClusterRoleBinding", "disagg-rendezvous:ml:qwen")
    assert "namespace" not in binding["metadata"] and "ownerReferences" not in binding["metadata"], \
        "cluster-scoped: a namespaced CR cannot own it (the operator removes it, see reconciler.collect_bindings)"
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": "system:auth-delegator"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "qwen-rendezvous", "namespace": "ml"}]
    assert binding["metadata"]["labels"] == {**names.labels("qwen", "rendezvous"), "serving.disagg.io/namespace": "ml"}
    assert binding["metadata"]["annotations"] == {"serving.disagg.io/owner": "ml/qwen",
                                                  "serving.disagg.io/owner-uid": UID}
    # Applied before the Deployment whose pods run as the ServiceAccount.
    order = [(o["kind"], o["metadata"]["name"]) for o in children]
    assert order.index(("ServiceAccount", "qwen-rendezvous")) < order.index(("Deployment", "qwen-rendezvous"))
    assert order.index(("ClusterRoleBinding", "disagg-rendezvous:ml:qwen")) < \
        order.index(("Deployment", "qwen-rendezvous"))

    for role in ("prefill", "decode"):
        eng, spec = engine(children, role), pod(children, role)["spec"]
        env = env_of(eng)
        assert env["DISAGG_RENDEZVOUS_TOKEN_FILE"] == "/var/run/secrets/disagg/rendezvous/token"
        assert "DISAGG_RENDEZVOUS_TOKEN" not in env
        [volume] = [v for v in spec["volumes"] if v["name"] == "rendezvous-token"]
        assert volume["projected"] == {"sources": [{"serviceAccountToken": {
            "audience": "disagg-rendezvous", "expirationSeconds": 3600, "path": "token"}}]}
        assert {"name": "rendezvous-token", "mountPath": "/var/run/secrets/disagg/rendezvous", "readOnly": True} \
            in eng["volumeMounts"]
        assert spec["automountServiceAccountToken"] is False, "engines never get an API-server token"
    assert not [o for o in children if o["kind"] == "Secret"]

def test_the_engines_token_audience_is_the_one_the_rendezvous_checks():
    from disagg.connector.rendezvous.auth import pod_name_pattern

    # The StatefulSets' pods are the names the rendezvous accepts.
    children = build_children(make_cr({"prefill": {"replicas": 2}}))
    for role in ("prefill", "decode"):
        sts = statefulset(children, role)["metadata"]["name"]
        assert pod_name_pattern("qwen").match(f"{sts}-0") and pod_name_pattern("qwen").match(f"{sts}-1")
    assert not pod_name_pattern("qwen").match("qwen-router-0")
    assert pod_name_pattern("qwen").match("qwen-decode-1"), "pods made before revisions still register"

def test_rendezvous_auth_token_uses_the_shared_secret():
    children = build_children(make_cr({"rendezvous": {"auth": "token"}}))
    rdv = child(children, "Deployment", "qwen-rendezvous")["spec"]["template"]["spec"]
    [c] = rdv["containers"]
    assert c["command"][-4:] == ["--auth", "token", "--deployment", "qwen"]
    token_ref = {"name": "DISAGG_RENDEZVOUS_TOKEN",
                 "valueFrom": {"secretKeyRef": {"name": "qwen-rendezvous-token", "key": "token"}}}
    assert c["env"] == [token_ref]
    assert "serviceAccountName" not in rdv and rdv["automountServiceAccountToken"] is False
    for role in ("prefill", "decode"):
        eng = engine(children, role)
        assert token_ref in eng["env"], "engines present the same token for their writes"
        assert "DISAGG_RENDEZVOUS_TOKEN_FILE" not in env_of(eng)
        assert "rendezvous-token" not in [v["name"] for v in pod(children, role)["spec"]["volumes"]]
    assert not [o for o in children if o["kind"] in ("ServiceAccount", "ClusterRoleBinding")]

def test_rendezvous_binding_names_are_unambiguous_and_bounded():
    # A dash would let namespace "a-b" with CR "c" collide with namespace "a" with CR "b-c".
    assert names.rendezvous_binding_name("a-b", "c") != names.rendezvous_binding_name("a", "b-c")
    assert names.rendezvous_binding_name("ml", "qwen") == "disagg-rendezvous:ml:qwen"
    ns, long = "n" * 63, "x" * 253
    name = names.rendezvous_binding_name(ns, long)
    assert len(name) == 253 and name.startswith(f"disagg-rendezvous:{ns}:xxx")
    assert name != names.rendezvous_binding_name(ns, long[:-1] + "y"), "the hash covers the whole name"

def test_rendezvous_auth_rejects_other_values():
    with pytest.raises(Exception, match="auth"):
        make_cr({"rendezvous": {"auth": "none"}})


def test_cpu_profile_router_and_rendezvous_may_run_on_the_cpu_engine_nodes():
    """On a small cluster the CPU-engine nodes may be the only ones that run containers, so the router and the
    rendezvous get the engines' node selector and toleration; accelerator profiles keep them off those nodes."""
    cpu = make_cr({"prefill": {"tensorParallelSize": 1}, "decode": {"tensorParallelSize": 1}}, profile="cpu")
    children = build_children(cpu)
    engine_spec = pod(children, "prefill")["spec"]
    for name in ("qwen-router", "qwen-rendezvous"):
        spec = child(children, "Deployment", name)["spec"]["template"]["spec"]
        assert spec["nodeSelector"] == {CPU_ENGINES_LABEL: "true"} == engine_spec["nodeSelector"]
        assert spec["tolerations"] == [{"key": CPU_ENGINES_LABEL, "operator": "Exists", "effect": "NoSchedule"}]
    for name in ("qwen-router", "qwen-rendezvous"):
        spec = child(build_children(make_cr()), "Deployment", name)["spec"]["template"]["spec"]
        assert "nodeSelector" not in spec and "tolerations" not in spec, name
