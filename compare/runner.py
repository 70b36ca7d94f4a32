"""`disagg compare-run`, the Job's process: serves the workload in each mode of the ABBA order through the router,
switching spec.kvTransfer.mode (one rollout per switch, by the operator), and writes the report into a ConfigMap
for `disagg compare` to collect. The CR gets its original mode back at the end, whatever happened."""
from __future__ import annotations

import argparse
import asyncio
import base64
import gzip
import logging
import signal
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from lightkube import AsyncClient
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import ConfigMap, Pod
from lightkube.types import PatchType

from disagg.operator import api, names
from disagg.operator.bindings import DinfResource
from disagg.operator.rollout.state import ROLES
from disagg.operator.scale_executor import RoleResource

from . import report, schedule, workload
from .handoffs import Served, served
from .job import REPORT_KEY
from .replay import replay
from .settled import engines_left, waiting_for

log = logging.getLogger("disagg.compare")


def load(args: argparse.Namespace) -> tuple[list[workload.WorkloadRequest], str]:
    if args.workload is None:
        return (workload.synthetic(args.requests, args.prompt_words, args.output_tokens, args.seed),
                f"synthetic: {args.prompt_words}-word prompts, {args.output_tokens} tokens out")
    data = args.workload.read_bytes()
    text = (gzip.decompress(data) if args.workload.suffix == ".gz" else data).decode()
    return workload.parse_jsonl(text, args.workload.name), args.workload.name


async def _get(client: AsyncClient, ns: str, name: str) -> dict[str, Any]:
    obj: Any = await client.get(DinfResource, name, namespace=ns)
    out: dict[str, Any] = obj.to_dict()
    return out


async def set_mode(client: AsyncClient, ns: str, name: str, mode: str) -> None:
    """spec.kvTransfer.mode = `mode` (no write when it has it); the operator rolls the engines and router."""
    obj = await _get(client, ns, name)
    if api.DisaggregatedInference.model_validate(obj).spec.kv_transfer.mode != mode:
        log.info("switching %s/%s to %s", ns, name, mode)
        await client.patch(DinfResource, name, {"spec": {"kvTransfer": {"mode": mode}}}, namespace=ns,
                           patch_type=PatchType.MERGE)


async def serve_in(client: AsyncClient, ns: str, name: str, mode: str, timeout: float) -> None:
    """Switch the CR to `mode` and return once it is served in it."""
    await set_mode(client, ns, name, mode)
    await _until(client, ns, name, lambda o: waiting_for(o, mode), timeout)


async def _until(client: AsyncClient, ns: str, name: str, waiting: Callable[[dict[str, Any]], str | None],
                 timeout: float) -> None:
    """Return once `waiting(cr)` is None: it says, in words, what the CR is still waiting for (logged when it
    changes)."""
    deadline, said = time.monotonic() + timeout, None
    while (wait := waiting(await _get(client, ns, name))) is not None:
        if wait != said:
            log.info("waiting for %s", wait)
            said = wait
        if time.monotonic() > deadline:
            raise TimeoutError(f"{ns}/{name}: still waiting for {wait} after {timeout:g} s")
        await asyncio.sleep(2)  # the operator's progress, read from the CR's status


async def router_log(client: AsyncClient, ns: str, name: str, since_seconds: int) -> list[str]:
    lines: list[str] = []
    router: dict[str, Any] = dict(names.selector_labels(name, names.ROUTER))
    async for pod in client.list(Pod, namespace=ns, labels=router):
        assert pod.metadata is not None and pod.metadata.name is not None
        async for line in client.log(pod.metadata.name, namespace=ns, since=since_seconds):
            lines.append(line)
    return lines


async def recreate_in(client: AsyncClient, ns: str, name: str, mode: str, timeout: float) -> None:
    """Switch to `mode` with the old engines gone first: each role to 0 through its /scale, the mode, each role
    back to its count; return once it is served in `mode`. No-op when it has it."""
    obj = await _get(client, ns, name)
    if api.DisaggregatedInference.model_validate(obj).spec.kv_transfer.mode == mode:
        return await serve_in(client, ns, name, mode, timeout)
    counts: dict[str, int] = {}
    for role in ROLES:
        found: Any = await client.get(RoleResource, names.role_object_name(name, role), namespace=ns)
        counts[role] = int(found.to_dict()["spec"]["replicas"])
    log.info("stopping %s/%s's engines (%s) to switch to %s", ns, name,
             ", ".join(f"{n} {r}" for r, n in counts.items()), mode)
    for role in ROLES:
        await client.patch(RoleResource, names.role_object_name(name, role), {"spec": {"replicas": 0}},
                           namespace=ns, patch_type=PatchType.MERGE)
    await _until(client, ns, name, lambda o: f"{n} engines to stop" if (n := engines_left(o)) else None, timeout)
    await set_mode(client, ns, name, mode)
    for role in ROLES:
        await client.patch(RoleResource, names.role_object_name(name, role), {"spec": {"replicas": counts[role]}},
                           namespace=ns, patch_type=PatchType.MERGE)
    await serve_in(client, ns, name, mode, timeout)


