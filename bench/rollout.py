"""Rollouts and scaling under load on the real node (issue 14): does any request fail, and what does a rollout
cost the tail?

One run. The tiny-cpu example in push mode (1 prefill + 1 decode) is applied to the dev cluster's real node with
the operator installed by its chart, and a seeded open-loop Poisson stream of streamed completions goes through
the router's Service for the whole run. Then, one after another, each waiting for the rollout to complete:

  engine-args   spec.engine.args gains --max-num-seqs (a new revision, same KV layout)
  block-size    spec.engine.blockSize 128 -> 64 (a new KV layout: old and new engines never pair)
  image         spec.engine.image -> a second tag of the same engine image
  scale-up      decode 1 -> 2
  scale-down    decode 2 -> 1 (the drained engine leaves the rendezvous, finishes its requests, then goes)

Each request is labelled with the window it was sent in: `steady` (before the first change and for a settle time
after each), or the change's name, from its patch until the CR is Ready on the new spec with one revision left and
every engine advertised. Per window: requests, failures (each with its error), TTFT p50 and p99, and the engines
that served (the router's response headers, so both revisions are seen serving); per change, TTFT p99 over
steady's with a bootstrap 90% interval over requests, and the rollout steps the operator took (its RolloutStep
Events). The goal: 0 failed requests. The run exits 1 if any request failed.

A layout rollout of 1P1D surges a whole new pair before the old one drains (maxSurge 1, maxUnavailable 0, so at
least one compatible pair serves throughout): four engines at once, and three while decode is scaled up. This host
has two cores and each vLLM CPU engine spins one (NIXL's progress thread), so during a surge the engines share
cores: the new revision's engines are pinned like the old (prefill core 0, decode core 1). The tail during a
rollout therefore includes CPU contention that a fleet with spare accelerators would not have; steady windows have
two engines. This is why it is a benchmark run by hand, not a test in `make test` (never more engines than cores).

  flock /tmp/disagg-engines.lock .venv/bin/python bench/rollout.py     # about 20 minutes warm
Writes bench/results/rollout.json. `--quick` runs only the decode scale-up and scale-down.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import result_file
import yaml
from cluster_path import percentile_ratio_ci
from lightkube import Client, codecs
from lightkube.resources.core_v1 import Event
from lightkube.types import PatchType
from pd_client import ALPHABET, completion_body, quantile, read_stream
from pd_serving import RESULTS, log

from disagg.connector.router.app import DECODE_HEADER, PREFILL_HEADER
from disagg.devcluster import demo, demo_node
from disagg.devcluster.cluster import ClusterConfig, LocalCluster
from disagg.devcluster.images import engine
from disagg.operator import names
from disagg.operator.bindings import DinfResource

NAMESPACE = demo_node.NAMESPACE
SECOND_TAG = "rollout-b"


@dataclass(frozen=True)
class Change:
    name: str
    what: str
    patch: Callable[[dict[str, Any], str], dict[str, Any]]  # (current spec, second image) -> merge patch
    decode_replicas: int = 1


CHANGES = [
    Change("engine-args", "spec.engine.args gains --max-num-seqs 64 (new revision, same KV layout)",
           lambda spec, _img: {"engine": {"args": [*spec["engine"].get("args", []), "--max-num-seqs", "64"]}}),
    Change("block-size", "spec.engine.blockSize 128 -> 64 (new KV layout)",
           lambda _spec, _img: {"engine": {"blockSize": 64}}),
    Change("image", f"spec.engine.image -> the same engine image tagged {SECOND_TAG}",
           lambda _spec, img: {"engine": {"image": img}}),
    Change("scale-up", "spec.decode.replicas 1 -> 2", lambda _spec, _img: {"decode": {"replicas": 2}}, 2),
    Change("scale-down", "spec.decode.replicas 2 -> 1", lambda _spec, _img: {"decode": {"replicas": 1}}, 1),
]


# -- the request stream ------------------------------------------------------------------------------------------
@dataclass
class Sent:
    idx: int
    window: str
    sent: float  # seconds since the stream began
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    status: int | None = None
    prefill: str | None = None
    decode: str | None = None


@dataclass
class Stream:
    """Open-loop Poisson arrivals at `rate`, each request labelled with the window current when it was sent."""

    url: str
    rate: float
    prompt_tokens: int
    max_tokens: int
    timeout: float
    seed: int
    window: str = "steady"
    results: list[Sent] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        rng = random.Random(self.seed)
        t0 = time.monotonic()
        pending: set[asyncio.Task] = set()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            next_at = 0.0
            while not self._stop.is_set():
                delay = t0 + next_at - time.monotonic()
                if delay > 0:
                    try:
                        await asyncio.wait_for(self._stop.wait(), delay)
                        break
                    except TimeoutError:
                        pass
                r = Sent(len(self.results), self.window, round(time.monotonic() - t0, 3))
                self.results.append(r)
                # Distinct prompts: a repeat would be a prefix-cache hit and hide the prefill.
                prompt = f"{r.idx:06d} " + "".join(rng.choice(ALPHABET) for _ in range(self.prompt_tokens - 8))
                task = asyncio.create_task(self._one(session, r, prompt))
                pending.add(task)
                task.add_done_callback(pending.discard)
                next_at += rng.expovariate(self.rate)
            if pending:
                await asyncio.wait(pending)

    async def _one(self, session: aiohttp.ClientSession, r: Sent, prompt: str) -> None:
        start = time.monotonic()
        res = _Timing(start)
        try:
            async with asyncio.timeout(self.timeout):
                async with session.post(self.url + "/v1/completions",
                                        json=completion_body(prompt, self.max_tokens)) as resp:
                    r.status = resp.status
                    r.prefill, r.decode = resp.headers.get(PREFILL_HEADER), resp.headers.get(DECODE_HEADER)
                    if resp.status != 200:
                        raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
                    await read_stream(resp, res)  # type: ignore[arg-type]
            r.ok, r.ttft = True, res.ttft
        except TimeoutError:
            r.error = f"timeout after {self.timeout:g}s"
        except Exception as e:  # noqa: BLE001 - every failure is counted, none may end the run
            r.error = f"{type(e).__name__}: {e}"[:300]
        r.e2e = time.monotonic() - start

    def stop(self) -> None:
        self._stop.set()


@dataclass
class _Timing:
    """What pd_client.read_stream fills in."""
    sent: float
    ttft: float | None = None
    tokens: int = 0


# -- the CR ------------------------------------------------------------------------------------------------------
def settled(dinf: Any, decode_replicas: int) -> str | None:
    """None when the CR is Ready on its current spec with one revision left and every engine advertised, else
    what is still missing."""
    status = dinf.get("status") or {}
    generation = (dinf.get("metadata") or {}).get("generation")
    if status.get("observedGeneration") != generation:
        return "the operator has not seen the change"
    conds = {c["type"]: c for c in status.get("conditions", [])}
    if conds.get("Ready", {}).get("status") != "True":
        return f"not Ready: {conds.get('Ready', {}).get('message', '')}"
    revisions = status.get("revisions", [])
    if len(revisions) != 1 or not revisions[0].get("current"):
        return f"{len(revisions)} revisions"
    want = {"prefill": 1, "decode": decode_replicas}
    for role, n in want.items():
        r = revisions[0].get(role, {})
        if (r.get("replicas"), r.get("ready"), r.get("advertised")) != (n, n, n):
            return f"{role} {r}"
    return None


class Deployment:
    """The tiny-cpu CR on the real node, and what its rollouts did (from its Events)."""

    def __init__(self, cluster: LocalCluster):
        self.client: Client = cluster.client()
        assert cluster.node is not None
        self.cr = demo_node.tiny_cr(cluster.node.images, engine.host_env().mounts, "push")
        self.cr["metadata"]["namespace"] = NAMESPACE
        self.name = self.cr["metadata"]["name"]

    def get(self) -> dict[str, Any]:
        out: dict[str, Any] = self.client.get(DinfResource, self.name, namespace=NAMESPACE).to_dict()
        return out

    def create(self) -> None:
        self.client.create(codecs.from_dict(self.cr))

    def patch(self, spec: dict[str, Any]) -> None:
        self.client.patch(DinfResource, self.name, {"spec": spec}, namespace=NAMESPACE, patch_type=PatchType.MERGE)

    def await_settled(self, decode_replicas: int, timeout: float) -> float:
        """Seconds until settled(); prints each new reason and rollout step on the way."""
        t0 = time.monotonic()
        last, seen_events = "", self.step_events()
        while time.monotonic() - t0 < timeout:
            missing = settled(self.get(), decode_replicas)
            events = self.step_events()
            for e in events[len(seen_events):]:
                log(f"    {e['reason']}: {e['message']}")
            seen_events = events
            if missing is None:
                return time.monotonic() - t0
            if missing != last:
                log(f"    waiting: {missing}")
                last = missing
            time.sleep(1)  # progress output; the stream runs on its own loop meanwhile
        raise TimeoutError(f"{self.name} not settled within {timeout:.0f}s: {last}")

    def step_events(self) -> list[dict[str, str]]:
        """The operator's rollout Events for the CR, oldest first."""
        out = []
        for e in self.client.list(Event, namespace=NAMESPACE,
                                  fields={"involvedObject.name": self.name}):
            if e.reason and e.reason.startswith("Rollout"):
                out.append({"reason": e.reason, "message": e.message or "",
                            "rv": int(e.metadata.resourceVersion or 0) if e.metadata else 0})
        return sorted(out, key=lambda e: e["rv"])


