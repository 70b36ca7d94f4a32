"""Overload protection (issue 35, item 4): at 5x the saturation rate, the requests our router admits keep their TTFT
p99 within 2x of the p99 at saturation, the excess gets 429s, and the router's RSS stays flat.

Beds, one at a time (`--beds`), each a push pair behind `disagg router --mode push` (with its access log, as the
operator runs it), prefill pinned to core 0 and decode to core 1, advertised to a `disagg rendezvous`:

  emulator  two `disagg emulator --profile cpu-kv64k --time-scale T` (stand-in engines that compute nothing, timed
            like the bed's CPU engines, T times faster so that saturation is tens of requests a second)
  real      the tiny model on two vLLM CPU engines with the connector plugin (needs the engines lock)

Per bed and run, Poisson arrivals of seeded 256-token prompts asking for 16 streamed tokens:
1. a ramp through the bounded router (`--ramp-rates`, `--ramp-s` seconds each) until two steps in a row serve under
   90% of the offered rate: the saturation rate R is the highest rate served at 90% or more;
2. `--rounds` ABBA rounds of two arms through that router, `--seconds` each: `saturation` (R) and `overload` (5R);
3. `unbounded`: 5R for `--seconds` through a router with no bounds (the router before this change), for contrast.
Between arms the bench waits until the engines run and queue nothing. Per request: HTTP status and, for a 200, TTFT
(send to first streamed token, this client's clock). The routers' RSS is sampled every 0.25 s, their CPU read from
/proc per arm, and their cycle collections logged (bench/router_stubs.py's GC_PRELUDE).

Headline per bed, pooled over rounds (and runs, `--combine`): the overload arm's TTFT p99 of admitted requests over
the saturation arm's, with a bootstrap 90% interval over requests (goal: at most 2); the overload arm's share of
429s and its failures other than 429 (goal: none); its served rate over the saturation arm's; the bounded router's
RSS at the end of the overload arms over before them (goal: flat, within 10%); the same for `unbounded`.

  flock /tmp/disagg-engines.lock .venv/bin/python bench/overload.py --out bench/results/runs/overload-1.json
  (three times, then) .venv/bin/python bench/overload.py --combine bench/results/runs/overload-*.json*
About 12 minutes a run with both beds. Writes bench/results/overload.json. `--quick` checks the harness.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import result_file
from interrupt import stop_cleanly_on_sigterm
from pd_client import Result, completion_body, percentile_ratio_ci, quantile, read_stream
from pd_serving import Cell, arm_tag, workload
from router_stubs import GC_PRELUDE, cpu_seconds, gc_pauses

from disagg.devcluster import tinymodel, vllm_env
from disagg.devcluster.cluster import free_port
from disagg.devcluster.emulated_engines import EmulatorSpec, LocalEmulator
from disagg.devcluster.engines import EngineSpec, LocalEngine, LocalRendezvous, install_plugin
from disagg.devcluster.procs import DisaggService, HttpChild

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
GOAL_P99 = 2.0
"""Admitted TTFT p99 at 5x saturation over TTFT p99 at saturation (issue 35)."""
FLAT = 1.1
"""RSS at the end of the overload arms over RSS before them: "flat" read as within 10%."""
SUSTAINED = 0.9
MEET = LocalRendezvous(token="overload-bench", deployment="bench", heartbeat=2)


def log(msg: str) -> None:
    print(f"[overload {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- the beds ----------------------------------------------------------------------------------------------------
class Bed:
    """A rendezvous, a push pair advertised to it, and routers in front of it."""

    def __init__(self, name: str, logs: Path) -> None:
        self.name, self.logs = name, logs / name
        self.logs.mkdir(parents=True, exist_ok=True)
        self.rendezvous = DisaggService(f"{name}-rendezvous", [*MEET.args(), "--log-level", "WARNING"], self.logs)
        self.rendezvous.start()
        self.rendezvous.wait_http(self.rendezvous.url + "/health")
        self.env = MEET.engine_env(self.rendezvous.url)
        self.engines: list[Any] = []
        self.routers: list[HttpChild] = []

    def engine_urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def router(self, name: str, bounds: list[str], timeout: float) -> Router:
        """`disagg router` with `bounds` (its overload flags), logging its cycle collections."""
        port, gc_log, access = free_port(), self.logs / f"{name}.gc.jsonl", self.logs / f"{name}.access.jsonl"
        code = GC_PRELUDE + "from disagg.cli import main; sys.argv[0] = 'disagg'; main()\n"
        argv = [sys.executable, "-c", code, str(gc_log), "router", "--mode", "push", "--rendezvous",
                self.rendezvous.url, "--request-timeout", str(timeout), "--log-level", "WARNING", "--access-log",
                str(access), "--host", "127.0.0.1", "--port", str(port), *bounds]
        p = HttpChild(name, argv, self.logs / f"{name}.log").start()
        url = f"http://127.0.0.1:{port}"
        p.wait_http(url + "/health", timeout=120)  # 200 once its probes see the pair
        self.routers.append(p)
        assert p.popen is not None
        return Router(name, url, p.popen.pid, gc_log, bounds)

    def stop(self) -> None:
        for r in self.routers:
            r.stop(5)
        for e in self.engines:
            e.stop()
        self.rendezvous.stop(5)


class EmulatorBed(Bed):
    def __init__(self, logs: Path, time_scale: float) -> None:
        super().__init__("emulator", logs)
        flags = ["--time-scale", f"{time_scale:g}", "--log-level", "WARNING"]
        self.engines = [LocalEmulator(EmulatorSpec(f"emu-{role}", role, rendezvous_env=self.env, flags=flags,
                                                   kv_events=False), self.logs).start()
                        for role in ("prefill", "decode")]
        for e in self.engines:
            e.wait_ready()
        for e, core in zip(self.engines, (0, 1), strict=True):
            os.sched_setaffinity(e.pid(), {core})


class RealBed(Bed):
    def __init__(self, logs: Path) -> None:
        super().__init__("real", logs)
        python = vllm_env.ensure(quiet=True)
        model = tinymodel.ensure_model(python)
        plugin = install_plugin(self.logs / "plugin")
        self.engines = [LocalEngine(EngineSpec(f"real-{role}", role, model, core=core, mode="push",
                                               plugin_dir=plugin, extra_env=self.env, max_model_len=4096,
                                               push_registration_timeout=60), python, self.logs)
                        for role, core in (("prefill", 0), ("decode", 1))]
        for e in self.engines:
            e.start()
        for e in self.engines:
            e.wait_ready()


@dataclass
class Router:
    name: str
    url: str
    pid: int
    gc_log: Path
    bounds: list[str]

    def rss_kib(self) -> int | None:
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        except OSError:
            return None
        return None


# -- load ----------------------------------------------------------------------------------------------------------
async def one(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int,
              timeout: float) -> tuple[int, float | None]:
    """(HTTP status, TTFT in seconds for a 200); status 0 for a failure without one, -1 for this client's timeout."""
    res = Result(0, ok=False, sent=time.monotonic())
    try:
        async with asyncio.timeout(timeout):
            async with session.post(url + "/v1/completions", json=completion_body(prompt, max_tokens)) as r:
                if r.status != 200:
                    await r.read()
                    return r.status, None
                await read_stream(r, res)
                return 200, res.ttft
    except TimeoutError:
        return -1, None
    except (aiohttp.ClientError, RuntimeError, ValueError):
        return 0, None


