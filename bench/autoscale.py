"""Autoscaling against a load trace (issue 35): the built-in planner against a static fleet sized for the peak, each
arm on the same seeded trace through the router Service of an emulated deployment on the real node.

The deployment: engine emulators of the `cpu-kv64k` profile (fitted to this bed's vLLM CPU engines,
connector/emulator/profiles.py), push, one router. The planner arm has spec.autoscaling (--max per role, the
per-engine throughputs and SLO below); the static arm runs --static prefill and decode engines throughout.

The trace, open loop (Poisson arrivals at the phase's rate; a sine phase's rate is followed by thinning):
  base     --base-rate          for --base-s      prompts of 200 tokens, 128 out
  step     4 x --base-rate      for --step-s      the same lengths
  back     --base-rate          for --back-s
  diurnal  1x -> 3x -> 1x (a sine's hump) over --diurnal-s, prompts of 400 tokens, 32 out
With the defaults the step needs more decode than prefill and the diurnal hump the other way round (the P:D ratio
the planner must follow), and a static fleet of 3 prefill and 3 decode covers both peaks.
Every request is streamed; per request: when it was sent, its status, TTFT (send to first token) and TPOT (first to
last token over the tokens after the first). Every 2 s: each role's desired count (its DisaggregatedRole) and its
engine pods (scheduled, not being deleted).

Per arm, headline:
- SLO attainment: requests with both TTFT <= --ttft-ms and TPOT <= --tpot-ms, over the requests sent outside an
  engine start window (from a role's desired count rising until its ready engines reach it). Goal >= 99%;
- replica-seconds: engine pods x seconds over the trace (goal for the planner: <= 0.6x the static arm's);
- reaction: seconds from the step's start to the first rise of a desired count (goal <= 30 s);
- actions per role per 10 minutes in the steady part of flat phases (after --settle-s: the planner's window, its
  scale-down cooldown and an engine's start, so following the phase's change is not counted; goal <= 1), per
  round and pooled over the rounds' steady time;
- failed requests (goal 0).
Arms alternate (ABBA over --rounds), each on a fresh deployment. `--arms` adds the issue's third arm, `keda`: a
conventional autoscaler on one queue metric per role, as a user who already runs KEDA would set it up. The CR
has no spec.autoscaling and starts at 1P1D; one ScaledObject per role (KEDA built from Go modules and run beside
the control plane, devcluster/keda.py) reads `vllm:num_requests_waiting` from every engine of the role (KEDA's
metrics-api scaler over the role's headless Service's endpoints, summed) and asks for one engine per
--keda-waiting requests waiting, within 1 and --max, with KEDA's and the HPA's default polling and stabilization.

  flock /tmp/disagg-engines.lock .venv/bin/python bench/autoscale.py     # 3 rounds of 3 arms: about 90 minutes
Writes bench/results/autoscale.json and its plot, autoscale.png (bench/plot_autoscale.py: per arm, load and engine
pods over the trace, and TTFT). `--quick` shortens every phase to check the harness.

The trace is short (9.5 minutes) so that three rounds of three arms fit one sitting; the planner arm's scale-down
is quickened with it (--scale-down-cooldown, --scale-down-max-step), as a user would for loads that move by the
minute. The operator runs with the chart's planner tick and window unless --autoscale-seconds or
--autoscale-window-seconds set them.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import result_file
from interrupt import stop_cleanly_on_sigterm
from lightkube import codecs
from pd_client import dist

from disagg.devcluster import demo, demo_node, keda, tinymodel
from disagg.devcluster.cluster import ClusterConfig, LocalCluster
from disagg.operator import names
from disagg.operator.api import EngineSpec
from disagg.operator.bindings import DinfResource

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
NAMESPACE = demo_node.NAMESPACE
ENGINE_PORT = EngineSpec.model_fields["port"].default  # the CRs here keep it
ROLES = ("prefill", "decode")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- the trace -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Phase:
    name: str
    seconds: float
    rate: float  # requests per second (a sine phase's peak is `peak` x this)
    isl: int
    osl: int
    peak: float = 1.0  # > 1: the rate follows a sine's hump from `rate` to `peak` x `rate` and back

    def rate_at(self, t: float) -> float:
        if self.peak == 1.0:
            return self.rate
        return self.rate * (1 + (self.peak - 1) * math.sin(math.pi * t / self.seconds))


def trace(args: argparse.Namespace) -> list[Phase]:
    r = args.base_rate
    return [Phase("base", args.base_s, r, 200, 128), Phase("step", args.step_s, 4 * r, 200, 128),
            Phase("back", args.back_s, r, 200, 128), Phase("diurnal", args.diurnal_s, r, 400, 32, peak=3.0)]


def arrivals(phases: list[Phase], seed: int) -> list[tuple[float, Phase]]:
    """Seconds from the start at which each request is sent, with its phase: Poisson at each phase's peak rate,
    thinned to the rate at that moment."""
    rng, out, start = random.Random(seed), [], 0.0
    for p in phases:
        top, t = p.rate * p.peak, 0.0
        while True:
            t += rng.expovariate(top)
            if t >= p.seconds:
                break
            if rng.random() * top <= p.rate_at(t):
                out.append((start + t, p))
        start += p.seconds
    return out


# -- one arm -------------------------------------------------------------------------------------------------------
@dataclass
class Sent:
    at: float
    phase: str
    status: int = 0
    ttft: float | None = None
    tpot: float | None = None
    error: str | None = None


async def send(session: aiohttp.ClientSession, url: str, prompt: str, osl: int, r: Sent, t0: float) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": osl, "temperature": 0, "ignore_eos": True,
            "stream": True}
    first = last = None
    tokens = 0
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            r.status = resp.status
            if resp.status != 200:
                r.error = (await resp.text())[:200]
                return
            async for line in resp.content:
                if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                    continue
                if json.loads(line[5:]).get("choices"):
                    last = time.monotonic()
                    first = first or last
                    tokens += 1
    except (aiohttp.ClientError, TimeoutError) as e:
        r.status, r.error = 0, repr(e)[:200]
        return
    if first is None:
        r.status, r.error = 0, "no token"
        return
    r.ttft = first - (t0 + r.at)
    r.tpot = (last - first) / (tokens - 1) if last is not None and tokens > 1 else None


async def sample(client: Any, name: str, t0: float, out: list[dict[str, Any]], stop: asyncio.Event) -> None:
    from lightkube.resources.core_v1 import Pod

    from disagg.operator.scale_executor import RoleResource

    def one() -> dict[str, Any]:
        row: dict[str, Any] = {"s": round(time.monotonic() - t0, 1)}
        pods = [p for p in client.list(Pod, namespace=NAMESPACE, labels={names.LABEL_INSTANCE: name})
                if p.metadata.deletionTimestamp is None and p.spec.nodeName]
        for role in ROLES:
            role_pods = [p for p in pods if (p.metadata.labels or {}).get(names.LABEL_COMPONENT) == role]
            row[f"{role}_pods"] = len(role_pods)
            row[f"{role}_ready"] = sum(any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
                                       for p in role_pods if p.status)
            try:
                row[f"{role}_desired"] = client.get(RoleResource, names.role_object_name(name, role),
                                                    namespace=NAMESPACE).to_dict()["spec"]["replicas"]
            except Exception:  # noqa: BLE001 - not created yet
                row[f"{role}_desired"] = None
        return row

    while not stop.is_set():
        out.append(await asyncio.to_thread(one))
        try:
            await asyncio.wait_for(stop.wait(), 2.0)
        except TimeoutError:
            pass


def cr(arm: str, args: argparse.Namespace) -> dict[str, Any]:
    spec: dict[str, Any] = {"model": {"name": "tiny"}, "accelerator": {"profile": "cpu"},
                            "engine": {"emulator": {"profile": "cpu-kv64k"}}, "kvTransfer": {"mode": "push"},
                            "router": {"pairWaitSeconds": 120}}
    if arm == "planner":
        spec["autoscaling"] = {
            "prefill": {"minReplicas": 1, "maxReplicas": args.max, "inputTokensPerSecond": args.prefill_tps},
            "decode": {"minReplicas": 1, "maxReplicas": args.max, "outputTokensPerSecond": args.decode_tps},
            "slo": {"percentile": 90, "ttftMilliseconds": args.ttft_ms, "tpotMilliseconds": args.tpot_ms},
            "scaleDown": {"cooldownSeconds": args.scale_down_cooldown, "maxStep": args.scale_down_max_step}}
    elif arm == "keda":
        spec["prefill"], spec["decode"] = {"replicas": 1}, {"replicas": 1}
    else:
        spec["prefill"], spec["decode"] = {"replicas": args.static[0]}, {"replicas": args.static[1]}
    return {"apiVersion": "serving.disagg.io/v1alpha1", "kind": "DisaggregatedInference",
            "metadata": {"name": arm, "namespace": NAMESPACE}, "spec": spec}


def scaled_objects(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The keda arm's autoscaler: per role, engines = ceil(requests waiting over the role's engines / target)."""
    return [keda.scaled_object(NAMESPACE, f"{name}-{role}", names.role_object_name(name, role),
                               f"http://{names.engine_name(name, role)}.{NAMESPACE}.svc:{ENGINE_PORT}/metrics",
                               "vllm:num_requests_waiting", args.keda_waiting, max_replicas=args.max,
                               metadata={"aggregateFromKubeServiceEndpoints": "true", "aggregationType": "sum"})
            for role in ROLES]


