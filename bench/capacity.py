"""The bed's capacity (issue 15, item 5): one load ramp against a push pair, a pull pair and one plain engine, with
NIXL's progress thread spinning (NIXL's default) and sleeping in poll() (`$DISAGG_NIXL_PROGRESS_DELAY_US`).

Arms, one at a time (two cores fit one pair: prefill pinned to core 0, decode to core 1), in ABBA order over the
delay within each mode:

  push-poll, push-spin   a push pair behind `disagg router --mode push` (concurrent dispatch)
  pull-spin, pull-poll   a pull pair behind `disagg router --mode pull`
  mono                   one plain engine on core 0, no NIXL, no router: the ceiling

Every P/D engine loads the connector plugin and advertises to a `disagg rendezvous`, as in production; "poll" arms
set the delay the `cpu` profile sets (`--delay-us`). For each arm:

- where the cores go while it is idle: CPU of every engine process and of its busiest threads over `--idle-s`
  seconds, from /proc (the spinning progress thread shows as one thread at a whole core);
- the ramp: for each rate of `--rates`, `--requests` seeded requests with Poisson arrivals (the same prompts and
  arrivals for every arm); per step TTFT and end-to-end p50/p99, failures, and achieved throughput (completed
  requests / (last completion - step start)). The ramp stops after two steps that achieve under 80% of the
  offered rate: the pair is saturated and further steps only queue.

Saturation throughput per arm is the highest achieved throughput of its ramp. Ratios poll/spin per mode: the
saturation throughputs, and TTFT p50 and p99 at each rate both arms ran, with bootstrap 90% intervals over
requests.

Run (engines need the machine-wide lock):
  flock /tmp/disagg-engines.lock .venv/bin/python bench/capacity.py
Writes bench/results/capacity.json. `--quick` checks the harness in a few minutes.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import result_file
from pd_client import percentile_ratio_ci, quantile, via
from pd_serving import RESULTS, Cell, Config, Phase, log, per_request, run_cell, warm

from disagg.connector.wire import env as wire_env
from disagg.devcluster import tinymodel, vllm_env
from disagg.devcluster.engines import LocalEngine, install_plugin
from disagg.devcluster.procs import thread_cores, thread_cpu_seconds


@dataclass(frozen=True)
class ArmSpec:
    name: str
    mode: str | None  # push, pull; None: one plain engine
    poll: bool

    def describe(self, delay_us: int) -> str:
        if self.mode is None:
            return "one plain engine on core 0 (no disaggregation, no NIXL, no router)"
        thread = f"polls with a {delay_us} us delay" if self.poll else "spins (delay 0, NIXL's default)"
        return f"{self.mode} pair behind disagg router --mode {self.mode}; NIXL's progress thread {thread}"


ARMS = [ArmSpec("push-poll", "push", True), ArmSpec("push-spin", "push", False),
        ArmSpec("pull-spin", "pull", False), ArmSpec("pull-poll", "pull", True), ArmSpec("mono", None, False)]
SATURATED = 0.8  # a step that achieves under this share of its offered rate is saturated


# -- where the cores go ----------------------------------------------------------------------------------------
async def idle_cpu(engines: list[LocalEngine], seconds: float) -> dict:
    """Cores each engine used over `seconds` with no requests, and its three busiest threads."""
    pids = {e.spec.name: e.processes() for e in engines}
    before = {name: thread_cpu_seconds(p) for name, p in pids.items()}
    t0 = time.monotonic()
    await asyncio.sleep(seconds)  # the measurement is this window itself
    elapsed = time.monotonic() - t0
    out = {}
    for name, p in pids.items():
        used = thread_cores(before[name], thread_cpu_seconds(p), elapsed)
        top = sorted(used.items(), key=lambda kv: -kv[1][1])[:3]
        out[name] = {"cores": round(sum(c for _, c in used.values()), 2),
                     "busiest_threads": [{"pid": pid, "tid": tid, "name": n, "cores": round(c, 2)}
                                         for (pid, tid), (n, c) in top]}
    log("  idle: " + ", ".join(f"{n} {v['cores']} cores (busiest: {v['busiest_threads'][0]['name']} "
                               f"{v['busiest_threads'][0]['cores']})" for n, v in out.items()))
    return out


# -- one arm ---------------------------------------------------------------------------------------------------
def start_arm(spec: ArmSpec, args: argparse.Namespace, logs: Path) -> tuple[Phase, str, list[LocalEngine]]:
    python = vllm_env.ensure(quiet=True)
    # "0" is NIXL's own default: local engines get CPU_ENGINE_ENV's delay unless told otherwise.
    env = {wire_env.NIXL_PROGRESS_DELAY_US: str(args.delay_us if spec.poll else 0)}
    plugin = install_plugin(logs / "plugin") if spec.mode else None
    ph = Phase(python, tinymodel.ensure_model(python), logs, {"extra_env": env}, plugin)
    if spec.mode is None:
        engines = [ph.engine(f"cap-{spec.name}", None, core=0)]
        ph.start_engines()
        return ph, engines[0].url, engines
    engines = [ph.engine(f"cap-{spec.name}-prefill", "prefill", core=0, mode=spec.mode),
               ph.engine(f"cap-{spec.name}-decode", "decode", core=1, mode=spec.mode)]
    ph.start_engines()
    ph.await_plugin(spec.mode)
    url = ph.router(f"cap-{spec.name}-router", spec.mode, "concurrent", ph.router_source(spec.mode), args.timeout)
    return ph, url, engines


async def ramp(url: str, spec: ArmSpec, cfg: Config, rates: list[float], tokens: int) -> tuple[list[dict], list]:
    steps, saturated = [], 0
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as session:
        warmup = await warm(session, via(url), spec.name, cfg, tokens)
        for rate in rates:
            summary, aborted = await run_cell(session, via(url), spec.name, Cell(tokens, rate), cfg,
                                              url + "/metrics" if spec.mode else None, spec.mode)
            steps.append(summary)
            saturated = saturated + 1 if (summary["throughput_rps"] or 0) < SATURATED * rate else 0
            if aborted or saturated >= 2:
                break
            await asyncio.sleep(cfg.gap)  # let the pair's queues drain between steps
    return steps, warmup


async def run_arm(spec: ArmSpec, args: argparse.Namespace, cfg: Config, logs: Path) -> dict:
    log(f"arm {spec.name}: {spec.describe(args.delay_us)}")
    ph, url, engines = start_arm(spec, args, logs)
    try:
        idle = await idle_cpu(engines, args.idle_s)
        steps, warmup = await ramp(url, spec, cfg, args.rates, args.tokens)
    finally:
        ph.stop()
    best = max((s["throughput_rps"] or 0 for s in steps), default=0.0)
    log(f"  {spec.name}: saturation {best} req/s")
    return {"arm": spec.name, "mode": spec.mode, "poll": spec.poll, "description": spec.describe(args.delay_us),
            "idle_cpu": idle, "warmup": warmup, "saturation_rps": best, "steps": steps}


# -- report ----------------------------------------------------------------------------------------------------
def compare(num: dict, den: dict, rng: random.Random) -> dict:
    """num/den: saturation throughput, and TTFT p50/p99 with 90% intervals at each rate both arms ran."""
    out: dict = {"saturation": round(num["saturation_rps"] / den["saturation_rps"], 3)
                 if den["saturation_rps"] else None, "ttft": {}}
    for a, b in zip(num["steps"], den["steps"], strict=False):
        x, y = per_request(a, "ttft"), per_request(b, "ttft")
        entry = {}
        for key, q in (("p50", 0.5), ("p99", 0.99)):
            qa, qb = quantile(x, q), quantile(y, q)
            if qa and qb:
                entry[key] = round(qa / qb, 3)
                entry[f"{key}_ci90"] = percentile_ratio_ci(x, y, q, rng)
        out["ttft"][a["cell"]] = entry
    return out


def headline(arms: dict[str, dict]) -> dict:
    rng = random.Random(0)
    out: dict = {"saturation_rps": {name: a["saturation_rps"] for name, a in arms.items()},
                 "idle_engine_cores": {name: round(sum(e["cores"] for e in a["idle_cpu"].values()), 2)
                                       for name, a in arms.items()}}
    for mode in ("push", "pull"):
        if f"{mode}-poll" in arms and f"{mode}-spin" in arms:
            out[f"{mode}_poll_over_spin"] = compare(arms[f"{mode}-poll"], arms[f"{mode}-spin"], rng)
    if "mono" in arms and arms["mono"]["saturation_rps"]:
        out["pair_over_mono_saturation"] = {name: round(a["saturation_rps"] / arms["mono"]["saturation_rps"], 3)
                                            for name, a in arms.items() if a["mode"]}
    return out


def parse_rates(text: str) -> list[float]:
    rates = [float(x) for x in text.split(",") if x.strip()]
    if not rates or any(r <= 0 or not math.isfinite(r) for r in rates) or rates != sorted(rates):
        raise argparse.ArgumentTypeError(f"--rates wants increasing positive numbers, got {text!r}")
    return rates


async def main_async(args: argparse.Namespace) -> dict:
    made = result_file.provenance()
    cfg = Config(cells=[], requests=args.requests, max_tokens=args.max_tokens, timeout=args.timeout, seed=args.seed,
                 warmup=args.warmup)
    logs = Path(args.logs or f"/tmp/disagg-capacity-{time.strftime('%Y%m%d-%H%M%S')}")
    logs.mkdir(parents=True, exist_ok=True)
    wanted = [a for a in ARMS if a.name in args.arms.split(",")]
    t0 = time.monotonic()
    arms = {}
    for spec in wanted:
        arms[spec.name] = await run_arm(spec, args, cfg, logs)
    return {
        **made, "benchmark": "capacity", "issue": 15, "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(["bench/capacity.py", *sys.argv[1:]]),
        "machine": {**made["machine"],
                    "note": "one pair at a time: prefill on core 0, decode on core 1; the client shares the cores"},
        "config": {"rates": args.rates, "prompt_tokens": args.tokens, "requests_per_step": args.requests,
                   "max_tokens": args.max_tokens, "delay_us": args.delay_us, "seed": args.seed,
                   "timeout_s": args.timeout, "idle_s": args.idle_s, "order": [a.name for a in wanted],
                   "saturated_below": SATURATED, "logs": str(logs)},
        "headline": headline(arms),
        "definitions": {
            "throughput": "completed requests / (last completion - step start)",
            "saturation_rps": "the highest throughput of the arm's ramp",
            "ratios": "poll arm / spin arm: saturation, and TTFT p50/p99 per step with a 90% bootstrap interval "
                      "over requests",
            "idle_cpu": "CPU of each engine's processes over idle_s seconds without requests (from /proc)",
        },
        "arms": arms,
        "elapsed_s": round(time.monotonic() - t0, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default=",".join(a.name for a in ARMS))
    p.add_argument("--rates", type=parse_rates, default=parse_rates("1,2,4,8,12,16,24,32"),
                   help="offered requests/s per ramp step, increasing")
    p.add_argument("--requests", type=int, default=40, help="requests per ramp step")
    p.add_argument("--tokens", type=int, default=256, help="prompt tokens")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--delay-us", type=int, default=1000, help="the poll arms' $DISAGG_NIXL_PROGRESS_DELAY_US")
    p.add_argument("--idle-s", type=float, default=5.0)
    p.add_argument("--timeout", type=float, default=30.0, help="per-request timeout (client and router)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=15)
    p.add_argument("--quick", action="store_true", help="two steps of 8 requests: checks the harness")
    p.add_argument("--logs")
    p.add_argument("--out", type=Path, default=RESULTS / "capacity.json")
    args = p.parse_args()
    if args.quick:
        args.rates, args.requests, args.idle_s = [1.0, 4.0], 8, 2.0
    result = asyncio.run(main_async(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result_file.write(args.out, result)
    print(json.dumps({"headline": result["headline"], "out": str(args.out)}, indent=1))


if __name__ == "__main__":
    main()
