"""Operator scale benchmark: DisaggregatedInference objects on a kwok cluster (default 100 CRs, 200 nodes).

Two phases, with the operator running as its own user:
- solo: `--solo` CRs applied one by one on the idle cluster, each after the previous is Ready. Create → all 11
  watched children exist, per CR (p50/p99/max; issue 15's goal: p99 under 1 s).
- burst: `--crs` CRs created back to back.

Reports, as JSON (stdout and `--out`, default bench/results/operator_scale.json):
- burst: create → all 11 children exist, per CR (p50/p99);
- create → Ready=True, per CR (p50/p99), and the time until every CR is Ready;
- API requests the operator made per CR, counted from the apiserver's audit log (the operator runs as its
  own user, so no client-side counting is trusted);
- operator CPU seconds and peak RSS;
- requests and writes during an idle resync pass, by verb and resource (should be no writes; a no-op
  server-side apply is a PATCH that writes nothing, so PATCHes per CR measure what the resync still verifies).
  The window opens once every CR has had its first rendezvous answer (TransportVerified no longer
  AwaitingRendezvous): that answer is the burst's last status change, not the resync's. Objects changed in it
  are counted twice: all of them (the controllers may still be settling the burst) and those the operator wrote
  (the audit log names what it wrote; the goal is none);
- the operator's own count of child applies by kind and why its plan sent them (new, changed, drifted, verify),
  for the burst and for the idle window, and its reconcile passes by trigger.

`--profile FILE` records the operator with py-spy during the burst (a speedscope JSON; open it at speedscope.app).

Every figure is the median over `--runs` runs (default 3), each on a fresh cluster; `ready_crs` is the worst run's.
`--baseline OTHER/.venv/bin/disagg` runs another build's operator as a second arm, in ABBA order, and compares
the medians (before vs after a change to the operator).

Run: `python bench/operator_scale.py [--runs 3] [--crs 100] [--solo 20] [--fleet p5en=120,trn2=60,trn1=10,m7i=10]
[--baseline ../before/.venv/bin/disagg --baseline-commit REV]`.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import result_file
from lightkube import AsyncClient, Client, KubeConfig, codecs
from lightkube.generic_resource import create_namespaced_resource
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.apps_v1 import Deployment, StatefulSet
from lightkube.resources.core_v1 import ConfigMap, Namespace, Service
from lightkube.resources.policy_v1 import PodDisruptionBudget

from disagg.devcluster import build
from disagg.devcluster.cluster import ClusterConfig, LocalCluster, die_with_parent, free_port
from disagg.devcluster.fleet import FleetSpec
from disagg.operator import api, crdgen, names, role_api
from disagg.operator.builders import build_children
from disagg.operator.status import TRANSPORT_VERIFIED, workload_state

RESULTS = Path(__file__).resolve().parent / "results"
Dinf = create_namespaced_resource(api.GROUP, api.VERSION, api.KIND, api.PLURAL)
CHILD_KINDS = (StatefulSet, Deployment, Service, ConfigMap, PodDisruptionBudget)
CHILDREN_PER_CR = 11
NAMESPACES = 10
SOLO_NAMESPACE = "bench-solo"
USER = "disagg-operator"
MANAGED = {names.LABEL_MANAGED_BY: names.MANAGED_BY}
AWAITING = "AwaitingRendezvous"  # TransportVerified's reason before the operator's first rendezvous answer
# Both arms: kwok nodes renew their leases every 50 s and a node is Unknown after 300 s without one. At a
# kubelet's 10 s, 2,000 nodes need 200 renewals/s; under the burst this bed renewed 32-46/s, leases lapsed, the
# node-lifecycle controller marked nodes Unknown, kwok re-patched them (9,102 node patches in one burst), and that
# churn, not the operator or the children, took the control plane's CPU.
FLEET_HEARTBEATS: dict = {"node_lease_seconds": 200, "node_monitor_grace_seconds": 300}


def cr_manifest(i: int, namespace: str | None = None, prefix: str = "m") -> dict:
    trn = i % 5 == 4  # one in five on Trainium2
    spec = {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct" if trn else "Qwen/Qwen3-32B"},
            "accelerator": {"profile": "trainium2" if trn else "nvidia-h200"},
            "prefill": {"tensorParallelSize": 32 if trn else 4}, "decode": {"tensorParallelSize": 32 if trn else 4}}
    if trn:
        spec["kvTransfer"] = {"mode": "pull"}
    return {"apiVersion": f"{api.GROUP}/{api.VERSION}", "kind": api.KIND,
            "metadata": {"name": f"{prefix}{i:03d}", "namespace": namespace or f"bench-{i % NAMESPACES}"}, "spec": spec}


def kubectl_raw(cluster: LocalCluster, path: str, timeout: float, **run: Any) -> subprocess.CompletedProcess:
    """`kubectl get --raw PATH` as the cluster's admin."""
    return subprocess.run([str(cluster.bin / "kubectl"), f"--kubeconfig={cluster.kubeconfig}", "get", "--raw", path],
                          timeout=timeout, **run)