async def arm(session: aiohttp.ClientSession, router: Router, name: str, rate: float, seconds: float, seed: int,
              args: argparse.Namespace) -> dict[str, Any]:
    """`seconds` of Poisson arrivals at `rate` through `router`: per request [offset s, status, TTFT ms], the served
    rate, and what the router used meanwhile (RSS samples, CPU)."""
    cell = Cell(args.tokens, rate)
    reqs = workload(cell, max(1, int(rate * seconds)), seed)
    tag = arm_tag(f"{router.name}/{name}/{seed}", cell)
    rows: list[list[Any]] = []
    rss: list[int] = []
    done = asyncio.Event()

    async def sample() -> None:
        while not done.is_set():
            kib = router.rss_kib()
            if kib is not None:
                rss.append(kib)
            try:
                await asyncio.wait_for(done.wait(), 0.25)
            except TimeoutError:
                pass

    async def fire(at: float, prompt: str) -> None:
        await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
        sent = time.monotonic()
        status, ttft = await one(session, router.url, tag + prompt, args.max_tokens, args.timeout)
        rows.append([round(sent - t0, 3), status, None if ttft is None else round(ttft * 1000, 1),
                     round((time.monotonic() - t0), 3)])

    cpu0, before = cpu_seconds([router.pid]), scrape(router.url)
    sampler = asyncio.create_task(sample())
    t0 = time.monotonic()
    await asyncio.gather(*(fire(r.arrival, r.prompt) for r in reqs))
    done.set()
    await sampler
    wall = time.monotonic() - t0
    after = scrape(router.url)
    ok = [r for r in rows if r[1] == 200]
    end = max((r[3] for r in ok), default=wall)
    out = {"arm": name, "router": router.name, "rate_rps": rate, "seconds": seconds, "seed": seed,
           "sent": len(rows), "ok": len(ok), "refused_429": sum(r[1] == 429 for r in rows),
           "failed": sum(r[1] not in (200, 429) for r in rows),
           "served_rps": round(len(ok) / end, 3) if end > 0 else None,
           "router_cpu_s": round(cpu_seconds([router.pid]) - cpu0, 2),
           "rss_kib": {"first": rss[0] if rss else None, "max": max(rss, default=None),
                       "last": rss[-1] if rss else None},
           "router_counters": {k: after.get(k, 0) - before.get(k, 0) for k in after},
           "statuses": sorted({r[1] for r in rows}),
           "requests": sorted(rows)}
    ttft = [r[2] for r in ok]
    log(f"  {router.name} {name} {rate:g}/s: {len(ok)}/{len(rows)} ok, {out['refused_429']} 429, {out['failed']} "
        f"failed, served {out['served_rps']}/s, TTFT p50 {quantile(ttft, 0.5)} p99 {quantile(ttft, 0.99)} ms, "
        f"RSS {out['rss_kib']} KiB, router CPU {out['router_cpu_s']} s")
    return out


