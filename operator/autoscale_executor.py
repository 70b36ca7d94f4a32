"""The autoscaling executor: each tick, for one CR with spec.autoscaling, scrape its routers' and engines'
`/metrics`, ask the planner, and apply what its decision means (autoscaling/outcome.py).

Hard bounds:
- a role's count is written only with spec.autoscaling.mode Apply (the default; Recommend writes none), only
  through its DisaggregatedRole, as `kubectl scale` or an HPA would, and only if
  the role object is still at the resourceVersion decided from (a merge patch carrying it): a count someone else
  wrote meanwhile is never overwritten unseen; the planner sees it at its next tick. The status pass that the
  write's watch event brings applies the count through the rollout machinery;
- a tick that cannot observe (no router answered, a source that is not what it should be) decides nothing and
  writes nothing; it is logged, and a Warning Event is posted once per distinct reason;
- each scrape is one GET bounded by `timeout`; an engine that does not answer is left out of its role's load,
  a router that does not answer out of the window (its counters are read again at the next tick, which then
  covers both windows);
- status.autoscaling is written when outcome() says (a change a reader acts on, or a minute since the last
  write), and never by the reconcile passes (they keep it).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aiohttp
from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.resources.core_v1 import Pod
from lightkube.types import PatchType

from . import api, metrics, names
from .autoscaling import outcome as outcomes
from .autoscaling import planner, policy, scrape, tracker
from .bindings import DinfResource
from .meta import FIELD_MANAGER, cr_name, namespace_of
from .names import Key
from .planner_metrics import PlannerDecisions
from .rollout.state import ROLES, Role
from .scale.counts import LiveRole
from .scale_executor import RoleResource

EventFn = Callable[[str, str, str], None]  # (type Normal|Warning, reason, message)

log = logging.getLogger("disagg.operator.autoscale")


@dataclass(frozen=True)
class Target:
    """A pod to scrape: its name (the snapshot's source), its component and its metrics URL."""

    pod: str
    component: str
    url: str


def targets(pods: Iterable[Mapping[str, Any]], engine_port: int) -> list[Target]:
    """The Ready router and engine pods among `pods`, with an IP."""
    out = []
    for pod in pods:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        component = (meta.get("labels") or {}).get(names.LABEL_COMPONENT)
        ip = status.get("podIP")
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ())
        if not (ip and ready) or meta.get("deletionTimestamp"):
            continue
        if component == names.ROUTER:
            port = names.ROUTER_CONTAINER_PORT
        elif component in ROLES:
            port = engine_port
        else:
            continue
        host = f"[{ip}]" if ":" in ip else ip
        out.append(Target(str(meta.get("name") or ""), component, f"http://{host}:{port}/metrics"))
    return sorted(out, key=lambda t: t.pod)


def advertised(status: api.DisaggregatedInferenceStatus | None, role: Role) -> int:
    """The role's engines in the rendezvous, over every revision (the rollout's last view of them)."""
    if status is None:
        return 0
    return sum((r.prefill if role == "prefill" else r.decode).advertised for r in status.revisions)