def profile_apiserver_later(cluster: LocalCluster, out: Path | None, delay: float = 60,
                            seconds: int = 60) -> threading.Thread | None:
    """In the background: after `delay` s, record `seconds` s of the apiserver's CPU profile (pprof) into `out`."""
    if out is None:
        return None

    def record() -> None:
        time.sleep(delay)
        with out.open("wb") as f:
            kubectl_raw(cluster, f"/debug/pprof/profile?seconds={seconds}", seconds + 60, stdout=f, check=False)

    thread = threading.Thread(target=record, daemon=True)
    thread.start()
    return thread


def apiserver_requests(cluster: LocalCluster) -> Counter:
    """Requests the apiserver has served so far, keyed "VERB resource[/subresource]" (its own counters)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = kubectl_raw(cluster, "/metrics", 60, capture_output=True, text=True, check=True).stdout
    out: Counter = Counter()
    for family in text_string_to_metric_families(text):
        if family.name != "apiserver_request":
            continue
        for sample in family.samples:
            if sample.name == "apiserver_request_total":
                lb = sample.labels
                sub = f"/{lb['subresource']}" if lb.get("subresource") else ""
                out[f"{lb.get('verb')} {lb.get('resource')}{sub}"] += int(sample.value)
    return out


def top_requests(after: Counter, before: Counter, n: int = 25) -> dict[str, int]:
    """The `n` most frequent requests between two `apiserver_requests` readings."""
    return {k: v for k, v in Counter(counter_delta(after, before)).most_common(n) if v > 0}


def floor_children(i: int) -> list[dict]:
    """What the operator would create for `cr_manifest(i)`, minus the owner reference to a CR that the floor never
    creates (the garbage collector would delete every child of a missing owner)."""
    children = build_children(api.DisaggregatedInference.model_validate(cr_manifest(i)))
    for child in children:
        child["metadata"].pop("ownerReferences", None)
    return children


WORKLOADS = ("StatefulSet", "Deployment")


def instance_of(child: dict) -> tuple[str, str]:
    """(namespace, CR name) of a manifest the builders made."""
    return child["metadata"]["namespace"], child["metadata"]["labels"][names.LABEL_INSTANCE]


def component_cpu(cluster: LocalCluster) -> dict[str, float]:
    """CPU seconds each control-plane process has used so far, by component name."""
    return {p.name: proc_usage(p.popen.pid)[0] for p in cluster.processes if p.popen is not None}


def cpu_delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: round(after[k] - before.get(k, 0.0), 1) for k in after}


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))], 3)


class Observer:
    """Watches every operator-managed child and every CR from `__aenter__` on. Records the monotonic time at which
    each CR (keyed (namespace, name)) was first seen with all CHILDREN_PER_CR children, and first seen Ready=True.
    `until` wakes on every watch event, so a wait ends on the event that satisfies it, not on a poll."""

    def __init__(self, kubeconfig: Path) -> None:
        self.client = AsyncClient(KubeConfig.from_file(kubeconfig))
        self.children: dict[tuple[str, str], set[tuple[str, str]]] = {}
        self.complete: dict[tuple[str, str], float] = {}
        self.ready: dict[tuple[str, str], float] = {}
        self.answered: set[tuple[str, str]] = set()  # CRs whose TransportVerified has left AwaitingRendezvous
        self._changed = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> Observer:
        self._tasks = [asyncio.create_task(self._watch_children(k)) for k in CHILD_KINDS]
        self._tasks.append(asyncio.create_task(self._watch_crs()))
        await asyncio.sleep(0.5)  # let the watches open before the first create
        return self

    async def __aexit__(self, *exc: object) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.client.close()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _watch_children(self, kind) -> None:
        async for op, obj in self.client.watch(kind, namespace="*", labels=MANAGED):
            key = (obj.metadata.namespace, obj.metadata.labels.get("app.kubernetes.io/instance"))
            if op == "ADDED":
                self.children.setdefault(key, set()).add((kind.__name__, obj.metadata.name))
                if len(self.children[key]) == CHILDREN_PER_CR and key not in self.complete:
                    self.complete[key] = time.monotonic()
                    self._notify()

    async def _watch_crs(self) -> None:
        async for _op, obj in self.client.watch(Dinf, namespace="*"):
            key = (obj.metadata.namespace, obj.metadata.name)
            conds = (obj.status or {}).get("conditions", [])
            if key not in self.ready and any(c["type"] == "Ready" and c["status"] == "True" for c in conds):
                self.ready[key] = time.monotonic()
                self._notify()
            if key not in self.answered and any(c["type"] == TRANSPORT_VERIFIED and c.get("reason") != AWAITING
                                                for c in conds):
                self.answered.add(key)
                self._notify()

    async def until(self, done: Callable[[], bool], timeout: float, what: Callable[[], str]) -> None:
        """Return once `done()` holds; raise if a watch ends or `timeout` passes. Prints `what()` every 15 s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        next_report = loop.time() + 15
        while not done():
            ended = [t for t in self._tasks if t.done()]
            if ended:
                raise RuntimeError(f"a watch ended: {ended[0].exception()!r}")
            now = loop.time()
            if now > deadline:
                raise TimeoutError(f"not within {timeout}s: {what()}")
            if now > next_report:
                print(f"  waiting: {what()}", file=sys.stderr, flush=True)
                next_report = now + 15
            changed = self._changed.wait()
            try:
                await asyncio.wait_for(changed, min(deadline, next_report) - now)
            except TimeoutError:
                pass