def second_tag(cluster: LocalCluster, image: str) -> str:
    """The engine image under another tag in the node's containerd: an image change that changes nothing else."""
    assert cluster.node is not None
    other = image.rsplit(":", 1)[0] + ":" + SECOND_TAG
    subprocess.run([*cluster.node.ctr(), "images", "tag", "--force", image, other], check=True, capture_output=True)
    return other


# -- statistics --------------------------------------------------------------------------------------------------
def window_stats(rows: list[Sent]) -> dict[str, Any]:
    ttft = [r.ttft * 1000 for r in rows if r.ok and r.ttft is not None]
    return {"requests": len(rows), "ok": sum(r.ok for r in rows), "failed": sum(not r.ok for r in rows),
            "errors": [f"#{r.idx} at {r.sent:.1f}s: {r.error}" for r in rows if not r.ok],
            "ttft_ms": {"p50": _r(quantile(ttft, 0.5)), "p99": _r(quantile(ttft, 0.99)),
                        "max": _r(max(ttft) if ttft else None)},
            "served_by": dict(Counter(f"{r.prefill} -> {r.decode}" for r in rows if r.ok))}


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 1)


def headline(results: list[Sent], changes: list[dict[str, Any]]) -> dict[str, Any]:
    rng = random.Random(0)
    steady = [r.ttft for r in results if r.window == "steady" and r.ok and r.ttft is not None]
    out: dict[str, Any] = {"failed_requests": sum(not r.ok for r in results), "requests": len(results),
                           "steady_ttft_p99_ms": _r(q * 1000 if (q := quantile(steady, 0.99)) else None),
                           "changes": {}}
    for ch in changes:
        during = [r.ttft for r in results if r.window == ch["name"] and r.ok and r.ttft is not None]
        p99 = quantile(during, 0.99)
        base = quantile(steady, 0.99)
        out["changes"][ch["name"]] = {
            "failed": sum(not r.ok for r in results if r.window == ch["name"]),
            "requests": sum(r.window == ch["name"] for r in results),
            "rollout_s": ch["rollout_s"], "steps": len([e for e in ch["events"] if e["reason"] == "RolloutStep"]),
            "ttft_p99_ms": _r(p99 * 1000 if p99 else None),
            "ttft_p99_over_steady": round(p99 / base, 2) if p99 and base else None,
            "ttft_p99_over_steady_ci90": percentile_ratio_ci(during, steady, 0.99, rng)}
    out["goal"] = "0 failed requests through every rollout and scale"
    return out