async def run_arm(c: LocalCluster, arm: str, args: argparse.Namespace, phases: list[Phase]) -> dict[str, Any]:
    client = c.client()
    obj = cr(arm, args)
    client.create(codecs.from_dict(obj))
    log(f"{arm}: applied; awaiting Ready")
    await await_ready(client, arm)
    autoscalers = scaled_objects(arm, args) if arm == "keda" else []
    for so in autoscalers:
        client.create(codecs.from_dict(so))
    url = demo_node.service_url(client, names.router_name(arm))
    text = tinymodel.corpus() * 4
    rng = random.Random(args.seed)
    plan = arrivals(phases, args.seed)
    sent: list[Sent] = []
    samples: list[dict[str, Any]] = []
    stop = asyncio.Event()
    t0 = time.monotonic()
    sampler = asyncio.create_task(sample(client, arm, t0, samples, stop))
    tasks = []
    total = sum(p.seconds for p in phases)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                     connector=aiohttp.TCPConnector(limit=0)) as s:
        next_log = 60.0
        for at, phase in plan:
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))  # the trace's schedule
            r = Sent(round(at, 3), phase.name)
            sent.append(r)
            start = rng.randrange(len(text) - phase.isl)
            tasks.append(asyncio.create_task(send(s, url, text[start:start + phase.isl], phase.osl, r, t0)))
            if at >= next_log:
                last = samples[-1] if samples else {}
                log(f"  {arm}: {at:.0f}/{total:.0f} s, phase {phase.name}, {len(sent)} sent, "
                    f"{sum(x.status not in (0, 200) or bool(x.status == 0 and x.error) for x in sent)} failed, "
                    f"P {last.get('prefill_desired')} D {last.get('decode_desired')}")
                next_log += 60.0
        await asyncio.gather(*tasks)
    stop.set()
    await sampler
    for so in autoscalers:
        client.delete(keda.ScaledObject, so["metadata"]["name"], namespace=NAMESPACE)
    client.delete(DinfResource, arm, namespace=NAMESPACE)
    await await_gone(client, arm)
    return {"arm": arm, "cr": obj["spec"], "requests": [asdict(r) for r in sent], "samples": samples}