def snapshot(client: Client) -> dict[tuple[str, str, str], str]:
    """resourceVersion of every CR and every child, by (resource, namespace, name) as the audit log names them."""
    out = {}
    for kind in (Dinf, *CHILD_KINDS):
        for obj in client.list(kind, namespace="*"):
            if kind is Dinf or (obj.metadata.labels or {}).get(names.LABEL_MANAGED_BY) == names.MANAGED_BY:
                out[(kind._api_info.plural, obj.metadata.namespace, obj.metadata.name)] = obj.metadata.resourceVersion
    return out


def proc_usage(pid: int) -> tuple[float, int]:
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
    hwm = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
               if line.startswith("VmHWM"))
    return round(cpu, 2), hwm // 1024


def audit_events(log: Path, user: str, since: float = 0.0, until: float = float("inf")) -> Iterator[dict]:
    """`user`'s requests from the audit log, each once, received in [since, until) (epoch seconds)."""
    with log.open() as f:
        for line in f:
            if not line.endswith("\n"):
                break  # the apiserver is still writing this one
            ev = json.loads(line)
            # A watch is logged when it starts and again when it ends; every other request once, complete.
            counted = "ResponseStarted" if ev["verb"] == "watch" else "ResponseComplete"
            if ev.get("user", {}).get("username") != user or ev.get("stage") != counted:
                continue
            if since <= _epoch(ev["requestReceivedTimestamp"]) < until:
                yield ev


def audit_counts(log: Path, user: str, since: float = 0.0, until: float = float("inf")) -> Counter:
    """`user`'s requests by (verb, resource), from the audit log, received in [since, until) (epoch seconds)."""
    return Counter((ev["verb"], ev.get("objectRef", {}).get("resource", ""))
                   for ev in audit_events(log, user, since, until))


def audit_writes(log: Path, user: str, since: float, until: float) -> set[tuple[str, str, str]]:
    """(resource, namespace, name) of every object `user` wrote to (create, update, patch, delete; any
    subresource) in [since, until). A write request may change nothing (a no-op apply): this is what was sent."""
    return {(ref.get("resource", ""), ref.get("namespace", ""), ref.get("name", ""))
            for ev in audit_events(log, user, since, until)
            if ev["verb"] in ("create", "update", "patch", "delete") for ref in [ev.get("objectRef", {})]}