class Autoscaler:
    def __init__(self, client: AsyncClient, decisions: PlannerDecisions | None = None, *, timeout: float = 3.0,
                 concurrency: int = 32, clock: Callable[[], float] = time.monotonic,
                 window_seconds: float | None = None) -> None:
        self.client = client
        self.window_seconds = window_seconds
        """The arrivals and latencies each tick reads span this much (None: the time since the last tick)."""
        self.decisions = decisions or PlannerDecisions()
        self.timeout = timeout
        self._clock = clock
        self._memory: dict[Key, tracker.Memory] = {}
        self._warned: dict[Key, str] = {}
        self._gate = asyncio.Semaphore(concurrency)
        self._session: aiohttp.ClientSession | None = None

    def keys(self) -> set[Key]:
        return set(self._memory)

    def forget(self, key: Key) -> None:
        self._memory.pop(key, None)
        self._warned.pop(key, None)
        self.decisions.forget(*key)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def tick(self, cr: api.DisaggregatedInference, roles: Mapping[Role, LiveRole], post: EventFn) -> None:
        """One observation and decision for `cr` (which has spec.autoscaling); `roles`: its role objects as the
        watch shows them (a tick without both waits for the status pass that creates them)."""
        spec = cr.spec.autoscaling
        assert spec is not None
        key = (namespace_of(cr), cr_name(cr))
        if any(r not in roles for r in ROLES):
            return
        pods = [p.to_dict() async for p in self.client.list(
            Pod, namespace=key[0], labels={names.LABEL_INSTANCE: key[1], names.LABEL_MANAGED_BY: names.MANAGED_BY})]
        found = targets(pods, cr.spec.engine.port)
        texts = await self._scrape(found)
        at = self._clock()
        snapshot = {c: scrape.parse({t.pod: texts[t.pod] for t in found if t.component == c and t.pod in texts})
                    for c in (names.ROUTER, *ROLES)}
        if not snapshot[names.ROUTER].sources:
            self._cannot(key, post, "no router answered its /metrics scrape")
            metrics.AUTOSCALE_TICKS.labels(result="blind").inc()
            return
        now = datetime.now(UTC)
        previous = cr.status.autoscaling if cr.status is not None else None
        counts = {r: tracker.RoleCounts(roles[r].replicas, advertised(cr.status, r),
                                        outcomes.seconds_since_scale(previous, r, now)) for r in ROLES}
        pol = policy.from_spec(spec)
        memory = self._memory.get(key, tracker.Memory())
        this = tracker.Scrape(at, snapshot[names.ROUTER], snapshot["prefill"], snapshot["decode"])
        startup = float(cr.spec.rollout.startup_seconds or tracker.STARTUP_SECONDS)
        try:
            observed, self._memory[key] = tracker.observe(memory, this, counts, pol.percentile, startup,
                                                          self.window_seconds)
        except ValueError as e:
            self._memory[key] = tracker.Memory(last=this)
            self._cannot(key, post, str(e))
            metrics.AUTOSCALE_TICKS.labels(result="blind").inc()
            return
        if observed is None:
            metrics.AUTOSCALE_TICKS.labels(result="first").inc()
            return
        self._warned.pop(key, None)
        decision = planner.decide(observed, pol)
        self.decisions.record(*key, decision)
        metrics.AUTOSCALE_TICKS.labels(result="decided").inc()
        result = outcomes.outcome(decision, {r: roles[r].replicas for r in ROLES}, previous, now,
                                  apply=spec.mode == "Apply")
        for role, count in result.writes.items():
            if not await self._write(roles[role], key[0], count):
                return  # changed under the planner: the next tick decides from the new count
        if result.publish:
            await self._publish(key, result.status)
        for event in result.events:
            post(event.type, event.reason, event.message)

    async def _scrape(self, found: list[Target]) -> dict[str, str]:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
        session = self._session

        async def one(t: Target) -> tuple[str, str | None]:
            async with self._gate:
                try:
                    async with session.get(t.url) as r:
                        return t.pod, await r.text() if r.status == 200 else None
                except (TimeoutError, aiohttp.ClientError, OSError) as e:
                    log.debug("scraping %s (%s) failed: %r", t.pod, t.url, e)
                    return t.pod, None

        answers = await asyncio.gather(*(one(t) for t in found))
        return {pod: text for pod, text in answers if text is not None}

    async def _write(self, live: LiveRole, namespace: str, count: int) -> bool:
        try:
            await self.client.patch(RoleResource, live.name,
                                    {"metadata": {"resourceVersion": live.resource_version},
                                     "spec": {"replicas": count}},
                                    namespace=namespace, patch_type=PatchType.MERGE, field_manager=FIELD_MANAGER)
        except ApiError as e:
            if e.status.code in (404, 409):
                return False
            metrics.API_ERRORS.labels(kind="DisaggregatedRole", verb="patch").inc()
            raise
        metrics.CHILD_WRITES.labels(kind="DisaggregatedRole", change="updated").inc()
        return True

    async def _publish(self, key: Key, status: api.AutoscalingStatus) -> None:
        try:
            await self.client.patch(DinfResource.Status, key[1], {"status": {"autoscaling": status.dump()}},
                                    namespace=key[0], patch_type=PatchType.MERGE)
        except ApiError as e:
            if e.status.code != 404:
                metrics.API_ERRORS.labels(kind=api.KIND, verb="patch-status").inc()
                raise
            return
        metrics.STATUS_WRITES.inc()

    def _cannot(self, key: Key, post: EventFn, why: str) -> None:
        log.warning("%s/%s: the autoscaling planner cannot observe: %s", *key, why)
        if self._warned.get(key) != why:
            self._warned[key] = why
            post("Warning", "AutoscalingBlind", f"no autoscaling decision: {why}")
