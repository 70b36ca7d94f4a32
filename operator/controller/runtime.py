"""The running operator: the state its handlers feed and its passes act through, in one typed object, and the
background loops.

What asks for a pass (handlers.py, and the loops here), and which:
- the CR is created, its spec changed, or it is found at start-up → full pass (generations.py decides from the
  CR's own watch events, not kopf's change detection, which would write a copy of each spec into an annotation);
- a child changed and it is not the echo of our own apply (a hand edit, a deletion) → full pass;
- a child's status changed, an engine pod's state changed, a pod could not be created or could not mount a
  volume (Events), a role object got a new count (`kubectl scale`, an HPA, KEDA, the autoscaling planner) →
  status pass;
- every --resync-seconds → a thorough full pass of every CR, one at a time (drift correction; writes nothing when
  nothing drifted), once the passes waiting for a slot have gone (`_resync_forever`);
- the engines' reported transport changed in the deployment's rendezvous → status pass (`_poll_transports_forever`
  reads every rendezvous in the background; passes only read its cached answers).

The loops are plain asyncio tasks, not kopf timers: kopf timers put a finalizer on every CR, and a CR must stay
deletable when the operator is not running (owner references do the cleanup).

The one child owner references cannot clean up is the rendezvous' ClusterRoleBinding (auth kubernetes; it is
cluster-scoped). Without a finalizer: a CR's DELETED watch event removes its binding at once, best effort, and every
resync round removes any binding whose CR is gone (deleted while the operator was down, or an event missed).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

from lightkube import AsyncClient

from .. import metrics
from ..autoscale_executor import Autoscaler
from ..generations import Generations
from ..metrics import PLANNER_DECISIONS
from ..names import Key
from ..reconciler import Reconciler
from ..transport import TransportPoller
from . import events
from .events import Poster
from .indexes import Indexes
from .observe import may_turn_ready
from .queue import Work, WorkQueue
from .reconcile import Parts, run_pass
from .settings import Settings

log = logging.getLogger("disagg.operator")


class Controller:
    def __init__(self, settings: Settings, client: AsyncClient, indexes: Indexes) -> None:
        self.settings = settings
        self.indexes = indexes
        self.poster = Poster()
        self.generations = Generations()
        self.reconciler = Reconciler(client, settings.images, namespaces=settings.namespaces)
        self.transports = TransportPoller(
            settings.rendezvous_url_template, timeout=settings.rendezvous_timeout,
            interval=settings.transport_poll_seconds, on_change=self._transport_changed)
        self.autoscaler = Autoscaler(client, PLANNER_DECISIONS, window_seconds=settings.autoscale_window_seconds)
        parts = Parts(indexes, self.reconciler, self.transports, self.poster)

        async def one(key: Key, work: Work) -> float | None:
            return await run_pass(parts, key, work.full, work.trigger)

        self.queue = WorkQueue(one, settings.max_concurrent_passes)
        slots = self.queue.slots
        metrics.PASSES_WAITING.labels(lane="urgent").set_function(lambda: slots.waiting()[0])
        metrics.PASSES_WAITING.labels(lane="other").set_function(lambda: slots.waiting()[1])
        self._loops: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._loops = [asyncio.create_task(self._resync_forever()),
                       asyncio.create_task(self._poll_transports_forever()),
                       asyncio.create_task(self._autoscale_forever())]

    async def close(self) -> None:
        for task in self._loops:
            task.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        await self.queue.close()
        await self.autoscaler.close()
        await self.transports.close()
        await self.reconciler.client.close()

    # -- feeding the queue --------------------------------------------------------------------------------------
    def enqueue(self, key: Key, *, full: bool, trigger: str) -> None:
        """Queue a pass of a CR the index knows. A status pass that may turn the CR Ready (or not) is urgent."""
        if key not in self.indexes:
            return
        self.queue.add(key, full=full, trigger=trigger, urgent=not full and may_turn_ready(self.indexes, key))

    async def cr_deleted(self, key: Key) -> None:
        """A CR's DELETED event: forget it, and remove its rendezvous binding at once."""
        self.generations.forget(key)
        self.queue.cancel_retry(key)
        await self.collect_bindings(only=key)

    async def _transport_changed(self, key: Key) -> None:
        self.enqueue(key, full=False, trigger="transport")

    # -- the loops -----------------------------------------------------------------------------------------------
    async def collect_bindings(self, only: Key | None = None) -> None:
        """Remove rendezvous ClusterRoleBindings whose CR is gone; a failure waits for the next round. A CR that does
        not parse keeps its binding: nothing proves it does not need one."""
        needed: set[Key] = set()
        if only is None:
            needed = {key for key in self.indexes.keys() if (entry := self.indexes.entry(key)) is not None
                      and (entry.cr is None or entry.cr.spec.rendezvous.auth == "kubernetes")}
        try:
            await self.reconciler.collect_bindings(only=only, needed=needed)
        except Exception as e:  # never ends the resync loop; the next round retries
            log.warning(f"removing rendezvous ClusterRoleBindings of deleted CRs failed: {e}")

    async def _drained(self, timeout: float) -> None:
        """Return once no pass waits for a slot, or after `timeout` seconds (at once when it is not positive)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.queue.slots.drained(), max(0.0, timeout))

    async def _resync_forever(self) -> None:
        """Every --resync-seconds, a thorough full pass of every known CR, one at a time. A round, and each of its
        passes, first lets the passes waiting for a slot go (a burst of creates: its CRs were just applied, and a
        resync pass there only competes with the burst for the apiserver), waiting at most --resync-seconds per
        round in all, so a fleet that is never quiet is still resynced."""
        interval = self.settings.resync_seconds
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval)
            patience = loop.time() + interval
            await self._drained(patience - loop.time())
            await self.collect_bindings()
            try:
                await self.reconciler.observe_unwatched()
            except Exception as e:  # then the passes verify those children by applying them, as without a listing
                log.warning(f"listing the rendezvous' ServiceAccounts and ClusterRoleBindings failed: {e}")
            keys = self.indexes.keys()
            metrics.MANAGED.set(len(keys))
            for key in keys:
                await self._drained(patience - loop.time())
                if key not in self.indexes:
                    continue
                # Whichever pass of this CR runs next verifies its children, also when this trigger joins a pass
                # already waiting or queues behind a running one.
                self.reconciler.verify_next(key)
                await self.queue.run(key, full=True, trigger="resync")
            metrics.RESYNC_ROUNDS.inc()

    async def _poll_transports_forever(self) -> None:
        """Every --transport-poll-seconds, re-read every deployment's rendezvous in the background; answers that
        changed trigger status passes (`_transport_changed`). Deployments that left the index are forgotten."""
        while True:
            await asyncio.sleep(self.settings.transport_poll_seconds)
            keys = self.indexes.keys()
            for key in self.transports.keys() - set(keys):
                self.transports.forget(key)
            for key in keys:
                entry = self.indexes.entry(key)
                if entry is None or entry.cr is None or not entry.cr.spec.advertises:
                    continue  # unparsable, or a vendor connector: its engines never report a transport
                self.transports.request(key, force=True)

    async def _autoscale_forever(self) -> None:
        """Every --autoscale-seconds, one autoscaling tick for each CR with spec.autoscaling, all at once
        (autoscale_executor.py). CRs that left the index, or dropped spec.autoscaling, are forgotten."""
        scale_log = logging.getLogger("disagg.autoscale")
        while True:
            await asyncio.sleep(self.settings.autoscale_seconds)
            ticks: dict[Key, Coroutine[Any, Any, None]] = {}
            for key in self.indexes.keys():
                entry = self.indexes.entry(key)
                if entry is None or entry.cr is None or entry.deleting or entry.cr.spec.autoscaling is None:
                    continue
                body = entry.body

                def post(kind: str, reason: str, message: str, body: Any = body) -> None:
                    self.poster.post(body, [events.from_kind(kind, reason, message)])

                ticks[key] = self.autoscaler.tick(entry.cr, self.indexes.live_roles(key), post)
            for key in self.autoscaler.keys() - set(ticks):
                self.autoscaler.forget(key)
            results = await asyncio.gather(*ticks.values(), return_exceptions=True)
            for key, result in zip(ticks, results, strict=True):
                if isinstance(result, Exception):
                    metrics.AUTOSCALE_TICKS.labels(result="error").inc()
                    scale_log.error("%s/%s: autoscaling tick failed: %r", *key, result)
