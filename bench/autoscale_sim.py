"""A SIMULATION of bench/autoscale.py's planner arm, in simulated time: the planner the operator runs
(operator/autoscaling/planner.decide) in a loop with a fleet modelled by the engine emulator's own scheduler and
step costs (connector/emulator/scheduler.py, the cpu-kv64k profile), on the same trace and summarized the same way.

It answers in seconds what the benchmark answers in half an hour a round, so that a change to the planner can be
tried on many seeds before the benchmark judges it. It is not a result: the benchmark, with the operator, the
router and emulators as pods on the real node, is. What it leaves out: the router's and the operator's own time,
KV capacity (every request fits), HTTP and the scrape's histogram buckets (latencies are exact here), and engine
start beyond a fixed delay (`--start-s`, what the benchmark's emulator pods take from decision to advertised).

The fleet, per request: the router sends both legs at once to the least-loaded prefill and decode engines (push);
the prefill computes the prompt in chunks with the other prefills (vLLM's continuous batching), then its KV crosses
(the profile's transfer cost) and the decode computes the last prompt token again and decodes. TTFT is from
arrival to decode's first token. A role shrinks by draining its newest engines: they take nothing new and leave
once empty. The planner ticks every `--tick-s` over a `--window-s` window of what the router and the engines
would export.

  .venv/bin/python bench/autoscale_sim.py --seeds 20 [--prefill-tps 100 ...] [--out FILE]
"""
from __future__ import annotations

import argparse
import functools
import heapq
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import autoscale
import result_file

from disagg.connector.emulator.profiles import CPU_KV64K, EmulatorProfile
from disagg.connector.emulator.scheduler import SeqView, blocks_for, plan_step, step_seconds
from disagg.operator.autoscaling import planner
from disagg.operator.autoscaling.observed import EngineLoad, Observed, RoleObserved, RouterWindow
from disagg.operator.autoscaling.policy import AutoscalingPolicy, RolePolicy
from disagg.operator.autoscaling.window import percentile

ROLES = ("prefill", "decode")
NO_BLOCK_LIMIT = 1 << 30


@dataclass(eq=False)
class Req:
    id: int
    at: float
    phase: str
    isl: int
    osl: int
    computed: int = 0
    """Prefill: prompt tokens computed. Decode: tokens with KV (the prompt less one once it landed)."""
    out: int = 0
    prefill_done: float | None = None
    first: float | None = None
    done: float | None = None

    def view(self, role: str, block_size: int) -> SeqView:
        if role == "prefill":
            return SeqView(str(self.id), "running" if self.computed else "new", self.isl, self.computed, 0, 0, 0,
                           self.isl)
        return SeqView(str(self.id), "running" if self.out else "remote_ready", self.isl + self.out, self.computed,
                       blocks_for(self.isl + self.out, block_size), prompt_tokens=self.isl)


@dataclass(eq=False)
class Engine:
    role: str
    created: float
    up_at: float
    draining: bool = False
    gone_at: float | None = None
    running: list[Req] = field(default_factory=list)
    waiting: list[Req] = field(default_factory=list)
    awaiting_kv: list[Req] = field(default_factory=list)
    busy: bool = False

    def outstanding(self) -> int:
        return len(self.running) + len(self.waiting) + len(self.awaiting_kv)

    def routable(self, now: float) -> bool:
        return self.up_at <= now and not self.draining and self.gone_at is None