async def router_records(client: AsyncClient, ns: str, name: str, since: float, ids: set[str],
                         wait: float = 30.0) -> dict[str, Served]:
    """The routers' records since `since` (epoch seconds), once they hold every id of `ids` or `wait` has passed:
    a router logs a request as it finishes, which can be just after the client read its last byte."""
    deadline = time.monotonic() + wait
    while True:
        joined = served(await router_log(client, ns, name, int(time.time() - since) + 10))
        if ids <= joined.keys() or time.monotonic() > deadline:
            return joined
        await asyncio.sleep(1)  # the routers' logs, read again


async def segment(client: AsyncClient, session: aiohttp.ClientSession, args: argparse.Namespace, url: str,
                  model: str, index: int, mode: schedule.Mode, reqs: list[workload.WorkloadRequest],
                  arrivals: list[float]) -> list[report.RequestTiming]:
    tag = f"[compare {index}]"
    warm = workload.synthetic(args.warmup, 16, 4, seed=args.seed + 1000 + index) if args.warmup else []
    if warm:
        await replay(session, url, model, warm, [0.0] * len(warm), args.request_timeout)
    started = time.time()
    step = max(1, len(reqs) // 10)

    def progress(done: int, total: int) -> None:
        if done % step == 0 or done == total:
            log.info("segment %d (%s): %d/%d answered", index + 1, mode, done, total)

    got = await replay(session, url, model, [r.tagged(tag) for r in reqs], arrivals, args.request_timeout,
                       progress)
    joined = await router_records(client, args.namespace, args.name, started,
                                  {t.request_id for t in got if t.ok and t.request_id})
    out = []
    for t in got:
        how = joined.get(t.request_id) if t.request_id else None
        out.append(report.RequestTiming(
            mode=mode, segment=index, sent_s=t.sent_s, ok=t.ok,
            ttft_ms=None if t.ttft_s is None else round(t.ttft_s * 1000, 3),
            tpot_ms=None if t.tpot_s is None else round(t.tpot_s * 1000, 3),
            handoff_ms=how.handoff_ms if how else None, served_mode=how.mode if how else None, error=t.error))
    return out


async def run(args: argparse.Namespace) -> report.CompareReport:
    reqs, source = load(args)
    arrivals = workload.arrivals(len(reqs), args.rate, args.seed)
    order = schedule.abba(args.rounds, args.first)
    async with AsyncClient() as client:
        cr = api.DisaggregatedInference.model_validate(await _get(client, args.namespace, args.name))
        if cr.status is None or not cr.status.endpoint:
            raise SystemExit(f"{args.namespace}/{args.name} has no endpoint yet (status.endpoint): is it Ready?")
        if args.switch == "recreate" and cr.spec.autoscaling is not None and cr.spec.autoscaling.mode == "Apply":
            raise SystemExit("--switch recreate scales both roles to 0, which the autoscaling planner would undo: "
                             "use --switch surge, or spec.autoscaling.mode: Recommend while comparing")
        switch = recreate_in if args.switch == "recreate" else serve_in
        original, url, model = cr.spec.kv_transfer.mode, cr.status.endpoint, cr.spec.served_name
        log.info("%d requests at %g/s per segment, %d segments (%s), from %s; %s serves %s now", len(reqs),
                 args.rate, len(order), ", ".join(order), source, args.name, original)
        timings: list[report.RequestTiming] = []
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
                for i, mode in enumerate(order):
                    await switch(client, args.namespace, args.name, mode, args.rollout_timeout)
                    timings += await segment(client, session, args, url, model, i, mode, reqs, arrivals)
        except asyncio.CancelledError:
            log.info("stopped: giving %s/%s its %s mode back", args.namespace, args.name, original)
            await asyncio.shield(set_mode(client, args.namespace, args.name, original))
            raise
        log.info("restoring %s", original)
        await switch(client, args.namespace, args.name, original, args.rollout_timeout)
        result = report.build(f"{args.namespace}/{args.name}",
                              report.Workload(source=source, requests=len(reqs), rate=args.rate, seed=args.seed),
                              order, timings, prefer=args.prefer, seed=args.seed)
        packed = base64.b64encode(gzip.compress(result.model_dump_json().encode(), mtime=0)).decode()
        await client.create(ConfigMap(
            metadata=ObjectMeta(name=args.report_configmap, namespace=args.namespace,
                                labels={names.LABEL_INSTANCE: args.name, names.LABEL_COMPONENT: "compare"}),
            data={"report.md": report.markdown(result), "plot.svg": report.svg(result)},
            binaryData={REPORT_KEY: packed}))
        log.info("report written to ConfigMap %s: %s", args.report_configmap, result.verdict.reason)
        return result


def main(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    async def until_stopped() -> None:
        # The Job's pod is stopped with SIGTERM (a deleted Job, a deadline): cancel the run so the CR gets its
        # mode back before the process goes.
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        await run(args)

    try:
        asyncio.run(until_stopped())
    except asyncio.CancelledError:
        raise SystemExit("disagg compare-run: stopped") from None
