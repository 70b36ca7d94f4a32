"""The emulated engine core: the step loop and a request's life through it.

This is the part that acts: it sleeps each step's cost, hands tokens to the HTTP handlers, keeps the prefix
cache's blocks and hands finished P/D legs to the KV handoff (handoff.py). What a step runs and what it costs is
`scheduler`'s decision; which blocks are hit, taken or evicted is `prefix_cache`'s.

A request's life (its `phase`, see scheduler.Phase):
- plain, or a P/D prefill leg: new → running (chunked prefill, then one token per step) → done. A prefill leg
  (`do_remote_decode`) makes one token; its blocks then stay held for its decode (handoff.py);
- a P/D decode leg (`do_remote_prefill`): remote_new → remote_wait (blocks held for the whole prompt, the KV
  on its way) → remote_ready (its last prompt token to compute, as vLLM recomputes it) → running → done.

Invariant: a block is held by at most the requests the prefix cache counts, and a request's blocks are released
exactly once (done, aborted, failed, WRITE done, READ done, lease over).
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Coroutine, Iterator
from typing import Any

from . import prefix_cache as pc
from . import tokens as tok
from .handoff import KvHandoff, _Held
from .kv_events import KvEventPublisher
from .metrics import EngineMetrics
from .profiles import EmulatorProfile
from .requests import KvMode, Output, RemotePrefill, Request, new_request
from .scheduler import Scheduled, SeqView, plan_step, step_seconds
from .side_channel import Client, PushRegistration

log = logging.getLogger("disagg.emulator")
__all__ = ["EmulatedEngine", "KvMode", "Output", "RemotePrefill", "Request", "new_request"]


class EmulatedEngine(KvHandoff):
    def __init__(self, profile: EmulatorProfile, *, role: str, kv_mode: KvMode, engine_id: str,
                 side_channel_host: str, side_channel_port: int, metrics: EngineMetrics,
                 publisher: KvEventPublisher | None = None, peers: Client | None = None,
                 registration_timeout: float = 60.0, lease_seconds: float = 30.0) -> None:
        self.profile, self.role, self.kv_mode = profile, role, kv_mode
        self.engine_id, self.host, self.port = engine_id, side_channel_host, side_channel_port
        self.metrics, self.publisher = metrics, publisher
        self.peers = peers or Client()
        self.registration_timeout, self.lease_seconds = registration_timeout, lease_seconds
        self.cache = pc.PrefixCache(profile.num_blocks, profile.block_size)
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.awaiting_kv: dict[str, Request] = {}
        """Decode legs holding blocks while their KV is on its way, by request id."""
        self.held: dict[str, _Held] = {}
        """Finished prefill legs holding blocks for their decode: push by base id, pull by request id."""
        self.registrations: dict[str, PushRegistration] = {}
        """Push registrations that came before their prefill finished, by the prefill's base id."""
        self.cancelled: dict[str, float] = {}
        """Prefill base ids whose decode cancelled, until their deadline: never WRITE them."""
        self.tasks: set[asyncio.Task[Any]] = set()
        self.contention = profile.contention.of(role)
        self._wake = asyncio.Event()
        self.steps = 0
        self.stopping = False

    # -- requests in --------------------------------------------------------------------------------------------
    async def add(self, req: Request) -> None:
        """Hand a request to the scheduler after the API server's share of its latency."""
        loop = asyncio.get_running_loop()
        req.arrived = loop.time()
        await asyncio.sleep(self.profile.api_latency_s)
        req.queued = loop.time()
        req.hashes = pc.chain_hashes(req.prompt, self.profile.block_size)
        self.waiting.append(req)
        self._gauges()
        self._wake.set()

    def abort(self, req: Request) -> None:
        """The client went away (its HTTP handler was cancelled): stop the request and free what it holds. A push
        decode leg tells its prefill first (even before it registered: the prefill then frees its finished blocks
        at once instead of at its lease's end), and frees its blocks once the prefill has answered."""
        if req.phase == "done":
            return
        phase, req.phase = req.phase, "done"
        req.landed.set()
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        self.awaiting_kv.pop(req.id, None)
        if phase in ("remote_new", "remote_wait") and self.kv_mode == "push":
            self._spawn(self._cancel_then_release(req, "aborted"))
            return
        self._release(req)
        self.metrics.aborted()

    # -- the step loop ------------------------------------------------------------------------------------------
    def _schedulable(self) -> bool:
        return bool(self.running) or any(r.phase != "remote_wait" for r in self.waiting)

    async def run(self) -> None:
        """Step forever: plan (pure), take blocks, sleep the step's cost, deliver its tokens."""
        loop = asyncio.get_running_loop()
        self._spawn(self._sweep_leases())
        while True:
            if not self._schedulable():
                self._wake.clear()
                await self._wake.wait()
                continue
            start = loop.time()
            plan = plan_step([self._view(r) for r in self.running], self._waiting_views(), self.cache.num_free,
                             self.profile)
            events: list[pc.Event] = []
            for rid in plan.preempted:
                self._preempt(rid)
            by_id = {r.id: r for r in [*self.running, *self.waiting]}
            begun = [(s, by_id[s.id]) for s in plan.scheduled]
            # Every admitted request's hit first: an allocation evicts unheld cached blocks, and must never take
            # the blocks the plan counted as another request's hit (vLLM looks each hit up just before its own
            # allocation; the plan here looked them all up before any).
            for s, req in begun:
                self._take_hit(s, req)
            for s, req in begun:
                events += self._begin(s, req, start)
            cost = step_seconds(plan, self.profile.step, self.contention)
            if cost > 0:
                await asyncio.sleep(max(0.0, start + cost - loop.time()))
            now = loop.time()
            computed = 0
            for s, req in begun:
                if s.tokens and req.phase == "running":
                    computed += s.tokens
                    events += self._advance(req, s.tokens, now)
            self.steps += 1
            self._publish(events)
            self.metrics.step(computed)
            self._gauges()
            if not plan.scheduled:
                # Nothing fit (every block held by requests waiting for their KV): wait for a change.
                self._wake.clear()
                await self._wake.wait()

    def _view(self, r: Request) -> SeqView:
        return SeqView(r.id, "running", r.tokens, r.computed, len(r.blocks), prompt_tokens=len(r.prompt))

    def _waiting_views(self) -> Iterator[SeqView]:
        """Lazily: the scheduler stops at the first request that does not fit, and a hit costs a lookup."""
        for r in list(self.waiting):
            if r.phase in ("new", "remote_new"):
                limit = (len(r.prompt) if r.phase == "remote_new" else r.tokens) - 1
                hit = self.cache.longest_hit(r.hashes, limit)
                free = self.cache.free_blocks_among(r.hashes[:hit])
                yield SeqView(r.id, r.phase, r.tokens, hit * self.profile.block_size, 0, hit, free, len(r.prompt))
            elif r.phase != "done":
                yield SeqView(r.id, r.phase, r.tokens, r.computed, len(r.blocks), prompt_tokens=len(r.prompt))

    def _take_hit(self, s: Scheduled, req: Request) -> None:
        """Hold the cached blocks the plan gave an admitted request as its hit."""
        if req.phase in ("new", "remote_new"):
            hit = s.start // self.profile.block_size
            req.blocks = self.cache.touch(req.hashes[:hit])
            req.stored = hit
            req.computed = s.start
            req.local_hit = s.start
            self.cache.count_query(len(req.prompt), s.start)
            self.metrics.cache_query(len(req.prompt), s.start)

    def _begin(self, s: Scheduled, req: Request, now: float) -> list[pc.Event]:
        """Take the new blocks the plan gave `req` (after its hit: `_take_hit`); a waiting request moves on."""
        events: list[pc.Event] = []
        ids, evicted = self.cache.allocate(s.new_blocks)
        req.blocks += ids
        events += evicted
        if req.phase == "remote_new":
            self.waiting.remove(req)
            req.phase = "remote_wait"
            self.awaiting_kv[req.id] = req
            self._spawn(self._receive(req))
        elif req.phase in ("new", "remote_ready"):
            self.waiting.remove(req)
            req.phase = "running"
            self.running.append(req)
            if req.scheduled is None:
                req.scheduled = now
                self.metrics.queued(now - req.queued)
        return events

    def _advance(self, req: Request, n: int, now: float) -> list[pc.Event]:
        """`n` more tokens of `req` computed at `now`: store its newly full blocks; sample when it is caught up."""
        events: list[pc.Event] = []
        prompt_part = max(0, min(req.computed + n, len(req.prompt)) - req.computed)
        req.local_compute += prompt_part
        req.computed += n
        stored = self._store_full_blocks(req)
        req.created_blocks += sum(len(e.hashes) for e in stored if isinstance(e, pc.Stored))
        events += stored
        if req.computed < req.tokens:
            return events  # a prefill chunk: no token yet
        if not req.seed:
            req.seed = tok.answer_seed(req.prompt)
        token = tok.answer_token(req.seed, len(req.outputs), self.profile.vocab_size)
        req.outputs.append(token)
        if req.first_token is None:
            req.first_token = now
            self.metrics.first_token(now - req.arrived, req)
        else:
            assert req.last_token is not None
            self.metrics.inter_token(now - req.last_token)
        req.last_token = now
        finished = len(req.outputs) >= req.max_tokens or req.tokens >= self.profile.max_model_len
        if not finished:
            req.queue.put_nowait(Output([token]))
            return events
        self.running.remove(req)
        req.phase = "done"
        self.metrics.finished(req, now)
        if req.remote_decode:
            self._hold_for_decode(req)
        else:
            self._release(req)
        req.queue.put_nowait(Output([token], finish="length"))
        return events

    def _store_full_blocks(self, req: Request) -> list[pc.Event]:
        bs = self.profile.block_size
        full = min(req.computed, req.tokens) // bs
        if full <= req.stored:
            return []
        if len(req.hashes) < full:  # output tokens filled a block: extend the chain over them
            req.hashes = pc.chain_hashes(req.all_tokens()[:full * bs], bs)
        start = req.stored
        parent = req.hashes[start - 1] if start else None
        events = self.cache.store(req.blocks[start:full], req.hashes[start:full], parent,
                                  req.all_tokens()[start * bs:full * bs])
        req.stored = full
        return events

    def _preempt(self, rid: str) -> None:
        """vLLM's recompute preemption: drop the KV, wait at the queue's head, compute everything again."""
        req = next(r for r in self.running if r.id == rid)
        self.running.remove(req)
        self._release(req)
        req.phase, req.computed, req.stored = "new", 0, 0
        req.hashes = pc.chain_hashes(req.all_tokens(), self.profile.block_size)
        req.preemptions += 1
        self.waiting.appendleft(req)
        self.metrics.preempted()

    def _release(self, req: Request) -> None:
        if req.blocks:
            self.cache.release(req.blocks)
            req.blocks = []
            self._gauges()
        self._wake.set()

    def _gauges(self) -> None:
        """vLLM refreshes these after every step, and steps until a finished request's KV is sent: here they follow
        every change."""
        self.metrics.state(len(self.running), len(self.waiting) + len(self.awaiting_kv), len(self.awaiting_kv),
                           self.cache.usage())

    def _publish(self, events: list[pc.Event]) -> None:
        if events and self.publisher is not None:
            self.publisher.publish(events)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("engine emulator task failed", exc_info=task.exception())

    # -- stop ---------------------------------------------------------------------------------------------------
    def drained(self) -> bool:
        return not (self.running or self.waiting or self.awaiting_kv)

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        for held in self.held.values():
            if held.writing is not None:
                held.writing.cancel()
        await self.peers.close()