def by_verb(counts: Counter) -> dict[str, int]:
    out: Counter = Counter()
    for (verb, _resource), n in counts.items():
        out[verb] += n
    return dict(out)


def by_verb_and_resource(counts: Counter) -> dict[str, int]:
    return {f"{verb} {resource}": n for (verb, resource), n in sorted(counts.items())}


def idle_child_patches_per_cr(idle: Counter, crs: int) -> float:
    """The resync's server-side applies of children, per CR: PATCHes of anything but the CRs (their status)."""
    return round(sum(n for (verb, resource), n in idle.items() if verb == "patch" and resource != api.PLURAL)
                 / crs, 2)


COUNTED = ("disagg_operator_child_applies_total", "disagg_operator_reconciles_total",
           "disagg_operator_status_writes_total", "disagg_operator_rollout_steps_total")


def operator_counters(port: int) -> Counter:
    """The operator's child applies (by kind and why), reconcile passes (by trigger and result), status writes
    and rollout steps, read from its metrics endpoint, keyed "metric{label=value,...}"."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: Counter = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in COUNTED:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                out[f"{sample.name.removeprefix('disagg_operator_').removesuffix('_total')}{{{labels}}}"] += \
                    int(sample.value)
    return out


def counter_delta(after: Counter, before: Counter) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in sorted(after) if after[k] - before.get(k, 0)}


def _epoch(ts: str) -> float:
    return dt.datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def run_floor(args: argparse.Namespace) -> dict:
    """The control plane alone, on a fresh cluster of the same fleet: the bench server-side applies every child
    the operator would create for the burst's CRs (from the operator's own builders, no operator running), then
    waits until every StatefulSet and Deployment has all its replicas ready and updated. What is left of the
    operator arm's time above this is the operator's."""
    cluster = LocalCluster(ClusterConfig(name="bench-floor", fleet=FleetSpec.parse(args.fleet),
                                         profiling=args.apiserver_profile is not None, startup_timeout=300,
                                         **FLEET_HEARTBEATS))
    cluster.start(progress=lambda m: print(f"floor: {m}", file=sys.stderr, flush=True))
    try:
        client = Client(KubeConfig.from_file(cluster.kubeconfig))
        for ns in (f"bench-{i}" for i in range(NAMESPACES)):
            client.create(Namespace(metadata=ObjectMeta(name=ns)))
        per_cr = [floor_children(i) for i in range(args.crs)]
        expected = {instance_of(c[0]): sum(ch["kind"] in WORKLOADS for ch in c) for c in per_cr}
        ready: dict[tuple[str, str], set[tuple[str, str]]] = {}
        done_at: dict[tuple[str, str], float] = {}
        applied: dict[tuple[str, str], float] = {}
        all_ready = asyncio.Event()

        async def watch(kind) -> None:
            wclient = AsyncClient(KubeConfig.from_file(cluster.kubeconfig))
            try:
                async for _op, obj in wclient.watch(kind, namespace="*", labels=MANAGED):
                    key = (obj.metadata.namespace, obj.metadata.labels.get(names.LABEL_INSTANCE))
                    # Ready as the operator's status counts it (all replicas ready and updated, generation seen).
                    if key in done_at or not workload_state(obj.to_dict()).settled:
                        continue
                    ready.setdefault(key, set()).add((kind.__name__, obj.metadata.name))
                    if len(ready[key]) == expected.get(key, -1):
                        done_at[key] = time.monotonic()
                        if len(done_at) == len(expected):
                            all_ready.set()
            finally:
                await wclient.close()

        async def burst() -> dict:
            watches = [asyncio.create_task(watch(k)) for k in (StatefulSet, Deployment)]
            await asyncio.sleep(0.5)  # let the watches open before the first apply
            cpu0, requests0 = component_cpu(cluster), apiserver_requests(cluster)
            aclient = AsyncClient(KubeConfig.from_file(cluster.kubeconfig))
            slots = asyncio.Semaphore(args.create_concurrency)
            t0 = time.monotonic()
            profiling = profile_apiserver_later(
                cluster, args.apiserver_profile and args.apiserver_profile.with_suffix(".floor.pprof"))

            async def apply_one(children: list[dict]) -> None:
                async with slots:
                    applied[instance_of(children[0])] = time.monotonic()
                    for child in children:
                        await aclient.apply(codecs.from_dict(child), field_manager="bench-floor", force=True)

            try:
                await asyncio.gather(*(apply_one(c) for c in per_cr))
                applied_all = time.monotonic() - t0
                print(f"floor: applied the children of {args.crs} CRs in {applied_all:.1f}s", file=sys.stderr,
                      flush=True)
                try:
                    await asyncio.wait_for(all_ready.wait(), args.timeout)
                except TimeoutError:
                    print(f"floor: {len(done_at)}/{args.crs} ready after {args.timeout}s", file=sys.stderr,
                          flush=True)
                if profiling is not None:
                    profiling.join()
                return {"applied_all_seconds": round(applied_all, 2),
                        "control_plane_cpu_seconds": cpu_delta(component_cpu(cluster), cpu0),
                        "apiserver_requests": top_requests(apiserver_requests(cluster), requests0)}
            finally:
                await aclient.close()
                for w in watches:
                    w.cancel()
                await asyncio.gather(*watches, return_exceptions=True)

        out = asyncio.run(burst())
        first = min(applied.values())
        return {
            "crs": args.crs,
            "apply_concurrency": args.create_concurrency,
            "applied_all_seconds": out["applied_all_seconds"],
            "ready_seconds": spread([done_at[k] - applied[k] for k in done_at]),
            "ready_crs": len(done_at),
            "all_ready_seconds": (round(max(done_at.values()) - first, 2) if len(done_at) == len(expected)
                                  else None),
            "control_plane_cpu_seconds": out["control_plane_cpu_seconds"],
            "apiserver_requests": out["apiserver_requests"],
        }
    finally:
        cluster.stop()


def spread(values: list[float]) -> dict[str, float]:
    return {"p50": pct(values, 50), "p99": pct(values, 99), "max": round(max(values), 3)} if values else {}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--crs", type=int, default=100, help="CRs created in the burst")
    p.add_argument("--solo", type=int, default=20,
                   help="CRs applied one by one on the idle cluster before the burst, each after the last is Ready")
    p.add_argument("--fleet", default="p5en=120,trn2=60,trn1=10,m7i=10")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--create-concurrency", type=int, default=1,
                   help="burst CRs created at once (1: one after the other, as `kubectl apply -f dir` does)")
    p.add_argument("--resync-seconds", type=float, default=60)
    p.add_argument("--out", type=Path, default=RESULTS / "operator_scale.json")
    p.add_argument("--profile", type=Path, help="record the operator with py-spy during the burst (speedscope JSON)")
    p.add_argument("--apiserver-profile", type=Path,
                   help="record a CPU profile of the apiserver (pprof) for 60 s of the burst, from 60 s after "
                        "its first create, in both arms; the floor's goes next to it with a .floor suffix")
    p.add_argument("--runs", type=int, default=3,
                   help="runs of each arm, each on a fresh cluster (default 3): figures are the median over runs")
    p.add_argument("--baseline", type=Path,
                   help="another `disagg` executable (say, a checkout of the previous commit's .venv/bin/disagg): "
                        "its operator runs as a second arm, in ABBA order with this one, and the result compares "
                        "them")
    p.add_argument("--baseline-commit", help="the baseline's commit, for the record")
    p.add_argument("--floor", action="store_true",
                   help="first run the control plane alone on its own cluster: the burst's children applied by "
                        "the bench, no operator (the floor the operator's time is judged against)")
    args = p.parse_args()
    if args.runs < 1 or (args.baseline is not None and not args.baseline.exists()):
        p.error("--runs must be at least 1, and --baseline an existing `disagg` executable")
    made = result_file.provenance()

    build.ensure_built(quiet=True)
    floor = run_floor(args) if args.floor else None
    current = Path(sys.executable).parent / "disagg"
    arms = {"current": current, **({"baseline": args.baseline} if args.baseline else {})}
    order = abba(list(arms), args.runs)
    runs: list[dict[str, Any]] = []
    for n, arm in enumerate(order, 1):
        print(f"run {n}/{len(order)}: {arm} operator ({arms[arm]})", file=sys.stderr, flush=True)
        runs.append({"arm": arm, "operator": str(arms[arm]), **run_once(args, arms[arm])})
    mine = [r for r in runs if r["arm"] == "current"]
    result = {
        **made,
        "benchmark": "operator_scale",
        "command": " ".join(["python", "bench/operator_scale.py", *sys.argv[1:]]),
        "runs_per_arm": args.runs,
        "order": order,
        **median_of(mine),
        "floor": floor,
        "baseline_commit": args.baseline_commit,
        "baseline": compare_arms(mine, [r for r in runs if r["arm"] == "baseline"]) if args.baseline else None,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result_file.write(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))


def abba(arms: list[str], runs: int) -> list[str]:
    """Each arm `runs` times, in ABBA order (A B B A A B ...), so drift in the machine falls on both arms alike."""
    if len(arms) == 1:
        return arms * runs
    a, b = arms
    return [arm for i in range(runs) for arm in ((a, b) if i % 2 == 0 else (b, a))]


HEADLINE = ("all_ready_seconds", "created_all_seconds", "ready_crs", "operator_requests_per_cr",
            "solo_operator_requests_per_cr", "operator_startup_requests", "operator_cpu_seconds",
            "operator_peak_rss_mib", "idle_requests", "idle_patches_per_cr", "idle_child_patches_per_cr",
            "idle_objects_changed", "idle_objects_changed_by_operator", "failed_passes")
SPREADS = ("solo_children_exist_seconds", "solo_ready_seconds", "children_exist_seconds", "ready_seconds")


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The runs' figures as one result: each headline figure and each spread's quantiles, the median over runs
    (a run that did not get every CR Ready has no all_ready_seconds: the median is then over the runs that did,
    and ready_crs shows the shortfall). The last run's descriptive fields (sizes, by-verb tables) are kept."""
    out = {k: v for k, v in runs[-1].items() if k not in ("arm", "operator")}
    for key in (k for k in HEADLINE if any(k in r for r in runs)):
        values = [r[key] for r in runs if isinstance(r.get(key), (int, float))]
        out[key] = _median(values)
        out[f"{key}_runs"] = [r.get(key) for r in runs]
    out["ready_crs"] = min(r["ready_crs"] for r in runs)  # judged on the worst run: every run must get all Ready
    out["all_ready_seconds"] = out["all_ready_seconds"] if all(r.get("all_ready_seconds") is not None
                                                               for r in runs) else None
    for key in SPREADS:
        qs = {q for r in runs for q in (r.get(key) or {})}
        out[key] = {q: _median([r[key][q] for r in runs if q in (r.get(key) or {})]) for q in sorted(qs)}
    return out


