"""The router's own cost (issue 15, item 4): our router against vllm-router, on stub engines that answer at once.

Real engines bury a router's milliseconds; stubs (bench/stub_engine.py) leave only HTTP and the proxies. Arms:

  direct-push, direct-pull   this client sends both legs itself with the router's protocol functions: no router
  router-push, router-pull   `disagg router` of this checkout
  before-push, before-pull   `disagg router` of `--before REV` (a git worktree of that commit): before vs after
  vllm-router-pull           PyPI vllm-router (Rust), `--vllm-pd-disaggregation --kv-connector nixl` (no push mode)

The router under test runs alone on `--router-core` (one core, as a router pod with one CPU); the stubs and this
client share the other core. Two measurements, each over the same seeded prompts and Poisson arrivals for
every arm:

- latency cells (`--cells`, prompt tokens @ req/s): `--rounds` rounds of `--requests` requests per arm, the arms
  in ABBA order (the order reversed every other round), so drift and whichever arm goes first weigh on all alike.
  A router's added latency is its TTFT quantile minus the direct arm's of the same mode, with a bootstrap 90%
  interval over requests; p50 and p99.
- the ramp (`--rates`): per arm, `--step-s` seconds of arrivals at each rate until two steps achieve under 90% of
  the offered rate. Saturation throughput is the highest achieved (completed / (last completion - step start)).
  The router's CPU per request (its process tree's user + system time over the step, from /proc) says what a
  core of it costs, whoever saturates first.

Our two Python routers (this checkout and --before) also log every cycle collection with its duration: count and
longest stop per window (latency cells, ramps).

Run: `.venv/bin/python bench/router_stubs.py --before HEAD~3` (about 15 minutes with `--requests 500`; no
engines, but it wants the machine quiet). Writes bench/results/router_stubs.json.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import result_file
from pd_client import direct_pull, direct_push, quantile, via
from pd_serving import (
    RESULTS,
    VLLM_ROUTER_VERSION,
    Cell,
    Config,
    Stub,
    abba,
    log,
    merge_rounds,
    parse_cells,
    per_request,
    run_cell,
    vllm_router_python,
    warm,
)

from disagg.devcluster.build import cache_dir
from disagg.devcluster.cluster import free_port
from disagg.devcluster.procs import HttpChild, process_group

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SATURATED = 0.9
"""A ramp step whose achieved throughput is under this share of the offered rate did not keep up."""
PYTHON_ROUTERS = ("router-", "before-")
ARMS = ("direct-push", "router-push", "before-push", "direct-pull", "router-pull", "before-pull", "vllm-router-pull")


@dataclass
class Arm:
    name: str
    mode: str
    description: str
    url: str | None = None  # a router's; None for the direct arms
    pids: list[int] = field(default_factory=list)  # the router's process group, for its CPU
    direct: object = None  # the direct arms' sender

    def sender(self):  # noqa: ANN201 - a pd_client Sender
        return self.direct if self.url is None else via(self.url)


# -- the routers ---------------------------------------------------------------------------------------------------
def pin(pid: int, core: int) -> None:
    """`pid` and every thread and child it has now onto `core`."""
    subprocess.run(["taskset", "-a", "-p", "-c", str(core), str(pid)], check=True, capture_output=True)


def before_tree(rev: str, logs: Path) -> Path:
    """The package of commit `rev` laid out as installed (disagg/connector, ...), from a git worktree."""
    sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", f"{rev}^{{commit}}"], check=True,
                         capture_output=True, text=True).stdout.strip()
    work = cache_dir() / "bench-before" / sha[:12]
    if not (work / "connector").exists():
        work.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--force", str(work), sha],
                       check=True, capture_output=True)
    tree = logs / f"before-{sha[:12]}"
    (tree / "disagg").mkdir(parents=True, exist_ok=True)
    for d in ("operator", "connector", "devcluster"):
        link = tree / "disagg" / d
        if not link.exists():
            link.symlink_to(work / d)
    cli = tree / "disagg" / "cli.py"
    if not cli.exists():
        cli.symlink_to(work / "cli" / "cli.py")
    return tree


GC_PRELUDE = """
import gc, json, sys, time
_gc_out, _gc_t = open(sys.argv.pop(1), "a", buffering=1), [0.0]
def _gc_pause(phase, info):
    if phase == "start":
        _gc_t[0] = time.perf_counter()
    else:
        _gc_out.write(json.dumps({"gen": info["generation"], "t": round(time.time(), 3),
                                  "ms": round((time.perf_counter() - _gc_t[0]) * 1000, 3)}) + "\\n")
