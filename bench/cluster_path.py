"""Cluster path vs local path (issue 13): does serving through Kubernetes cost anything measurable?

One run, the same seeded prompts and Poisson arrivals (bench/pd_serving.py's workload and client), one push pair
at a time (two cores hold two engines):

  local-router-push    today's local-process path: two vLLM CPU engines as processes (prefill on core 0, decode
                       on core 1) with the connector plugin, `disagg rendezvous`, `disagg router --mode push`
  cluster-router-push  the product's path: the tiny-cpu example applied to the dev cluster's real node with the
                       operator installed by its chart; client -> router Service (ClusterIP, kube-proxy) -> the
                       router pod -> engine pods (each in its own network namespace, the KV over the CNI bridge)

Both pairs run the same engine settings (bf16, block size 128, --enforce-eager, 1 GiB KV cache, pinned one core
each). The ratio cluster/local of TTFT p50 and p99 is reported per cell and as a geometric mean over cells, with
bootstrap 90% intervals over requests. Goal: at most 1.05.

  flock /tmp/disagg-engines.lock .venv/bin/python bench/cluster_path.py     # about 10 minutes warm
Writes bench/results/cluster_path.json. `--quick` checks the harness with few requests.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pd_serving
import yaml
from pd_client import quantile, via
from pd_serving import RESULTS, Arm, ArmResult, Config, Phase, log, parse_cells, per_request, run_arms

from disagg.devcluster import tinymodel, vllm_env
from disagg.devcluster.build import cache_dir
from disagg.devcluster.cluster import ClusterConfig, LocalCluster
from disagg.devcluster.engines import install_plugin
from disagg.operator import names

ARMS = {"local-router-push": "local", "cluster-router-push": "cluster"}  # arm -> phase
pd_serving.ARMS.update(ARMS)  # run_arms reads each arm's phase from there
DEFAULT_CELLS = "256@1,1024@0.5"


async def local_arm(cfg: Config, logs: Path) -> ArmResult:
    python = vllm_env.ensure(quiet=True)
    ph = Phase(python, tinymodel.ensure_model(python), logs, {}, install_plugin(logs / "plugin"))
    try:
        ph.engine("local-push-prefill", "prefill", core=0, mode="push")
        ph.engine("local-push-decode", "decode", core=1, mode="push")
        ph.start_engines()
        ph.await_plugin("push")
        url = ph.router("local-router", "push", "concurrent", ph.router_source("push"), cfg.timeout)
        (result,) = await run_arms([Arm("local-router-push", "engines and router as local processes", via(url),
                                        url + "/metrics", "push")], cfg)
        return result
    finally:
        ph.stop()


async def cluster_arm(cfg: Config) -> tuple[ArmResult, dict]:
    from disagg.devcluster import demo, demo_node
    from disagg.devcluster.images import engine

    t0 = time.monotonic()
    c = LocalCluster(ClusterConfig(name="bench-cluster-path", real_node=True))
    c.start(progress=lambda m: log(f"  {m}"))
    try:
        assert c.node is not None
        demo._helm_install(c, c.node.images["disagg"])
        demo_node.prepare(c, c.node.spec.name)
        cr = demo_node.tiny_cr(c.node.images, engine.host_env().mounts, "push")
        cr["metadata"]["namespace"] = demo_node.NAMESPACE
        client = c.client()
        from lightkube import codecs

        client.create(codecs.from_dict(cr))
        demo_node.follow_ready(client, cr["metadata"]["name"], demo_node.READY_TIMEOUT)
        info = {"cluster_ready_s": round(time.monotonic() - t0, 1), "images": c.node.images}
        url = demo_node.service_url(client, names.router_name(cr["metadata"]["name"]))
        log(f"  router Service {url}")
        (result,) = await run_arms([Arm("cluster-router-push", "the operator's pods on the real node, through the "
                                        "router Service", via(url), url + "/metrics", "push")], cfg)
        return result, info
    finally:
        c.stop()


def percentile_ratio_ci(num: list[float], den: list[float], q: float, rng: random.Random,
                        n: int = 2000) -> list[float] | None:
    """90% bootstrap interval of quantile_q(num) / quantile_q(den), resampling requests with replacement."""
    if not num or not den:
        return None
    stats = []
    for _ in range(n):
        a = quantile([rng.choice(num) for _ in num], q)
        b = quantile([rng.choice(den) for _ in den], q)
        if a and b:
            stats.append(a / b)
    lo, hi = quantile(stats, 0.05), quantile(stats, 0.95)
    return None if lo is None or hi is None else [round(lo, 3), round(hi, 3)]


def ratios(local: ArmResult, cluster: ArmResult) -> dict:
    rng = random.Random(0)
    per_cell: dict = {}
    logs: dict[str, list[float]] = {"p50": [], "p99": []}
    for a, b in zip(cluster.cells, local.cells, strict=True):
        x, y = per_request(a, "ttft"), per_request(b, "ttft")
        entry: dict = {"ok": {"cluster": a["ok"], "local": b["ok"]}, "planned": a["planned"]}
        for key, q in (("p50", 0.5), ("p99", 0.99)):
            qa, qb = quantile(x, q), quantile(y, q)
            if qa and qb:
                entry[key] = round(qa / qb, 3)
                entry[f"{key}_ci90"] = percentile_ratio_ci(x, y, q, rng)
                entry[f"{key}_ms"] = {"cluster": round(qa, 1), "local": round(qb, 1)}
                logs[key].append(math.log(qa / qb))
        per_cell[a["cell"]] = entry
    return {"per_cell": per_cell,
            **{f"geomean_{k}": round(math.exp(sum(v) / len(v)), 3) for k, v in logs.items() if v},
            "goal": "cluster/local TTFT p50 and p99 at most 1.05"}


async def main_async(args: argparse.Namespace) -> dict:
    cfg = Config(cells=parse_cells(args.cells), requests=args.requests, max_tokens=args.max_tokens,
                 timeout=args.timeout, seed=args.seed, warmup=args.warmup)
    logs = cache_dir() / "bench-logs" / time.strftime("cluster-path-%Y%m%d-%H%M%S")
    logs.mkdir(parents=True, exist_ok=True)
    log(f"logs: {logs}")
    started = time.monotonic()
    log("local path: engines, rendezvous and router as processes")
    local = await local_arm(cfg, logs)
    log("cluster path: the real node, the operator from its chart, the tiny-cpu example")
    cluster, info = await cluster_arm(cfg)
    return {
        "benchmark": "cluster_path", "issue": 13, "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "note": "one pair at a time: prefill on core 0, decode on core 1; in the cluster arm the "
                            "control plane, kubelet, containerd and the router pod share those cores"},
        "config": {"cells": [c.name for c in cfg.cells], "requests_per_cell": cfg.requests,
                   "max_tokens": cfg.max_tokens, "seed": cfg.seed, "warmup_requests": cfg.warmup,
                   "order": "local arm first, then the cluster arm (each needs both cores)"},
        "cluster": info,
        "arms": {"local-router-push": asdict(local), "cluster-router-push": asdict(cluster)},
        "headline": {"ttft_cluster_over_local": ratios(local, cluster)},
        "elapsed_s": round(time.monotonic() - started, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cells", default=DEFAULT_CELLS, help="prompt tokens @ requests/s, comma-separated")
    p.add_argument("--requests", type=int, default=60, help="requests per cell and arm")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=13)
    p.add_argument("--quick", action="store_true", help="a few requests, to check the harness")
    p.add_argument("--out", type=Path, default=RESULTS / "cluster_path.json")
    args = p.parse_args()
    if args.quick:
        args.cells, args.requests, args.warmup = "256@1", 6, 1
    result = asyncio.run(main_async(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(yaml.safe_dump(result["headline"], sort_keys=False))


if __name__ == "__main__":
    sys.exit(main())