COUNTERS = ("disagg_router_admitted_total", "disagg_router_queued_total", "disagg_router_rejected_total")


def scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name in COUNTERS:
            if line.startswith(name):
                out[line.split(" ")[0]] = float(line.rsplit(" ", 1)[1])
    return out


def engines_idle(bed: Bed, timeout: float = 180) -> float | None:
    """Seconds until every engine runs and queues nothing (vLLM's gauges, which the emulator exports too)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        busy = 0.0
        for url in bed.engine_urls():
            text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
            busy += sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                        if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")))
        if busy == 0:
            return round(time.monotonic() - t0, 2)
        time.sleep(0.25)  # another process's state: nothing to await
    return None


async def ramp(session: aiohttp.ClientSession, bed: Bed, router: Router, args: argparse.Namespace) -> dict:
    steps, short = [], 0
    for rate in args.ramp_rates:
        s = await arm(session, router, "ramp", rate, args.ramp_s, args.seed, args)
        s.pop("requests")
        steps.append(s)
        engines_idle(bed)
        short = short + 1 if (s["served_rps"] or 0) < SUSTAINED * rate else 0
        if short >= 2:
            break
    sustained = [s["rate_rps"] for s in steps if (s["served_rps"] or 0) >= SUSTAINED * s["rate_rps"]]
    return {"steps": steps, "saturation_rps": max(sustained, default=args.ramp_rates[0]),
            "best_served_rps": max((s["served_rps"] or 0 for s in steps), default=0.0)}


async def run_bed(bed: Bed, args: argparse.Namespace, bounds: list[str]) -> dict:
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as session:
        bounded = bed.router(f"{bed.name}-bounded", bounds, args.timeout)
        unbounded = bed.router(f"{bed.name}-unbounded", ["--max-inflight", "0", "--max-inflight-per-engine", "0"],
                               args.timeout)
        for r in (bounded, unbounded):  # a few requests one at a time: the pair's first requests are slow
            for i in range(3):
                await one(session, r.url, arm_tag(f"warm/{r.name}/{i}") + "x" * 200, args.max_tokens, args.timeout)
        t0 = time.time()
        if args.saturation_rps:
            calibration = {"steps": [], "saturation_rps": args.saturation_rps, "given": True}
        else:
            calibration = await ramp(session, bed, bounded, args)
        rate = calibration["saturation_rps"]
        log(f"{bed.name}: saturation {rate} req/s (best served {calibration.get('best_served_rps')})")
        rss_before_overload = bounded.rss_kib()
        arms: dict[str, list[dict]] = {"saturation": [], "overload": [], "unbounded": []}
        for rnd in range(args.rounds):
            for name in (("saturation", "overload") if rnd % 2 == 0 else ("overload", "saturation")):
                x = 1.0 if name == "saturation" else args.factor
                arms[name].append(await arm(session, bounded, name, rate * x, args.seconds, args.seed + rnd, args))
                arms[name][-1]["engines_idle_after_s"] = engines_idle(bed)
        rss_after_overload = bounded.rss_kib()
        if args.unbounded_s > 0:
            arms["unbounded"].append(await arm(session, unbounded, "unbounded", rate * args.factor, args.unbounded_s,
                                               args.seed, args))
            arms["unbounded"][-1]["engines_idle_after_s"] = engines_idle(bed)
        windows = {"all": (t0, time.time())}
    return {"bounds": bounds, "calibration": calibration, "saturation_rps": rate, "arms": arms,
            "bounded_rss_kib": {"before_overload": rss_before_overload, "after_overload": rss_after_overload},
            "gc": {r.name: gc_pauses(r.gc_log, windows)["all"] for r in (bounded, unbounded)}}


# -- summary -------------------------------------------------------------------------------------------------------
def ttfts(arms: list[dict]) -> list[float]:
    """TTFTs (ms) of the requests answered in `arms`; rows are [offset, status, TTFT, end], led by the run when
    pooled."""
    return [r[-2] for a in arms for r in a["requests"] if r[-3] == 200 and r[-2] is not None]


def headline(bed: dict, seed: int) -> dict:
    rng = random.Random(seed)
    sat, over, unb = (bed["arms"][k] for k in ("saturation", "overload", "unbounded"))
    out: dict[str, Any] = {}
    for q, key in ((0.99, "p99"), (0.5, "p50")):
        a, b = ttfts(over), ttfts(sat)
        out[f"ttft_{key}_ms"] = {"saturation": quantile(b, q), "overload": quantile(a, q),
                                 "unbounded": quantile(ttfts(unb), q) if unb else None}
        out[f"overload_over_saturation_{key}"] = round(quantile(a, q) / quantile(b, q), 3) if a and b else None
        out[f"overload_over_saturation_{key}_ci90"] = percentile_ratio_ci(a, b, q, rng, n=1000)
        if unb:
            u = ttfts(unb)
            out[f"unbounded_over_saturation_{key}"] = round(quantile(u, q) / quantile(b, q), 3) if u and b else None
    for name, arms in (("saturation", sat), ("overload", over), ("unbounded", unb)):
        if not arms:
            continue
        sent = sum(a["sent"] for a in arms)
        out[name] = {"sent": sent, "ok": sum(a["ok"] for a in arms),
                     "refused_429": sum(a["refused_429"] for a in arms),
                     "failed": sum(a["failed"] for a in arms),
                     "refused_share": round(sum(a["refused_429"] for a in arms) / sent, 3) if sent else None,
                     "served_rps_mean": round(sum(a["served_rps"] or 0 for a in arms) / len(arms), 2),
                     "router_cpu_s_per_arm": round(sum(a["router_cpu_s"] for a in arms) / len(arms), 2)}
    out["overload_served_over_saturation_served"] = round(out["overload"]["served_rps_mean"]
                                                          / out["saturation"]["served_rps_mean"], 3)
    rss = bed["bounded_rss_kib"]
    if rss["before_overload"] and rss["after_overload"]:
        out["bounded_rss_after_over_before"] = round(rss["after_overload"] / rss["before_overload"], 3)
        out["bounded_rss_max_kib"] = max(a["rss_kib"]["max"] or 0 for a in over + sat)
    if unb and unb[0]["rss_kib"]["first"]:
        out["unbounded_rss_max_over_first"] = round(unb[0]["rss_kib"]["max"] / unb[0]["rss_kib"]["first"], 3)
    return out


def combine(paths: list[Path]) -> dict:
    """One result from runs of the same code: every request of every run pooled per bed and arm (the headline), and
    each run's own headline beside it (a goal is judged on the runs, not the best one)."""
    runs = [result_file.load(p) for p in paths]
    commits = {r["commit"] for r in runs}
    if len(commits) != 1:
        raise SystemExit(f"runs of different code: {sorted(commits)}")
    beds: dict[str, Any] = {}
    for name in runs[0]["beds"]:
        pooled: dict[str, Any] = {"arms": {k: [] for k in ("saturation", "overload", "unbounded")},
                                  "saturation_rps": [r["beds"][name]["saturation_rps"] for r in runs],
                                  "bounds": runs[0]["beds"][name]["bounds"]}
        for i, run in enumerate(runs):
            for k, arms in run["beds"][name]["arms"].items():
                pooled["arms"][k] += [{**a, "run": i, "requests": [[i, *row] for row in a["requests"]]}
                                      for a in arms]
        before = [r["beds"][name]["bounded_rss_kib"]["before_overload"] for r in runs]
        after = [r["beds"][name]["bounded_rss_kib"]["after_overload"] for r in runs]
        pooled["bounded_rss_kib"] = {"before_overload": max(before), "after_overload": max(after)}
        pooled["headline"] = headline(pooled, 0)
        pooled["per_run"] = [r["beds"][name]["headline"] for r in runs]
        pooled["gc"] = [r["beds"][name]["gc"] for r in runs]
        beds[name] = pooled
    first = runs[0]
    return {"benchmark": "overload", "issue": 35, "when": max(r["when"] for r in runs), "commit": first["commit"],
            "command": f"{first['command']}  (x{len(runs)}), then bench/overload.py --combine", "config":
                first["config"], "definitions": first["definitions"], "machine": first["machine"],
            "runs": [{"file": p.name, "when": r["when"], "command": r["command"], "machine": r["machine"],
                      "loadavg_at_end": r.get("loadavg_at_end")} for p, r in zip(paths, runs, strict=True)],
            "beds": beds}