gc.callbacks.append(_gc_pause)
"""
"""Records every cycle collection of a router arm and how long it stopped the process (one JSON line each)."""


def python_router(name: str, tree: Path | None, mode: str, engines_file: Path, logs: Path,
                  timeout: float) -> tuple[HttpChild, str]:
    """`disagg router` of this checkout (`tree` None) or of the --before commit (its package first on the path),
    with GC_PRELUDE writing its collections to `<name>.gc.jsonl`."""
    port = free_port()
    # The log's first line names the file the router came from: the bench checks it is the wanted tree's.
    code = (GC_PRELUDE + "import disagg.connector.router.app as a; print('router from', a.__file__, flush=True)\n"
            "from disagg.cli import main; sys.argv[0] = 'disagg'; main()")
    argv = [sys.executable, "-c", code, str(logs / f"{name}.gc.jsonl"), "router", "--mode", mode, "--dispatch",
            "concurrent", "--engines-file", str(engines_file), "--request-timeout", str(timeout), "--log-level",
            "WARNING", "--access-log", str(logs / f"{name}.access.jsonl"), "--host", "127.0.0.1", "--port", str(port)]
    p = HttpChild(name, argv, logs / f"{name}.log")
    p.env = {**os.environ, "PYTHONPATH": str(tree)} if tree else None
    p.start()
    url = f"http://127.0.0.1:{port}"
    p.wait_http(url + "/health", timeout=60)
    origin = p.log.read_text().split("router from ", 1)[-1].split("\n", 1)[0]
    if not origin.startswith(str(tree or REPO)):
        raise RuntimeError(f"the {name} router imported {origin}, not {tree or REPO}'s")
    return p, url


def gc_pauses(path: Path, windows: dict[str, tuple[float, float]]) -> dict:
    """A router's cycle collections in each window (time.time() from, to): count, longest and total stop, per
    generation (2 is the full collection)."""
    pauses = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    out: dict = {}
    for window, (start, end) in windows.items():
        out[window] = {}
        for gen in (0, 1, 2):
            ms = [p["ms"] for p in pauses if p["gen"] == gen and start <= p["t"] < end]
            out[window][f"gen{gen}"] = {"collections": len(ms), "longest_ms": max(ms, default=None),
                                        "total_ms": round(sum(ms), 3)}
    return out


def vllm_router_on(prefill: Stub, decode: Stub, logs: Path, timeout: float) -> tuple[HttpChild, str]:
    exe = vllm_router_python()
    port, prom = free_port(), free_port()
    argv = [str(exe), "--vllm-pd-disaggregation", "--kv-connector", "nixl", "--prefill", prefill.url,
            "--decode", decode.url, "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom), "--request-timeout-secs",
            str(int(timeout)), "--worker-startup-check-interval", "1", "--disable-retries", "--log-level", "warning"]
    p = HttpChild("vllm-router", argv, logs / "vllm-router.log").start()
    url = f"http://127.0.0.1:{port}"
    p.wait_http(url + "/health", timeout=90)
    return p, url


def cpu_seconds(pids: list[int]) -> float:
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


# -- measuring -----------------------------------------------------------------------------------------------------
async def latency(arms: list[Arm], cfg: Config) -> dict[str, list[dict]]:
    """Per cell, every arm `cfg.rounds` times in ABBA order; returns arm -> one merged cell per cell."""
    out: dict[str, list[dict]] = {a.name: [] for a in arms}
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as session:
        for arm in arms:
            await warm(session, arm.sender(), arm.name, cfg, max(c.tokens for c in cfg.cells))
        for i, cell in enumerate(cfg.cells):
            k = i % len(arms)
            rounds: dict[str, list[dict]] = {a.name: [] for a in arms}
            for seq, arm in abba(arms[k:] + arms[:k], cfg.rounds):
                cpu0 = cpu_seconds(arm.pids)
                summary, _ = await run_cell(session, arm.sender(), arm.name, cell,
                                            dataclasses.replace(cfg, seed=cfg.seed + seq), None, None)
                summary["router_cpu_ms_per_request"] = per_request_cpu(arm, cpu0, summary)
                rounds[arm.name].append(summary)
                await asyncio.sleep(cfg.gap)
            for arm in arms:
                merged = merge_rounds(rounds[arm.name])
                cpu = [r["router_cpu_ms_per_request"] for r in rounds[arm.name]
                       if r["router_cpu_ms_per_request"] is not None]
                merged["router_cpu_ms_per_request"] = round(sum(cpu) / len(cpu), 3) if cpu else None
                out[arm.name].append(merged)
    return out


def per_request_cpu(arm: Arm, cpu0: float, summary: dict) -> float | None:
    if not arm.pids or not summary["ok"]:
        return None
    return round((cpu_seconds(arm.pids) - cpu0) * 1000 / summary["ok"], 3)


async def ramp(arm: Arm, cfg: Config, rates: list[float], tokens: int, step_s: float) -> list[dict]:
    steps, short = [], 0
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as session:
        await warm(session, arm.sender(), arm.name, cfg, tokens)
        for rate in rates:
            cpu0 = cpu_seconds(arm.pids)
            # A step lasts `step_s` seconds whatever its rate: queues absorb a short burst, so a fixed count of
            # requests would let an arm "keep up" with a rate it cannot sustain.
            step_cfg = dataclasses.replace(cfg, requests=max(100, int(rate * step_s)))
            summary, aborted = await run_cell(session, arm.sender(), arm.name, Cell(tokens, rate), step_cfg, None,
                                              None)
            summary["router_cpu_ms_per_request"] = per_request_cpu(arm, cpu0, summary)
            steps.append(summary)
            short = short + 1 if (summary["throughput_rps"] or 0) < SATURATED * rate else 0
            if aborted or short >= 2:
                break
            await asyncio.sleep(cfg.gap)
    return steps


# -- report --------------------------------------------------------------------------------------------------------
def added(router: dict, direct: dict, q: float, rng: random.Random, n: int = 2000) -> dict:
    """quantile_q(router TTFT) - quantile_q(direct TTFT) in ms, with a bootstrap 90% interval over requests."""
    a, b = per_request(router, "ttft"), per_request(direct, "ttft")
    if not a or not b:
        return {"ms": None, "ci90": None}
    point = quantile(a, q) - quantile(b, q)
    stats = sorted(quantile([rng.choice(a) for _ in a], q) - quantile([rng.choice(b) for _ in b], q)
                   for _ in range(n))
    return {"ms": round(point, 3), "ci90": [round(quantile(stats, 0.05), 3), round(quantile(stats, 0.95), 3)]}


def headline(cells: dict[str, list[dict]], ramps: dict[str, list[dict]], modes: dict[str, str]) -> dict:
    rng = random.Random(0)
    out: dict = {"added_ttft": {}, "saturation_rps": {}, "router_cpu_ms_per_request": {}}
    for arm, arm_cells in cells.items():
        if arm.startswith("direct-"):
            continue
        direct = {c["cell"]: c for c in cells.get(f"direct-{modes[arm]}", [])}
        out["added_ttft"][arm] = {c["cell"]: {"p50": added(c, direct[c["cell"]], 0.5, rng),
                                              "p99": added(c, direct[c["cell"]], 0.99, rng)}
                                  for c in arm_cells if c["cell"] in direct}
        cpu = [c["router_cpu_ms_per_request"] for c in arm_cells if c.get("router_cpu_ms_per_request") is not None]
        out["router_cpu_ms_per_request"][arm] = round(sum(cpu) / len(cpu), 3) if cpu else None
    for arm, steps in ramps.items():
        out["saturation_rps"][arm] = max((s["throughput_rps"] or 0 for s in steps), default=0.0)
    # Our router against vllm-router on the pull protocol, the one both speak: per cell and as the worst cell.
    ours, peer = out["added_ttft"].get("router-pull"), out["added_ttft"].get("vllm-router-pull")
    if ours and peer:
        out["added_p99_router_minus_vllm_router_ms"] = {
            cell: round(ours[cell]["p99"]["ms"] - peer[cell]["p99"]["ms"], 3) for cell in ours if cell in peer}
        # The same difference with its bootstrap interval: TTFT p99 through ours minus through vllm-router.
        theirs = {c["cell"]: c for c in cells.get("vllm-router-pull", [])}
        out["p99_router_minus_vllm_router"] = {
            c["cell"]: added(c, theirs[c["cell"]], 0.99, rng) for c in cells["router-pull"] if c["cell"] in theirs}
    sat = out["saturation_rps"]
    if sat.get("router-pull") and sat.get("vllm-router-pull"):
        out["saturation_router_over_vllm_router"] = round(sat["router-pull"] / sat["vllm-router-pull"], 3)
    return out


def parse_rates(text: str) -> list[float]:
    """Increasing positive rates; "" for none (no ramp)."""
    rates = [float(x) for x in text.split(",") if x.strip()]
    if not text.strip():
        return []
    if not rates or any(r <= 0 or not math.isfinite(r) for r in rates) or rates != sorted(rates):
        raise argparse.ArgumentTypeError(f"--rates wants increasing positive numbers, got {text!r}")
    return rates


async def main_async(args: argparse.Namespace) -> dict:
    made = result_file.provenance()
    default = [a for a in ARMS if args.before or not a.startswith("before-")]
    wanted = [a for a in args.arms.split(",") if a] if args.arms else default
    if set(wanted) - set(ARMS):
        raise SystemExit(f"unknown arms {sorted(set(wanted) - set(ARMS))}; known: {list(ARMS)}")
    if any(a.startswith("before-") for a in wanted) and not args.before:
        raise SystemExit("before-* arms need --before REV")
    logs = Path(args.logs or cache_dir() / "bench-logs" / time.strftime("router-stubs-%Y%m%d-%H%M%S"))
    logs.mkdir(parents=True, exist_ok=True)
    log(f"logs: {logs}")
    other = 1 - args.router_core
    os.sched_setaffinity(0, {other})  # this client, and the stubs it starts, keep off the router's core
    prefill, decode = Stub("stub-prefill", "prefill", logs), Stub("stub-decode", "decode", logs)
    procs: list[HttpChild] = []
    try:
        for st in (prefill, decode):
            procs.append(st.proc.start())
        for st in (prefill, decode):
            st.proc.wait_http(st.url + "/health", timeout=30)
        files = {}
        for mode in ("push", "pull"):
            files[mode] = logs / f"stub-{mode}-engines.json"
            files[mode].write_text(json.dumps([prefill.advertisement(mode).model_dump(),
                                               decode.advertisement(mode).model_dump()]))
        tree = before_tree(args.before, logs) if args.before else None
        arms: list[Arm] = []
        for name in wanted:
            mode = "pull" if name.endswith("pull") else "push"
            if name == "direct-push":
                arms.append(Arm(name, mode, "this client sends both legs at once (push protocol, no router)",
                                direct=direct_push(prefill.url, decode.url, prefill.advertisement("push"))))
                continue
            if name == "direct-pull":
                arms.append(Arm(name, mode, "this client sends prefill, then decode (pull protocol, no router)",
                                direct=direct_pull(prefill.url, decode.url)))
                continue
            if name.startswith("router-"):
                proc, url = python_router(name, None, mode, files[mode], logs, args.timeout)
                desc = f"disagg router --mode {mode} (this checkout)"
            elif name.startswith("before-"):
                proc, url = python_router(name, tree, mode, files[mode], logs, args.timeout)
                desc = f"disagg router --mode {mode} of {args.before}"
            else:
                proc, url = vllm_router_on(prefill, decode, logs, args.timeout)
                desc = f"vllm-router {VLLM_ROUTER_VERSION} --vllm-pd-disaggregation --kv-connector nixl"
            procs.append(proc)
            assert proc.popen is not None
            pids = process_group(proc.popen.pid)
            for pid in pids:
                pin(pid, args.router_core)
            arms.append(Arm(name, mode, desc, url=url, pids=pids))
        cfg = Config(cells=parse_cells(args.cells) if args.cells else [], requests=args.requests,
                     max_tokens=args.max_tokens, timeout=args.timeout, seed=args.seed, warmup=3,
                     rounds=args.rounds, gap=0.5)
        t0, since = time.monotonic(), time.time()
        cells = await latency(arms, cfg) if cfg.cells else {a.name: [] for a in arms}
        cells_end = time.time()
        ramps: dict[str, list[dict]] = {}
        if args.rates:
            ramp_cfg = dataclasses.replace(cfg, rounds=1)
            for arm in arms:
                log(f"ramp {arm.name}")
                ramps[arm.name] = await ramp(arm, ramp_cfg, args.rates, args.ramp_tokens, args.step_s)
        windows = {"latency_cells": (since, cells_end), "ramp": (cells_end, time.time())}
    finally:
        for p in procs:
            p.stop()
    modes = {a.name: a.mode for a in arms}
    return {
        **made,
        "benchmark": "router_stubs",
        "issue": 15,
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {**made["machine"],
                    "router_core": args.router_core,
                    "note": f"the router under test alone on core {args.router_core}; the two stubs and this client "
                            f"on core {other}"},
        "config": {"cells": [c.name for c in cfg.cells], "requests_per_round": cfg.requests, "rounds": cfg.rounds,
                   "max_tokens": cfg.max_tokens, "seed": cfg.seed, "rates": args.rates,
                   "ramp_step_s": args.step_s, "ramp_tokens": args.ramp_tokens, "before": args.before,
                   "order": "per cell, the arms in ABBA rounds (the first arm rotating from cell to cell), round r "
                            "with seed + r; then one ramp per arm"},
        "definitions": {
            "added_ttft": "quantile of the router arm's TTFT minus the direct arm's of the same mode, per cell, with "
                          "a bootstrap 90% interval over requests",
            "saturation_rps": "the highest achieved throughput of the arm's ramp",
            "router_cpu_ms_per_request": "the router's user + system CPU over a cell, per completed request",
            "gc": "our routers' cycle collections (gc.callbacks) during the latency cells and during the ramps "
                  "(every arm's, one after another): count, longest and total stop per generation",
        },
        "arms": {a.name: arm_result(a, cells[a.name], ramps.get(a.name, []), logs, windows) for a in arms},
        "headline": headline(cells, ramps, modes),
        "wall_s": round(time.monotonic() - t0, 1),
    }


def arm_result(arm: Arm, cells: list[dict], ramp: list[dict], logs: Path,
               windows: dict[str, tuple[float, float]]) -> dict:
    out = {"mode": arm.mode, "description": arm.description, "cells": cells, "ramp": ramp}
    if arm.name.startswith(PYTHON_ROUTERS):
        out["gc"] = gc_pauses(logs / f"{arm.name}.gc.jsonl", windows)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arms", help="default: every arm, the before-* arms only with --before")
    p.add_argument("--before", help="a commit whose router runs as the before-* arms")
    p.add_argument("--cells", default="256@50,2048@50")
    p.add_argument("--requests", type=int, default=250, help="per cell, arm and round")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--rates", type=parse_rates, default=parse_rates("200,400,800,1200,1600,2000,2500,3000"))
    p.add_argument("--step-s", type=float, default=4.0, help="seconds of arrivals per ramp step")
    p.add_argument("--ramp-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--router-core", type=int, default=0, choices=(0, 1))
    p.add_argument("--logs")
    p.add_argument("--out", default=str(RESULTS / "router_stubs.json"))
    args = p.parse_args()
    result = asyncio.run(main_async(args))
    out = result_file.write(Path(args.out), result)
    print(json.dumps(result["headline"], indent=2))
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
