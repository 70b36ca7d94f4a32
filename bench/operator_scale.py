"""Operator scale benchmark: 100 DisaggregatedInference objects on a 200-node kwok cluster.

Reports, as JSON (stdout and bench/results/operator_scale.json):
- create → all 11 children exist, per CR (p50/p99);
- create → Ready=True, per CR (p50/p99), and the time until every CR is Ready;
- API requests the operator made per CR, counted from the apiserver's audit log (the operator runs as its
  own user, so no client-side counting is trusted);
- operator CPU seconds and peak RSS;
- requests and writes during an idle resync pass (should be no writes).

Run: `python bench/operator_scale.py [--crs 100] [--fleet p5en=120,trn2=60,trn1=10,m7i=10]`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

from lightkube import AsyncClient, Client, KubeConfig, codecs
from lightkube.generic_resource import create_namespaced_resource
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.apps_v1 import Deployment, StatefulSet
from lightkube.resources.core_v1 import ConfigMap, Namespace, Service
from lightkube.resources.policy_v1 import PodDisruptionBudget

from disagg.devcluster import build
from disagg.devcluster.cluster import ClusterConfig, LocalCluster, die_with_parent, free_port
from disagg.devcluster.fleet import FleetSpec
from disagg.operator import api, crdgen

RESULTS = Path(__file__).resolve().parent / "results"
Dinf = create_namespaced_resource(api.GROUP, api.VERSION, api.KIND, api.PLURAL)
CHILD_KINDS = (StatefulSet, Deployment, Service, ConfigMap, PodDisruptionBudget)
CHILDREN_PER_CR = 11
NAMESPACES = 10


def cr_manifest(i: int) -> dict:
    trn = i % 5 == 4  # one in five on Trainium2
    spec = {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct" if trn else "Qwen/Qwen3-32B"},
            "accelerator": {"profile": "trainium2" if trn else "nvidia-h200"},
            "prefill": {"tensorParallelSize": 32 if trn else 4}, "decode": {"tensorParallelSize": 32 if trn else 4}}
    if trn:
        spec["kvTransfer"] = {"mode": "pull"}
    return {"apiVersion": f"{api.GROUP}/{api.VERSION}", "kind": api.KIND,
            "metadata": {"name": f"m{i:03d}", "namespace": f"bench-{i % NAMESPACES}"}, "spec": spec}


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))], 3)


async def observe(kubeconfig: Path, created: dict[tuple[str, str], float], n: int, timeout: float):
    """Watch children and CRs; record when each CR has all children and when it turns Ready."""
    client = AsyncClient(KubeConfig.from_file(kubeconfig))
    children: dict[tuple[str, str], set] = {}
    complete: dict[tuple[str, str], float] = {}
    ready: dict[tuple[str, str], float] = {}
    done = asyncio.Event()

    async def watch_children(kind):
        managed = {"app.kubernetes.io/managed-by": "disagg-operator"}
        async for op, obj in client.watch(kind, namespace="*", labels=managed):
            key = (obj.metadata.namespace, obj.metadata.labels.get("app.kubernetes.io/instance"))
            if op == "ADDED":
                children.setdefault(key, set()).add((kind.__name__, obj.metadata.name))
                if len(children[key]) == CHILDREN_PER_CR and key not in complete:
                    complete[key] = time.monotonic()

    async def watch_crs():
        async for _op, obj in client.watch(Dinf, namespace="*"):
            key = (obj.metadata.namespace, obj.metadata.name)
            conds = (obj.status or {}).get("conditions", [])
            if key not in ready and any(c["type"] == "Ready" and c["status"] == "True" for c in conds):
                ready[key] = time.monotonic()
                if len(ready) == n:
                    done.set()

    tasks = [asyncio.create_task(watch_children(k)) for k in CHILD_KINDS] + [asyncio.create_task(watch_crs())]
    waiter = asyncio.create_task(done.wait())
    try:
        finished, _ = await asyncio.wait([waiter, *tasks], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if waiter not in finished:
            failed = [t for t in finished if t.exception()]
            raise RuntimeError(f"observation ended early: {failed[0].exception()!r}" if failed else
                               f"not all {n} CRs Ready within {timeout}s ({len(ready)} were)")
    finally:
        waiter.cancel()
        for t in tasks:
            t.cancel()
        await client.close()
    return complete, ready


def snapshot(client: Client) -> dict[tuple[str, str, str], str]:
    """resourceVersion of every CR and every child, by (kind, namespace, name)."""
    out = {}
    for kind in (Dinf, *CHILD_KINDS):
        for obj in client.list(kind, namespace="*"):
            if kind is Dinf or (obj.metadata.labels or {}).get("app.kubernetes.io/managed-by") == "disagg-operator":
                out[(kind.__name__, obj.metadata.namespace, obj.metadata.name)] = obj.metadata.resourceVersion
    return out


def proc_usage(pid: int) -> tuple[float, int]:
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
    hwm = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
               if line.startswith("VmHWM"))
    return round(cpu, 2), hwm // 1024


def audit_counts(log: Path, user: str, since: float = 0.0) -> Counter:
    counts: Counter = Counter()
    with log.open() as f:
        for line in f:
            ev = json.loads(line)
            if ev.get("user", {}).get("username") != user:
                continue
            ts = ev.get("stageTimestamp") or ev.get("requestReceivedTimestamp")
            if since and _epoch(ts) < since:
                continue
            counts[ev["verb"]] += 1
    return counts


def _epoch(ts: str) -> float:
    import datetime as dt
    return dt.datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--crs", type=int, default=100)
    p.add_argument("--fleet", default="p5en=120,trn2=60,trn1=10,m7i=10")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--resync-seconds", type=float, default=60)
    args = p.parse_args()

    build.ensure_built(quiet=True)
    cluster = LocalCluster(ClusterConfig(name="bench-scale", fleet=FleetSpec.parse(args.fleet), audit=True,
                                         startup_timeout=300))
    cluster.start(progress=lambda m: print(m, file=sys.stderr, flush=True))
    operator = None
    try:
        client = Client(KubeConfig.from_file(cluster.kubeconfig))
        client.create(codecs.from_dict(crdgen.crd()))
        for i in range(NAMESPACES):
            client.create(Namespace(metadata=ObjectMeta(name=f"bench-{i}")))
        subprocess.run([str(cluster.bin / "kubectl"), f"--kubeconfig={cluster.kubeconfig}", "wait",
                        "--for=condition=Established", f"crd/{api.PLURAL}.{api.GROUP}"], check=True,
                       stdout=subprocess.DEVNULL)
        health, metrics_port = free_port(), free_port()
        op_log = cluster.dir / "logs" / "operator.log"
        operator = subprocess.Popen(
            [str(Path(sys.executable).parent / "disagg"), "operator", "--metrics-port", str(metrics_port),
             "--liveness", f"http://127.0.0.1:{health}/healthz", "--resync-seconds", str(args.resync_seconds)],
            env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig_for("disagg-operator"))},
            stdout=op_log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=die_with_parent)
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{health}/healthz", timeout=1)
                break
            except OSError as e:
                if time.monotonic() > deadline or operator.poll() is not None:
                    raise SystemExit(f"operator did not start; see {op_log}") from e
                time.sleep(0.2)
        startup_requests = sum(audit_counts(cluster.audit_log, "disagg-operator").values())

        created: dict[tuple[str, str], float] = {}

        async def run() -> tuple[dict, dict]:
            obs = asyncio.create_task(observe(cluster.kubeconfig, created, args.crs, args.timeout))
            await asyncio.sleep(0.5)  # let the watches open before the first create
            t0 = time.monotonic()
            for i in range(args.crs):
                m = cr_manifest(i)
                created[(m["metadata"]["namespace"], m["metadata"]["name"])] = time.monotonic()
                client.create(codecs.from_dict(m))
            print(f"created {args.crs} CRs in {time.monotonic() - t0:.1f}s", file=sys.stderr, flush=True)
            return await obs

        t_start = time.monotonic()
        complete, ready = asyncio.run(run())
        all_ready = max(ready.values()) - t_start
        cpu, rss = proc_usage(operator.pid)
        burst = audit_counts(cluster.audit_log, "disagg-operator")
        burst_total = sum(burst.values()) - startup_requests

        # One idle resync window: the requests it makes, and the objects it changes (expected: none). A no-op
        # server-side apply is a PATCH request but not a write, so changes are counted by resourceVersion.
        before = snapshot(client)
        idle_from = time.time()
        time.sleep(args.resync_seconds + 5)
        idle = audit_counts(cluster.audit_log, "disagg-operator", since=idle_from)
        after = snapshot(client)
        changed = sorted(k for k in before if after.get(k) != before[k])
        to_children = [complete[k] - created[k] for k in created if k in complete]
        to_ready = [ready[k] - created[k] for k in created if k in ready]
        result = {
            "benchmark": "operator_scale",
            "nodes": cluster.config.fleet.total,
            "crs": args.crs,
            "children_exist_seconds": {"p50": pct(to_children, 50), "p99": pct(to_children, 99),
                                       "max": round(max(to_children), 3)},
            "ready_seconds": {"p50": pct(to_ready, 50), "p99": pct(to_ready, 99)},
            "all_ready_seconds": round(all_ready, 2),
            "operator_requests_per_cr": round(burst_total / args.crs, 1),
            "operator_requests_by_verb": dict(burst),
            "operator_startup_requests": startup_requests,
            "operator_cpu_seconds": cpu,
            "operator_peak_rss_mib": rss,
            "idle_resync_window_seconds": args.resync_seconds + 5,
            "idle_requests": sum(idle.values()),
            "idle_objects_changed": len(changed),
            "idle_objects_watched": len(before),
            "idle_requests_by_verb": dict(idle),
        }
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "operator_scale.json").write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
    finally:
        if operator is not None and operator.poll() is None:
            os.killpg(operator.pid, signal.SIGTERM)
            operator.wait(30)
        cluster.stop()


if __name__ == "__main__":
    main()