# -- the run -----------------------------------------------------------------------------------------------------
async def run(args: argparse.Namespace) -> dict[str, Any]:
    made = result_file.provenance()
    started = time.monotonic()
    c = LocalCluster(ClusterConfig(name="bench-rollout", real_node=True))
    c.start(progress=lambda m: log(f"  {m}"))
    try:
        assert c.node is not None
        demo._helm_install(c, c.node.images["disagg"])
        demo_node.prepare(c, c.node.spec.name)
        dep = Deployment(c)
        dep.create()
        log(f"{dep.name}: applied (1 prefill + 1 decode, push); awaiting Ready")
        ready_s = await asyncio.to_thread(dep.await_settled, 1, args.settle_timeout)
        url = demo_node.service_url(dep.client, names.router_name(dep.name))
        other_image = second_tag(c, dep.cr["spec"]["engine"]["image"])
        stream = Stream(url, args.rate, args.prompt_tokens, args.max_tokens, args.timeout, args.seed)
        load = asyncio.create_task(stream.run())
        log(f"steady stream: {args.rate}/s Poisson, {args.prompt_tokens}-token prompts, {args.max_tokens} tokens")
        await asyncio.sleep(args.steady_seconds)  # the baseline window's length is the measurement's, not a wait
        changes = []
        wanted = [ch for ch in CHANGES if not args.quick or ch.name.startswith("scale")]
        for ch in wanted:
            before = len(dep.step_events())
            log(f"{ch.name}: {ch.what}")
            stream.window = ch.name
            dep.patch(ch.patch(dep.get()["spec"], other_image))
            took = await asyncio.to_thread(dep.await_settled, ch.decode_replicas, args.settle_timeout)
            stream.window = "steady"
            events = dep.step_events()[before:]
            log(f"  {ch.name}: settled after {took:.0f}s, {len(events)} rollout events; "
                f"{sum(not r.ok for r in stream.results)} failed requests so far")
            changes.append({"name": ch.name, "what": ch.what, "rollout_s": round(took, 1),
                            "events": [{"reason": e["reason"], "message": e["message"]} for e in events]})
            await asyncio.sleep(args.settle_seconds)  # a steady window after each change, measured like the first
        stream.stop()
        await load
        windows = {w: window_stats([r for r in stream.results if r.window == w])
                   for w in ["steady", *(ch["name"] for ch in changes)]}
        return {
            **made, "benchmark": "rollout", "issue": 14, "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": {**made["machine"],
                        "note": "the tiny-cpu example on the real node; during a layout rollout four engines "
                                "share two cores (prefill core 0, decode core 1), three while decode is 2"},
            "config": {"rate_per_s": args.rate, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                       "timeout_s": args.timeout, "seed": args.seed, "steady_seconds": args.steady_seconds,
                       "settle_seconds": args.settle_seconds, "rollout": dep.get()["spec"].get("rollout", {})},
            "ready_s": round(ready_s, 1),
            "headline": headline(stream.results, changes),
            "windows": windows,
            "changes": changes,
            "requests": [asdict(r) for r in stream.results],
            "elapsed_s": round(time.monotonic() - started, 1),
        }
    finally:
        c.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson)")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--timeout", type=float, default=120.0, help="per request")
    p.add_argument("--steady-seconds", type=float, default=120.0, help="the baseline window before any change")
    p.add_argument("--settle-seconds", type=float, default=30.0, help="the steady window after each change")
    p.add_argument("--settle-timeout", type=float, default=900.0, help="per change, until the CR settles")
    p.add_argument("--seed", type=int, default=14)
    p.add_argument("--quick", action="store_true", help="only the decode scale-up and scale-down, short windows")
    p.add_argument("--out", type=Path, default=RESULTS / "rollout.json")
    args = p.parse_args()
    if args.quick:
        args.steady_seconds, args.settle_seconds = 20.0, 10.0
    result = asyncio.run(run(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result_file.write(args.out, result)
    print(yaml.safe_dump(result["headline"], sort_keys=False))
    return 1 if result["headline"]["failed_requests"] else 0


if __name__ == "__main__":
    sys.exit(main())