class Sim:
    def __init__(self, args: argparse.Namespace, policy: AutoscalingPolicy, profile: EmulatorProfile,
                 seed: int, schedule: list[tuple[float, int, int]] | None = None) -> None:
        """`schedule`: instead of the planner, a clairvoyant arm: (from second, prefill, decode) counts, each
        engine started `--start-s` ahead so that it is up at that second."""
        self.args, self.policy, self.profile = args, policy, profile
        self.events: list[tuple[float, int, Callable[[], None]]] = []
        self.seq = itertools.count()
        self.now = 0.0
        self.engines: list[Engine] = [Engine(role, 0.0, 0.0) for role in ROLES]
        self.desired = {role: 1 for role in ROLES}
        self.changed: dict[str, float | None] = {role: None for role in ROLES}
        self.reqs: list[Req] = []
        self.legs: dict[int, tuple[Engine, Engine]] = {}
        """Each request's prefill and decode engines."""
        self.samples: list[dict[str, Any]] = []
        self.decisions: list[dict[str, Any]] = []
        self.phases = autoscale.trace(args)
        self.end = sum(p.seconds for p in self.phases)
        for i, (at, p) in enumerate(autoscale.arrivals(self.phases, seed)):
            self.at(at, functools.partial(self.arrive, Req(i, at, p.name, p.isl, p.osl)))
        if schedule is None:
            for k in range(1, int(self.end / args.tick_s) + 1):
                self.at(k * args.tick_s, self.tick)
        else:
            for t, p, d in schedule:
                self.at(max(0.0, t - args.start_s),
                        functools.partial(self.apply, {"prefill": p, "decode": d}, "the clairvoyant schedule"))
        for k in range(int(self.end) + 1):
            self.at(float(k), self.sample)

    # -- the event loop ---------------------------------------------------------------------------------------------
    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self.events, (t, next(self.seq), fn))

    def run(self) -> None:
        while self.events:
            self.now, _, fn = heapq.heappop(self.events)
            fn()

    # -- the router ---------------------------------------------------------------------------------------------------
    def arrive(self, r: Req) -> None:
        self.reqs.append(r)
        p, d = (min((e for e in self.engines if e.role == role and e.routable(self.now)),
                    key=Engine.outstanding) for role in ROLES)
        d.awaiting_kv.append(r)
        self.at(self.now + self.profile.api_latency_s, lambda: self.enqueue(p, r))
        self.legs[r.id] = (p, d)

    def enqueue(self, e: Engine, r: Req) -> None:
        e.waiting.append(r)
        self.kick(e)

    # -- the engines -------------------------------------------------------------------------------------------------
    def kick(self, e: Engine) -> None:
        if e.busy or not (e.running or e.waiting):
            return
        seqs = {str(r.id): r for r in (*e.running, *e.waiting)}
        bs = self.profile.block_size
        plan = plan_step([r.view(e.role, bs) for r in e.running], (r.view(e.role, bs) for r in e.waiting),
                         NO_BLOCK_LIMIT, self.profile)
        cost = step_seconds(plan, self.profile.step, self.profile.contention.of(e.role))
        for s in plan.scheduled:
            r = seqs[s.id]
            if r in e.waiting:
                e.waiting.remove(r)
                e.running.append(r)
        e.busy = True
        self.at(self.now + cost, lambda: self.step_done(e, [(seqs[s.id], s.tokens) for s in plan.scheduled]))

    def step_done(self, e: Engine, work: list[tuple[Req, int]]) -> None:
        e.busy = False
        for r, n in work:
            r.computed += n
            if e.role == "prefill" and r.computed >= r.isl:
                e.running.remove(r)
                r.prefill_done = self.now
                d = self.legs[r.id][1]
                cost = self.profile.transfer.fixed_s + self.profile.transfer.per_token_s * r.isl
                self.at(self.now + cost, lambda r=r, d=d: self.landed(d, r))
            elif e.role == "decode" and r.computed >= r.isl + r.out:
                r.out += 1
                if r.out == 1:
                    r.first = self.now
                if r.out >= r.osl:
                    r.done = self.now
                    e.running.remove(r)
        self.kick(e)
        self.leave_if_drained(e)

    def landed(self, d: Engine, r: Req) -> None:
        d.awaiting_kv.remove(r)
        r.computed = r.isl - 1
        d.waiting.insert(0, r)
        self.kick(d)

    def leave_if_drained(self, e: Engine) -> None:
        if e.draining and e.gone_at is None and not e.outstanding() and not e.busy:
            e.gone_at = self.now

    # -- the planner ---------------------------------------------------------------------------------------------
    def observed(self) -> Observed:
        t, w = self.now, self.args.window_s
        arrived = [r for r in self.reqs if t - w < r.at <= t]
        prefilled = [r for r in self.reqs if r.prefill_done is not None and t - w < r.prefill_done <= t]
        finished = [r for r in self.reqs if r.done is not None and t - w < r.done <= t]
        firsts = [r for r in self.reqs if r.first is not None and t - w < r.first <= t]
        pct = self.policy.percentile

        def ms(values: list[float]) -> float | None:
            p = percentile(values, pct)
            return None if p is None else p * 1000

        last = max((r.at for r in self.reqs if r.at <= t), default=0.0)
        window = RouterWindow(
            seconds=w, arrivals=len(arrived),
            mean_input_tokens=statistics.fmean(r.isl for r in prefilled) if prefilled else 0.0,
            mean_output_tokens=statistics.fmean(r.osl for r in finished) if finished else 0.0,
            percentile=pct, ttft_ms=ms([r.first - r.at for r in firsts if r.first is not None]),
            tpot_ms=ms([(r.done - r.first) / (r.osl - 1) for r in finished
                        if r.done is not None and r.first is not None and r.osl > 1]),
            idle_seconds=t - last)

        def role(name: str) -> RoleObserved:
            live = [e for e in self.engines if e.role == name and not e.draining and e.gone_at is None]
            ready = [e for e in live if e.up_at <= t]
            waiting = sum(len(e.waiting) + (len(e.awaiting_kv) if name == "decode" else 0) for e in ready)
            kv = sum(sum(blocks_for(r.isl + r.out, self.profile.block_size) for r in (*e.running, *e.awaiting_kv))
                     / self.profile.num_blocks for e in ready)
            since = self.changed[name]
            return RoleObserved(desired=self.desired[name], ready=min(len(ready), self.desired[name]),
                                starting=max(0, self.desired[name] - len(ready)),
                                seconds_since_scale=None if since is None else t - since,
                                load=EngineLoad(waiting=waiting, running=sum(len(e.running) for e in ready),
                                                kv_usage=kv))

        return Observed(window=window, prefill=role("prefill"), decode=role("decode"))

    def tick(self) -> None:
        decision = planner.decide(self.observed(), self.policy)
        self.apply({name: getattr(decision, name).desired for name in ROLES},
                   {name: getattr(decision, name).reason for name in ROLES})

    def apply(self, counts: dict[str, int], reasons: dict[str, str] | str) -> None:
        for name in ROLES:
            want, have = counts[name], self.desired[name]
            if want == have:
                continue
            reason = reasons if isinstance(reasons, str) else reasons[name]
            self.decisions.append({"s": round(self.now, 1), "role": name, "from": have, "to": want,
                                   "reason": reason[:300]})
            self.desired[name], self.changed[name] = want, self.now
            live = [e for e in self.engines if e.role == name and not e.draining and e.gone_at is None]
            for _ in range(want - len(live)):
                self.engines.append(Engine(name, self.now, self.now + self.args.start_s))
            for e in sorted(live, key=lambda e: e.created)[want:]:
                e.draining = True
                self.leave_if_drained(e)

    def sample(self) -> None:
        row: dict[str, Any] = {"s": self.now}
        for name in ROLES:
            pods = [e for e in self.engines if e.role == name and e.gone_at is None]
            row[f"{name}_pods"] = len(pods)
            row[f"{name}_ready"] = sum(1 for e in pods if e.routable(self.now))
            row[f"{name}_desired"] = self.desired[name]
        self.samples.append(row)

    def arm(self) -> dict[str, Any]:
        requests = [{"at": r.at, "phase": r.phase, "status": 200 if r.done is not None else 0,
                     "ttft": None if r.first is None else r.first - r.at,
                     "tpot": None if r.done is None or r.first is None or r.osl < 2
                     else (r.done - r.first) / (r.osl - 1), "error": None if r.done is not None else "unfinished"}
                    for r in self.reqs]
        return {"arm": "planner", "requests": requests, "samples": self.samples, "decisions": self.decisions}



