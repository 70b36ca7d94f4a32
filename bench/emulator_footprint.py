"""What one engine emulator costs its node (issue 35, item 1: at least 32 on the 2-core real node), which sets the
requests of its pods (operator/engine_builders.py EMULATOR_RESOURCES).

A fleet of `disagg emulator` processes (`--pairs` prefill/decode pairs, push, cpu-kv64k) behind one `disagg router`
and a rendezvous, as the operator runs them, minus the pods. Per emulator, from /proc: its resident memory (RSS,
after start and at the end) and its CPU, first idle (`--idle-s`, only the rendezvous heartbeats and the router's
health probes), then busy: every pair served at `--rate` requests/s (Poisson, 256-token prompts, 32 tokens out),
all through one router, which bounds the rate on this bed. A busy figure counts only with no request failed.

  .venv/bin/python bench/emulator_footprint.py             # 16 pairs: 32 emulators (no engine lock needed)

Writes bench/results/emulator_footprint.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path

import aiohttp
import result_file
from pd_client import ALPHABET, one, via

from disagg.devcluster.emulated_engines import EmulatorSpec, LocalEmulator
from disagg.devcluster.engines import LocalRendezvous
from disagg.devcluster.procs import DisaggService, thread_cpu_seconds

RESULTS = Path(__file__).resolve().parent / "results"
RENDEZVOUS = LocalRendezvous(token="footprint", deployment="footprint", heartbeat=5)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_seconds(pid: int) -> float:
    return sum(s for _, s in thread_cpu_seconds([pid]).values())


def sample(emulators: list[LocalEmulator]) -> dict[str, float]:
    """CPU-seconds so far of each emulator's process (its python: `disagg emulator`)."""
    return {e.spec.name: cpu_seconds(e.pid() or 0) for e in emulators}


async def load(url: str, rate: float, seconds: float, seed: int) -> tuple[int, int]:
    rng = random.Random(seed)
    tasks = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        t0 = time.monotonic()
        t = 0.0
        i = 0
        while t < seconds:
            await asyncio.sleep(max(0.0, t0 + t - time.monotonic()))
            text = "".join(rng.choice(ALPHABET) for _ in range(256))
            tasks.append(asyncio.create_task(one(session, via(url), i, text, 32, 60)))
            t += rng.expovariate(rate)
            i += 1
        results = await asyncio.gather(*tasks)
    return len(results), sum(1 for r in results if not r.ok)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=16)
    p.add_argument("--idle-s", type=float, default=20.0)
    p.add_argument("--busy-s", type=float, default=30.0)
    p.add_argument("--rate", type=float, default=1.0,
                   help="requests/s per pair while busy (at 4, 64 streamed requests a second, the one router and this "
                        "client on 2 cores could not keep up: 1,442 of 1,953 failed to connect, the emulators idle)")
    p.add_argument("--out", type=Path, default=RESULTS / "emulator_footprint.json")
    args = p.parse_args()
    made = result_file.provenance()
    logs = Path(f"/tmp/disagg-emulator-footprint-{time.strftime('%Y%m%d-%H%M%S')}")
    logs.mkdir(parents=True)
    rdv = DisaggService("rendezvous", [*RENDEZVOUS.args(), "--log-level", "WARNING"], logs)
    rdv.start()
    rdv.wait_http(rdv.url + "/health")
    env = RENDEZVOUS.engine_env(rdv.url)
    emulators = [LocalEmulator(EmulatorSpec(f"emu-{role}-{i}", role, rendezvous_env=env), logs)
                 for i in range(args.pairs) for role in ("prefill", "decode")]
    router = DisaggService("router", ["router", "--mode", "push", "--rendezvous", rdv.url, "--log-level", "WARNING"],
                           logs)
    try:
        for e in emulators:
            e.start()
        for e in emulators:
            e.wait_ready()
        router.start()
        router.wait_http(router.url + "/health", timeout=60)
        started_rss = {e.spec.name: rss_mib(e.pid() or 0) for e in emulators}
        time.sleep(args.idle_s / 4)  # the first heartbeats and probes settle before the idle window
        before, t0 = sample(emulators), time.monotonic()
        time.sleep(args.idle_s)  # the idle window is the measurement
        idle = {k: (v - before[k]) / (time.monotonic() - t0) for k, v in sample(emulators).items()}
        before, t0 = sample(emulators), time.monotonic()
        sent, failed = asyncio.run(load(router.url, args.rate * args.pairs, args.busy_s, 35))
        busy = {k: (v - before[k]) / (time.monotonic() - t0) for k, v in sample(emulators).items()}
        end_rss = {e.spec.name: rss_mib(e.pid() or 0) for e in emulators}
    finally:
        router.stop()
        for e in emulators:
            e.stop()
        rdv.stop()

    def dist(values: list[float], scale: float = 1.0, digits: int = 1) -> dict[str, float]:
        v = sorted(x * scale for x in values)
        return {"mean": round(statistics.mean(v), digits), "max": round(v[-1], digits)}

    result = {
        **made, "benchmark": "emulator_footprint", "issue": 35, "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
        "config": {"pairs": args.pairs, "emulators": len(emulators), "profile": "cpu-kv64k", "mode": "push",
                   "idle_s": args.idle_s, "busy_s": args.busy_s, "rate_per_pair": args.rate, "prompt_tokens": 256,
                   "max_tokens": 32, "heartbeat_s": RENDEZVOUS.heartbeat, "router_probe_interval_s": 1},
        "headline": {
            "rss_mib_after_start": dist(list(started_rss.values())),
            "rss_mib_at_end": dist(list(end_rss.values())),
            "idle_millicores": dist(list(idle.values()), 1000),
            "busy_millicores": dist(list(busy.values()), 1000),
            "busy_requests": sent, "busy_failed": failed,
        },
        "per_emulator": {name: {"rss_mib_after_start": round(started_rss[name], 1),
                                "rss_mib_at_end": round(end_rss[name], 1),
                                "idle_millicores": round(idle[name] * 1000, 1),
                                "busy_millicores": round(busy[name] * 1000, 1)} for name in started_rss},
    }
    result_file.write(args.out, result)
    print(json.dumps(result["headline"], indent=1))


if __name__ == "__main__":
    main()