def compare_arms(current: list[dict[str, Any]], baseline: list[dict[str, Any]]) -> dict[str, Any]:
    """Each headline figure's median in both arms and current / baseline."""
    out: dict[str, Any] = {"runs": len(baseline)}
    for key in ("all_ready_seconds", "operator_requests_per_cr", "operator_cpu_seconds", "operator_peak_rss_mib",
                "idle_requests", "idle_objects_changed_by_operator"):
        a = _median([r[key] for r in current if isinstance(r.get(key), (int, float))])
        b = _median([r[key] for r in baseline if isinstance(r.get(key), (int, float))])
        out[key] = {"current": a, "baseline": b, "ratio": round(a / b, 3) if a is not None and b else None}
    for key in ("children_exist_seconds", "ready_seconds"):
        a = _median([r[key]["p99"] for r in current if "p99" in (r.get(key) or {})])
        b = _median([r[key]["p99"] for r in baseline if "p99" in (r.get(key) or {})])
        out[f"{key}_p99"] = {"current": a, "baseline": b, "ratio": round(a / b, 3) if a is not None and b else None}
    return out


def run_once(args: argparse.Namespace, operator_bin: Path) -> dict[str, Any]:
    """One fresh cluster, the operator `operator_bin` runs, the solo CRs, the burst, the idle window."""
    cluster = LocalCluster(ClusterConfig(name="bench-scale", fleet=FleetSpec.parse(args.fleet), audit=True,
                                         audit_users=(USER,), profiling=args.apiserver_profile is not None,
                                         startup_timeout=300, **FLEET_HEARTBEATS))
    cluster.start(progress=lambda m: print(m, file=sys.stderr, flush=True))
    operator = None
    try:
        client = Client(KubeConfig.from_file(cluster.kubeconfig))
        # Both CRDs, as the chart installs them: without the role objects' every pass is refused and retried.
        for crd in (crdgen.crd(), crdgen.role_crd()):
            client.create(codecs.from_dict(crd))
        for ns in [SOLO_NAMESPACE, *(f"bench-{i}" for i in range(NAMESPACES))]:
            client.create(Namespace(metadata=ObjectMeta(name=ns)))
        subprocess.run([str(cluster.bin / "kubectl"), f"--kubeconfig={cluster.kubeconfig}", "wait",
                        "--for=condition=Established", f"crd/{api.PLURAL}.{api.GROUP}",
                        f"crd/{role_api.PLURAL}.{api.GROUP}"], check=True, stdout=subprocess.DEVNULL)
        health, metrics_port = free_port(), free_port()
        op_log = cluster.dir / "logs" / "operator.log"
        operator = subprocess.Popen(
            [str(operator_bin), "operator", "--metrics-port", str(metrics_port),
             "--liveness", f"http://127.0.0.1:{health}/healthz", "--resync-seconds", str(args.resync_seconds)],
            env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig_for(USER))},
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

        # "Idle" starts once the operator watches the CRs: before that, a create waits on its startup (the first
        # list of a just-established CRD can be refused with 429 while its storage initializes).
        deadline = time.monotonic() + 60
        while not audit_counts(cluster.audit_log, USER)[("watch", api.PLURAL)]:
            if time.monotonic() > deadline:
                raise SystemExit(f"the operator did not watch {api.PLURAL} within 60s; see {op_log}")
            time.sleep(0.2)

        solo_created: dict[tuple[str, str], float] = {}
        created: dict[tuple[str, str], float] = {}
        marks: dict[str, float] = {"solo_from": time.time()}
        counters: dict[str, Counter] = {}
        profiler: list[subprocess.Popen] = []
        burst_cpu: dict[str, float] = {}
        burst_requests: dict[str, int] = {}

        async def create(aclient: AsyncClient, manifest: dict, into: dict[tuple[str, str], float]) -> None:
            into[(manifest["metadata"]["namespace"], manifest["metadata"]["name"])] = time.monotonic()
            await aclient.create(codecs.from_dict(manifest))

        async def run(obs: Observer) -> None:
            aclient = AsyncClient(KubeConfig.from_file(cluster.kubeconfig))
            try:
                for i in range(args.solo):
                    m = cr_manifest(i, namespace=SOLO_NAMESPACE, prefix="s")
                    key = (SOLO_NAMESPACE, m["metadata"]["name"])
                    await create(aclient, m, solo_created)
                    await obs.until(lambda k=key: k in obs.complete and k in obs.ready, 120,
                                    lambda k=key: f"solo {k[1]}: {len(obs.children.get(k, ()))}/"
                                                  f"{CHILDREN_PER_CR} children, Ready={k in obs.ready}")
                print(f"solo: {args.solo} CRs applied one by one", file=sys.stderr, flush=True)
                counters["solo"] = operator_counters(metrics_port)
                if args.profile:
                    profiler.append(subprocess.Popen(
                        [str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(operator.pid),
                         "--format", "speedscope", "--output", str(args.profile), "--rate", "50",
                         "--gil"],  # the threads that run Python: ones blocked in a name lookup are not its CPU
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                marks["burst_from"], t0 = time.time(), time.monotonic()
                cpu_from, requests_from = component_cpu(cluster), apiserver_requests(cluster)
                profile_apiserver_later(cluster, args.apiserver_profile)
                slots = asyncio.Semaphore(args.create_concurrency)

                async def create_one(i: int) -> None:
                    async with slots:
                        await create(aclient, cr_manifest(i), created)

                await asyncio.gather(*(create_one(i) for i in range(args.crs)))
                marks["created_all"] = time.monotonic() - t0
                print(f"created {args.crs} CRs in {marks['created_all']:.1f}s", file=sys.stderr, flush=True)
                try:
                    await obs.until(lambda: all(k in obs.ready for k in created), args.timeout,
                                    lambda: f"{sum(k in obs.complete for k in created)} complete, "
                                            f"{sum(k in obs.ready for k in created)}/{args.crs} Ready")
                except TimeoutError as e:  # still a result: how far it got, with all_ready_seconds null
                    print(f"burst: {e}", file=sys.stderr, flush=True)
                marks["burst_to"] = time.time()
                burst_cpu.update(cpu_delta(component_cpu(cluster), cpu_from))
                burst_requests.update(top_requests(apiserver_requests(cluster), requests_from))
                counters["burst"] = operator_counters(metrics_port)
                for prof in profiler:
                    prof.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
                    prof.wait(60)
                every = [*solo_created, *created]
                try:
                    await obs.until(lambda: all(k in obs.answered for k in every), 120,
                                    lambda: f"{sum(k in obs.answered for k in every)}/{len(every)} CRs have had "
                                            "their first rendezvous answer")
                except TimeoutError as e:  # the idle window then holds the rest of those answers
                    print(f"before the idle window: {e}", file=sys.stderr, flush=True)
                counters["settled"] = operator_counters(metrics_port)
            finally:
                await aclient.close()

        async def observed() -> Observer:
            async with Observer(cluster.kubeconfig) as obs:
                await run(obs)
            return obs

        obs = asyncio.run(observed())
        cpu, rss = proc_usage(operator.pid)
        audit = cluster.audit_log
        startup = audit_counts(audit, USER, until=marks["solo_from"])
        solo = audit_counts(audit, USER, since=marks["solo_from"], until=marks["burst_from"])
        burst = audit_counts(audit, USER, since=marks["burst_from"], until=marks["burst_to"])

        # One idle resync window: the requests it makes, and the objects it changes (expected: none). A no-op
        # server-side apply is a PATCH request but not a write, so changes are counted by resourceVersion.
        before = snapshot(client)
        idle_from = time.time()
        time.sleep(args.resync_seconds + 5)
        idle_to = time.time()
        idle = audit_counts(audit, USER, since=idle_from, until=idle_to)
        counters["idle"] = operator_counters(metrics_port)
        after = snapshot(client)
        changed = {k for k in before if after.get(k) != before[k]}
        changed_by_operator = changed & audit_writes(audit, USER, idle_from, idle_to)
        all_crs = args.crs + args.solo

        return {
            "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "nodes": cluster.config.fleet.total,
            "crs": args.crs,
            "solo_crs": args.solo,
            "solo_children_exist_seconds": spread([obs.complete[k] - t for k, t in solo_created.items()]),
            "solo_ready_seconds": spread([obs.ready[k] - t for k, t in solo_created.items()]),
            "solo_operator_requests_per_cr": round(sum(solo.values()) / args.solo, 1) if args.solo else None,
            "create_concurrency": args.create_concurrency,
            "created_all_seconds": round(marks["created_all"], 2),
            "children_exist_seconds": spread([obs.complete[k] - t for k, t in created.items() if k in obs.complete]),
            "ready_seconds": spread([obs.ready[k] - t for k, t in created.items() if k in obs.ready]),
            "ready_crs": sum(k in obs.ready for k in created),
            "timeout_seconds": args.timeout,
            "all_ready_seconds": (round(max(obs.ready[k] for k in created) - min(created.values()), 2)
                                  if all(k in obs.ready for k in created) else None),
            "operator_requests_per_cr": round(sum(burst.values()) / args.crs, 1),
            "operator_requests_by_verb": by_verb(burst),
            "operator_startup_requests": sum(startup.values()),
            "operator_cpu_seconds": cpu,
            "operator_peak_rss_mib": rss,
            "idle_resync_window_seconds": args.resync_seconds + 5,
            "idle_requests": sum(idle.values()),
            "idle_patches_per_cr": round(by_verb(idle).get("patch", 0) / all_crs, 2),
            "idle_child_patches_per_cr": idle_child_patches_per_cr(idle, all_crs),
            "idle_objects_changed": len(changed),
            "idle_objects_changed_by_operator": len(changed_by_operator),
            "idle_objects_watched": len(before),
            "idle_requests_by_verb": by_verb(idle),
            "idle_requests_by_verb_and_resource": by_verb_and_resource(idle),
            "burst_control_plane_cpu_seconds": burst_cpu,
            "burst_apiserver_requests": burst_requests,
            "failed_passes": sum(n for k, n in counters["idle"].items() if k.startswith("reconciles{") and
                                 "result=error" in k),
            "burst_operator_counters": counter_delta(counters["burst"], counters["solo"]),
            "idle_operator_counters": counter_delta(counters["idle"], counters["settled"]),
        }
    finally:
        if operator is not None and operator.poll() is None:
            os.killpg(operator.pid, signal.SIGTERM)
            operator.wait(30)
        cluster.stop()


if __name__ == "__main__":
    main()