def policy(args: argparse.Namespace) -> AutoscalingPolicy:
    return AutoscalingPolicy(
        prefill=RolePolicy(1, args.max, args.prefill_tps), decode=RolePolicy(1, args.max, args.decode_tps),
        percentile=args.percentile, ttft_ms=args.ttft_ms, tpot_ms=args.tpot_ms,
        down_max_step=args.scale_down_max_step, down_cooldown_seconds=args.scale_down_cooldown,
        up_cooldown_seconds=args.scale_up_cooldown, down_band=args.down_band)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    autoscale.trace_arguments(p)
    p.add_argument("--percentile", type=float, default=90)
    p.add_argument("--scale-up-cooldown", type=float, default=AutoscalingPolicy().up_cooldown_seconds)
    p.add_argument("--down-band", type=float, default=AutoscalingPolicy().down_band)
    p.add_argument("--tick-s", type=float, default=5.0)
    p.add_argument("--window-s", type=float, default=15.0)
    p.add_argument("--start-s", type=float, default=2.0)
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--seed", type=int, default=35, help="the first seed")
    p.add_argument("--schedule", type=schedule_arg, default=None, metavar="SECOND,PREFILL,DECODE;...",
                   help="also a clairvoyant arm: these counts from these seconds, each engine started ahead")
    p.add_argument("--out", type=Path, default=None)
    return p