DEFINITIONS = {
    "requests": "[offset s from the arm's start, HTTP status (0: failed without one, -1: this client's timeout), "
                "TTFT ms for a 200, end offset s], led by the run when runs are pooled",
    "overload_over_saturation_p99": "TTFT p99 of the overload arm's answered requests over the saturation arm's, "
                                    "pooled over rounds (and runs), with a bootstrap 90% interval over requests",
    "saturation_rps": "the highest ramp rate the bounded router's pair served at 90% or more",
    "bounded_rss_after_over_before": "the bounded router's RSS after the last overload arm over before the first",
}


def main() -> None:
    stop_cleanly_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--beds", default="emulator,real")
    p.add_argument("--time-scale", type=float, default=0.1, help="the emulators' --time-scale")
    p.add_argument("--bounds-emulator", default="--max-inflight-per-engine 12 --max-queue 8 --queue-wait-seconds 0.5")
    p.add_argument("--bounds-real", default="--max-inflight-per-engine 12 --max-queue 8 --queue-wait-seconds 0.5")
    p.add_argument("--ramp-rates", type=lambda s: [float(x) for x in s.split(",")],
                   default=[8.0, 12.0, 16.0, 20.0, 24.0, 28.0, 32.0, 40.0, 48.0])
    p.add_argument("--ramp-s", type=float, default=15.0)
    p.add_argument("--saturation-rps", type=float, default=0.0, help="skip the ramp: this is the saturation rate")
    p.add_argument("--factor", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--unbounded-s", type=float, default=20.0, help="0: no unbounded arm")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=35)
    p.add_argument("--quick", action="store_true", help="one round of 8 s arms and a short ramp")
    p.add_argument("--out", type=Path, default=RESULTS / "overload.json")
    p.add_argument("--combine", nargs="+", type=Path, help="pool these runs' result files into --out instead")
    args = p.parse_args()
    if args.combine:
        result_file.write(args.out, combine(args.combine))
        return
    if args.quick:
        args.rounds, args.seconds, args.ramp_s, args.unbounded_s = 1, 8.0, 5.0, 5.0
    made = result_file.provenance()
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / f"overload-{time.strftime('%Y%m%d-%H%M%S')}"
    logs.mkdir(parents=True)
    log(f"logs: {logs}")
    beds = {}
    for name in args.beds.split(","):
        bed: Bed = EmulatorBed(logs, args.time_scale) if name == "emulator" else RealBed(logs)
        try:
            beds[name] = asyncio.run(run_bed(bed, args, getattr(args, f"bounds_{name}").split()))
        finally:
            bed.stop()
        beds[name]["headline"] = headline(beds[name], args.seed)
        log(f"{name}: {json.dumps(beds[name]['headline'])}")
    result = {"benchmark": "overload", "issue": 35, "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **made,
              "loadavg_at_end": Path("/proc/loadavg").read_text().split()[:3],
              "config": {k: getattr(args, k) for k in ("beds", "time_scale", "bounds_emulator", "bounds_real",
                                                       "ramp_rates", "ramp_s", "factor", "rounds", "seconds",
                                                       "unbounded_s", "tokens", "max_tokens", "timeout", "seed")}
              | {"layout": "prefill pinned to core 0, decode to core 1; routers, rendezvous and this client "
                           "unpinned", "logs": str(logs)},
              "definitions": DEFINITIONS, "beds": beds}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log(f"wrote {result_file.write(args.out, result)}")


if __name__ == "__main__":
    main()