async def await_ready(client: Any, name: str, timeout: float = 600) -> None:
    t0 = time.monotonic()
    while True:
        d = client.get(DinfResource, name, namespace=NAMESPACE).to_dict()
        conds = {x["type"]: x for x in (d.get("status") or {}).get("conditions", [])}
        if conds.get("Ready", {}).get("status") == "True":
            return
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{name} not Ready in {timeout:g} s: {conds.get('Ready')}")
        await asyncio.sleep(2)  # the operator's and kubelet's work; progress is logged by the caller


async def await_gone(client: Any, name: str, timeout: float = 300) -> None:
    from lightkube.resources.core_v1 import Pod

    t0 = time.monotonic()
    while list(client.list(Pod, namespace=NAMESPACE, labels={names.LABEL_INSTANCE: name})):
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{name}'s pods not gone in {timeout:g} s")
        await asyncio.sleep(2)


# -- the report ----------------------------------------------------------------------------------------------------
def start_windows(samples: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(from, to): from a sample where a role's desired count rose until one where its ready engines reach it."""
    out = []
    for role in ROLES:
        opened: float | None = None
        prev = None
        for row in samples:
            want, ready = row.get(f"{role}_desired"), row.get(f"{role}_ready", 0)
            if want is None:
                continue
            if prev is not None and want > prev and opened is None:
                opened = row["s"]
            if opened is not None and ready >= want:
                out.append((opened, row["s"]))
                opened = None
            prev = want
        if opened is not None:
            out.append((opened, math.inf))
    return out


def summarize(arm: dict[str, Any], phases: list[Phase], args: argparse.Namespace) -> dict[str, Any]:
    reqs, samples = arm["requests"], arm["samples"]
    windows = start_windows(samples)
    outside = [r for r in reqs if not any(a <= r["at"] <= b for a, b in windows)]
    ok = [r for r in outside if r["status"] == 200 and r["ttft"] is not None
          and r["ttft"] * 1000 <= args.ttft_ms and (r["tpot"] is None or r["tpot"] * 1000 <= args.tpot_ms)]
    replica_s = 0.0
    for a, b in zip(samples, samples[1:], strict=False):
        replica_s += (a["prefill_pods"] + a["decode_pods"]) * (b["s"] - a["s"])
    step_start = sum(p.seconds for p in phases[:1])
    before = {role: next((row[f"{role}_desired"] for row in reversed(samples) if row["s"] <= step_start), None)
              for role in ROLES}
    rise = next((row["s"] for row in samples if row["s"] > step_start
                 and any((row[f"{r}_desired"] or 0) > (before[r] or 0) for r in ROLES)), None)
    actions: dict[str, int] = {r: 0 for r in ROLES}
    steady_s, start = 0.0, 0.0
    for p in phases:
        lo, hi = start + args.settle_s, start + p.seconds
        start += p.seconds
        if p.peak != 1.0 or hi <= lo:
            continue
        steady_s += hi - lo
        for role in ROLES:
            before = [row[f"{role}_desired"] for row in samples if row["s"] < lo][-1:]  # a change at lo counts
            seen = before + [row[f"{role}_desired"] for row in samples if lo <= row["s"] <= hi]
            actions[role] += sum(1 for a, b in zip(seen, seen[1:], strict=False) if a != b)
    failed = [r for r in reqs if r["status"] != 200]
    return {
        "requests": len(reqs), "failed": len(failed),
        "failed_examples": [r["error"] for r in failed[:5]],
        "slo_attainment": round(len(ok) / len(outside), 4) if outside else None,
        "outside_start_windows": len(outside), "start_windows": windows,
        "replica_seconds": round(replica_s),
        "reaction_s": None if rise is None else round(rise - step_start, 1),
        "steady_s": round(steady_s, 1), "steady_actions": actions,
        "actions_per_role_per_10min": {r: round(n * 600 / steady_s, 2) if steady_s else None
                                       for r, n in actions.items()},
        "ttft_ms": dist([r["ttft"] for r in reqs if r["ttft"] is not None]),
        "tpot_ms": dist([r["tpot"] for r in reqs if r["tpot"] is not None]),
        "peak_pods": {r: max((row[f"{r}_pods"] for row in samples), default=0) for r in ROLES},
    }


def pooled_actions(summaries: list[dict[str, Any]]) -> dict[str, float | None]:
    """Per role, scaling actions per 10 minutes over every round's steady time together."""
    steady = sum(s["steady_s"] for s in summaries)
    return {r: round(sum(s["steady_actions"][r] for s in summaries) * 600 / steady, 2) if steady else None
            for r in ROLES}


def operator_values(args: argparse.Namespace) -> dict[str, object]:
    """The chart's operator values this run sets (its planner's tick and window); empty: the chart's defaults."""
    out: dict[str, object] = {}
    if args.autoscale_seconds is not None:
        out["autoscaleSeconds"] = args.autoscale_seconds
    if args.autoscale_window_seconds is not None:
        out["autoscaleWindowSeconds"] = args.autoscale_window_seconds
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    made = result_file.provenance()
    phases = trace(args)
    order = [a for i in range(args.rounds) for a in (args.arms if i % 2 == 0 else args.arms[::-1])]
    c = LocalCluster(ClusterConfig(name="bench-autoscale", real_node=True))
    c.start(progress=lambda m: log(f"  {m}"))
    arms: list[dict[str, Any]] = []
    try:
        assert c.node is not None
        if "keda" in order:
            c.start_keda(progress=lambda m: log(f"  {m}"))
        demo._helm_install(c, c.node.images["disagg"], operator_values(args))
        demo_node.prepare(c, c.node.spec.name)
        for i, arm in enumerate(order):
            log(f"arm {i + 1}/{len(order)}: {arm}")
            result = await run_arm(c, arm, args, phases)
            result["summary"] = summarize(result, phases, args)
            brief = {k: result["summary"][k] for k in ("failed", "slo_attainment", "replica_seconds", "reaction_s")}
            log(f"  {arm}: {json.dumps(brief)}")
            arms.append(result)
    finally:
        c.stop()
    by_arm: dict[str, list[dict[str, Any]]] = {}
    for a in arms:
        by_arm.setdefault(a["arm"], []).append(a["summary"])
    planner_rs = [s["replica_seconds"] for s in by_arm.get("planner", [])]
    static_rs = [s["replica_seconds"] for s in by_arm.get("static", [])]
    headline = {
        arm: {"failed": sum(s["failed"] for s in rows),
              "slo_attainment": [s["slo_attainment"] for s in rows],
              "replica_seconds": [s["replica_seconds"] for s in rows],
              "reaction_s": [s["reaction_s"] for s in rows],
              "actions_per_role_per_10min": [s["actions_per_role_per_10min"] for s in rows],
              "actions_per_role_per_10min_pooled": pooled_actions(rows)}
        for arm, rows in by_arm.items()}
    if planner_rs and static_rs:
        headline["planner_over_static_replica_seconds"] = round(sum(planner_rs) / sum(static_rs), 3)
    keda_rs = [s["replica_seconds"] for s in by_arm.get("keda", [])]
    if keda_rs and static_rs:
        headline["keda_over_static_replica_seconds"] = round(sum(keda_rs) / sum(static_rs), 3)
    return {**made, "benchmark": "autoscale", "issue": 35, "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "loadavg_at_end": Path("/proc/loadavg").read_text().split()[:3],
            "config": {"phases": [asdict(p) for p in phases], "order": order, "seed": args.seed, "max": args.max,
                       "static": args.static, "prefill_tps": args.prefill_tps, "decode_tps": args.decode_tps,
                       "slo": {"ttft_ms": args.ttft_ms, "tpot_ms": args.tpot_ms, "percentile": 90},
                       "settle_s": args.settle_s, "scale_down_cooldown_s": args.scale_down_cooldown,
                       "scale_down_max_step": args.scale_down_max_step,
                       "operator": operator_values(args),
                       "keda_waiting": args.keda_waiting,
                       "deployment": "cpu-kv64k engine emulators on the real node, push, 1 router"},
            "headline": headline, "arms": arms}


def trace_arguments(p: argparse.ArgumentParser) -> None:
    """The trace, the planner arm's CR and how an arm is judged: what bench/autoscale_sim.py simulates too."""
    p.add_argument("--base-rate", type=float, default=0.25, help="requests per second of the base phases")
    p.add_argument("--base-s", type=float, default=60)
    p.add_argument("--step-s", type=float, default=120)
    p.add_argument("--back-s", type=float, default=240)
    p.add_argument("--diurnal-s", type=float, default=150)
    p.add_argument("--max", type=int, default=8, help="the planner's maxReplicas per role")
    p.add_argument("--static", type=lambda s: tuple(int(x) for x in s.split(",")), default=(3, 3),
                   help="the static arm's prefill,decode engines (sized for the trace's peak)")
    p.add_argument("--prefill-tps", type=int, default=100,
                   help="spec.autoscaling.prefill.inputTokensPerSecond (cpu-kv64k computes ~136 prompt tokens/s)")
    p.add_argument("--decode-tps", type=int, default=60,
                   help="spec.autoscaling.decode.outputTokensPerSecond (cpu-kv64k: ~120 tokens/s at a batch of 10)")
    p.add_argument("--ttft-ms", type=int, default=10000)
    p.add_argument("--tpot-ms", type=int, default=200)
    p.add_argument("--scale-down-cooldown", type=int, default=60,
                   help="the planner arm's spec.autoscaling.scaleDown.cooldownSeconds (the CR's default, 300, is "
                   "longer than this trace's phases)")
    p.add_argument("--scale-down-max-step", type=int, default=4,
                   help="the planner arm's spec.autoscaling.scaleDown.maxStep (the CR's default, 1, takes a cooldown "
                   "per engine to follow a drop)")
    p.add_argument("--settle-s", type=float, default=90,
                   help="seconds into a flat phase before it counts as steady: the planner's window (15), its "
                   "scale-down cooldown (60) and an engine's start")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    trace_arguments(p)
    p.add_argument("--autoscale-seconds", type=float, default=None,
                   help="the operator's --autoscale-seconds (the planner's tick; default: the chart's)")
    p.add_argument("--autoscale-window-seconds", type=float, default=None,
                   help="the operator's --autoscale-window-seconds (default: the chart's)")
    p.add_argument("--arms", type=lambda s: tuple(s.split(",")), default=("planner", "static", "keda"),
                   help="arms in round 1's order (later rounds alternate it): planner, static, keda")
    p.add_argument("--keda-waiting", type=float, default=2.0,
                   help="the keda arm's target: requests waiting per engine of a role")
    p.add_argument("--rounds", type=int, default=3, help="ABBA: each round runs the arms in the reverse order of the "
                   "round before")
    p.add_argument("--seed", type=int, default=35)
    p.add_argument("--quick", action="store_true", help="every phase 60 s, one round")
    p.add_argument("--out", type=Path, default=RESULTS / "autoscale.json")
    args = p.parse_args()
    if args.quick:
        args.base_s = args.step_s = args.back_s = args.diurnal_s = 60.0
        args.rounds, args.settle_s = 1, 30.0
    stop_cleanly_on_sigterm()
    result = asyncio.run(run(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    written = result_file.write(args.out, result)
    print(json.dumps(result["headline"], indent=1))
    from pd_serving import bench_python

    png = args.out.with_suffix(".png")
    subprocess.run([str(bench_python()), str(HERE / "plot_autoscale.py"), str(written), str(png)], check=True)
    log(f"wrote {written} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