def simulate(args: argparse.Namespace, schedule: list[tuple[float, int, int]] | None = None
             ) -> tuple[list[dict[str, Any]], list[Sim]]:
    """One simulated arm per seed (the planner, or the clairvoyant `schedule`): (its summary and decisions, the
    simulation)."""
    pol = policy(args)
    runs, sims = [], []
    for seed in range(args.seed, args.seed + args.seeds):
        sim = Sim(args, pol, CPU_KV64K, seed, schedule)
        sim.run()
        arm = sim.arm()
        runs.append({"seed": seed, "summary": autoscale.summarize(arm, sim.phases, args),
                     "decisions": arm["decisions"]})
        sims.append(sim)
    return runs, sims


def schedule_arg(text: str) -> list[tuple[float, int, int]]:
    """`SECOND,PREFILL,DECODE;...` as (second, prefill, decode) tuples."""
    out = []
    for part in text.split(";"):
        t, p, d = part.split(",")
        out.append((float(t), int(p), int(d)))
    return out


def headline(runs: list[dict[str, Any]], static_replica_s: float) -> dict[str, Any]:
    """What the benchmark's goals judge, over the seeds."""
    slo = [r["summary"]["slo_attainment"] for r in runs]
    rs = [r["summary"]["replica_seconds"] / static_replica_s for r in runs]
    steady = sum(r["summary"]["steady_s"] for r in runs)
    actions = {role: sum(r["summary"]["steady_actions"][role] for r in runs) * 600 / steady for role in ROLES}
    reactions = sorted(r["summary"]["reaction_s"] for r in runs if r["summary"]["reaction_s"] is not None)
    return {
        "slo_attainment": {"mean": round(statistics.fmean(slo), 4), "min": min(slo),
                           "share_of_seeds_at_99": round(sum(s >= 0.99 for s in slo) / len(slo), 2)},
        "replica_seconds_vs_static": {"mean": round(statistics.fmean(rs), 3), "max": round(max(rs), 3)},
        "reaction_s": {"p50": reactions[len(reactions) // 2], "max": reactions[-1]} if reactions else None,
        "steady_actions_per_role_per_10min": {k: round(v, 2) for k, v in actions.items()},
    }


def main() -> int:
    args = parser().parse_args()
    arms: dict[str, Any] = {}
    for name, schedule in (("planner", None), ("clairvoyant", args.schedule)):
        if name == "clairvoyant" and schedule is None:
            continue
        runs, sims = simulate(args, schedule)
        arms[name] = {"headline": headline(runs, sum(args.static) * sims[0].end), "runs": runs}
        print(name, json.dumps(arms[name]["headline"]))
    if args.out:
        config = {k: v for k, v in vars(args).items() if k != "out"}
        result_file.write(args.out, {**result_file.provenance(), "benchmark": "autoscale_sim", "issue": 35,
                                     "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                     "what": "a simulation, not a measurement (bench/autoscale_sim.py's docstring)",
                                     "config": config, "arms": arms})
    return 0


if __name__ == "__main__":
    sys.exit(main())
