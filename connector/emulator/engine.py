"""The emulated engine core: its requests, the step loop, and the KV handoff's bookkeeping on both sides.

This is the part that acts: it sleeps each step's cost, hands tokens to the HTTP handlers, keeps the prefix
cache's blocks and talks to peer emulators. What a step runs and what it costs is `scheduler`'s decision; which
blocks are hit, taken or evicted is `prefix_cache`'s.

A request's life (its `phase`, see scheduler.Phase):
- plain, or a P/D prefill leg: new → running (chunked prefill, then one token per step) → done. A prefill leg
  (`do_remote_decode`) makes one token; its blocks then stay held for its decode: push until the WRITE is done,
  pull until the decode's READ, either until the lease runs out;
- a P/D decode leg (`do_remote_prefill`): remote_new → remote_wait (blocks held for the whole prompt, the KV
  on its way: push registers with the prefill and waits for `written`; pull READs) → remote_ready (its last
  prompt token to compute, as vLLM recomputes it) → running → done.

Invariants:
- a block is held by at most the requests the prefix cache counts, and a request's blocks are released exactly
  once (done, aborted, failed, WRITE done, READ done, lease over);
- a push decode whose request ends before its KV landed frees its blocks only once its prefill has answered the
  cancel (no WRITE in flight) or the deadline plus a grace has passed, as the plugin's push cancel does;
- a prefill never WRITEs a registration it was told to cancel, nor one whose deadline has passed.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from . import prefix_cache as pc
from . import tokens as tok
from .kv_events import KvEventPublisher
from .metrics import EngineMetrics
from .profiles import EmulatorProfile
from .scheduler import Phase, Scheduled, SeqView, blocks_for, plan_step, step_seconds
from .side_channel import Client, PullRead, PushCancel, PushRegistration, PushWritten, SideChannelError

log = logging.getLogger("disagg.emulator")
KvMode = Literal["push", "pull"]
CANCEL_GRACE_S = 10.0
"""A cancelled push decode frees its blocks this long past its deadline without its prefill's answer (the
plugin's DEADLINE_GRACE)."""
LEASE_SWEEP_S = 1.0


@dataclass(frozen=True)
class RemotePrefill:
    """A decode leg's kv_transfer_params: where its KV comes from."""

    remote_request_id: str
    remote_host: str
    remote_port: int
    remote_engine_id: str


@dataclass
class Output:
    """What one step gave a request: new tokens, or its end (`finish`), or its failure (`error`)."""

    token_ids: list[int] = field(default_factory=list)
    finish: str | None = None
    error: str | None = None


@dataclass(eq=False)
class Request:
    id: str
    """vLLM's internal id: `base_id` and a random 8-hex suffix."""
    base_id: str
    """The id without the suffix: what a push decode's params name its prefill's request by."""
    prompt: list[int]
    max_tokens: int
    remote_decode: bool = False
    """A P/D prefill leg: it makes one token and keeps its blocks for the decode."""
    remote_prefill: RemotePrefill | None = None
    """A P/D decode leg: its prompt's KV comes from this prefill."""
    phase: Phase | Literal["done"] = "new"
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    hashes: list[pc.BlockHash] = field(default_factory=list)
    stored: int = 0
    """Leading full blocks already stored in the prefix cache."""
    outputs: list[int] = field(default_factory=list)
    local_hit: int = 0
    external: int = 0
    local_compute: int = 0
    created_blocks: int = 0
    """Blocks this request's own compute put in the prefix cache (vLLM's chat usage reports them)."""
    queue: asyncio.Queue[Output] = field(default_factory=asyncio.Queue)
    arrived: float = 0.0
    queued: float = 0.0
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    kv_transfer_params: dict[str, Any] | None = None
    landed: asyncio.Event = field(default_factory=asyncio.Event)
    preemptions: int = 0
    seed: bytes = b""

    def cached_tokens(self, kv_mode: KvMode) -> int:
        """`usage.prompt_tokens_details.cached_tokens` as vLLM 0.32 reports it: its local prefix-cache hit, and on a
        push decode the received tokens too (a pull decode leaves those out)."""
        if self.remote_prefill is not None and kv_mode == "push":
            return self.local_hit + self.external
        return self.local_hit

    @property
    def tokens(self) -> int:
        return len(self.prompt) + len(self.outputs)

    def all_tokens(self) -> list[int]:
        return self.prompt + self.outputs


def new_request(base_id: str, prompt: list[int], max_tokens: int, remote_decode: bool = False,
                remote_prefill: RemotePrefill | None = None) -> Request:
    phase: Phase = "remote_new" if remote_prefill is not None else "new"
    return Request(id=f"{base_id}-{secrets.token_hex(4)}", base_id=base_id, prompt=prompt, max_tokens=max_tokens,
                   remote_decode=remote_decode, remote_prefill=remote_prefill, phase=phase)


@dataclass
class _Held:
    """A finished P/D prefill leg's blocks, kept for its decode."""

    request: Request
    until: float  # monotonic: the lease
    writing: asyncio.Task[None] | None = None


class EmulatedEngine:
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
            for s, req in begun:
                events += self._begin(s, req, start)
            cost = step_seconds(plan, self.profile.step)
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

    def _begin(self, s: Scheduled, req: Request, now: float) -> list[pc.Event]:
        """Take the blocks the plan gave `req`; a waiting request moves on."""
        events: list[pc.Event] = []
        if req.phase in ("new", "remote_new"):
            hit = s.start // self.profile.block_size
            req.blocks = self.cache.touch(req.hashes[:hit])
            req.stored = hit
            req.computed = s.start
            req.local_hit = s.start
            self.cache.count_query(len(req.prompt), s.start)
            self.metrics.cache_query(len(req.prompt), s.start)
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

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("engine emulator task failed", exc_info=task.exception())

    def transfer_seconds(self, tokens: int) -> float:
        t = self.profile.transfer
        return t.fixed_s + t.per_token_s * tokens

    # -- prefill side of a handoff ------------------------------------------------------------------------------
    def _hold_for_decode(self, req: Request) -> None:
        loop = asyncio.get_running_loop()
        push = self.kv_mode == "push"
        key = req.base_id if push else req.id
        # vLLM's producer answer (nixl/push_scheduler.py and pull_scheduler.py request_finished), key for key.
        req.kv_transfer_params = {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": [req.blocks[:blocks_for(len(req.prompt), self.profile.block_size)]],
            "remote_engine_id": self.engine_id, "remote_request_id": req.id, "remote_host": self.host,
            "remote_port": self.port, "tp_size": self.profile.tp_size, "dcp_size": 1, "pp_size": 1,
            "remote_num_tokens": len(req.prompt), **({} if push else {"remote_blocks_expiry_time": None}),
            "transfer_mode": self.kv_mode, "remote_prefill_cached_tokens": req.local_hit}
        if push and self._cancelled(req.base_id):
            self._release(req)  # its decode is gone: nobody will take the KV
            return
        held = _Held(req, loop.time() + self.lease_seconds)
        self.held[key] = held
        if push and (reg := self.registrations.pop(req.base_id, None)) is not None:
            held.writing = asyncio.create_task(self._write(held, reg))

    def _cancelled(self, base_id: str) -> bool:
        until = self.cancelled.get(base_id)
        return until is not None and until > time.time()

    def push_register(self, reg: PushRegistration) -> None:
        """A decode's registration (side channel): WRITE now if the prefill has finished, else when it does."""
        if self._cancelled(reg.remote_request_id) or reg.deadline < time.time():
            return
        held = self.held.get(reg.remote_request_id)
        if held is None:
            self.registrations[reg.remote_request_id] = reg
        elif held.writing is None:
            held.writing = asyncio.create_task(self._write(held, reg))

    async def _write(self, held: _Held, reg: PushRegistration) -> None:
        t0 = asyncio.get_running_loop().time()
        await asyncio.sleep(self.transfer_seconds(reg.tokens))
        seconds = asyncio.get_running_loop().time() - t0
        try:
            if not self._cancelled(reg.remote_request_id) and reg.deadline >= time.time():
                await self.peers.send(reg.host, reg.port, "/push/written",
                                      PushWritten(request_id=reg.request_id, tokens=reg.tokens, seconds=seconds))
                self.metrics.transfer(seconds, reg.tokens * self.profile.kv_bytes_per_token)
        except SideChannelError as e:
            log.warning("engine emulator: WRITE of %s to %s failed: %s", reg.request_id, reg.engine_id, e)
            self.metrics.transfer_failed()
        finally:
            self.held.pop(reg.remote_request_id, None)
            self._release(held.request)

    async def push_cancel(self, msg: PushCancel) -> None:
        """The decode will not take this KV: drop its registration, never WRITE it, free what we hold for it.
        Returns (the plugin's `ack`) once no WRITE of it is in flight."""
        self.cancelled[msg.remote_request_id] = time.time() + self.registration_timeout + CANCEL_GRACE_S
        self.registrations.pop(msg.remote_request_id, None)
        held = self.held.get(msg.remote_request_id)
        if held is None:
            return
        if held.writing is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(held.writing)
            return
        self.held.pop(msg.remote_request_id, None)
        self._release(held.request)

    async def pull_read(self, msg: PullRead) -> bool:
        """A decode READs a finished prefill's blocks (side channel): they are freed once it is done."""
        held = self.held.pop(msg.remote_request_id, None)
        if held is None:
            return False
        try:
            await asyncio.sleep(self.transfer_seconds(msg.tokens))
        finally:
            self._release(held.request)
        return True

    async def _sweep_leases(self) -> None:
        """Free what finished prefill legs hold once their lease is over (no decode came), and forget old
        cancels and registrations."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(LEASE_SWEEP_S)
            now, wall = loop.time(), time.time()
            for key, held in list(self.held.items()):
                if held.until < now and held.writing is None:
                    del self.held[key]
                    self._release(held.request)
                    self.metrics.lease_expired()
            for key, until in list(self.cancelled.items()):
                if until < wall:
                    del self.cancelled[key]
            for key, reg in list(self.registrations.items()):
                if reg.deadline < wall:
                    del self.registrations[key]

    # -- decode side of a handoff -------------------------------------------------------------------------------
    async def _receive(self, req: Request) -> None:
        assert req.remote_prefill is not None
        remote = req.remote_prefill
        tokens = len(req.prompt) - req.local_hit
        try:
            if self.kv_mode == "push":
                deadline = time.time() + self.registration_timeout
                await self.peers.send(remote.remote_host, remote.remote_port, "/push/register", PushRegistration(
                    remote_request_id=remote.remote_request_id, request_id=req.id, engine_id=self.engine_id,
                    host=self.host, port=self.port, tokens=tokens, deadline=deadline))
                try:
                    await asyncio.wait_for(req.landed.wait(), self.registration_timeout)
                except TimeoutError:
                    if req.phase == "remote_wait":
                        log.warning("engine emulator: registration for request %s timed out after %.1fs without "
                                    "a push completion", req.id, self.registration_timeout)
                        self._fail(req, "KV transfer failed: registration timed out")
                        self._spawn(self._cancel_then_release(req, "timed out"))
                return
            t0 = asyncio.get_running_loop().time()
            status = await self.peers.send(remote.remote_host, remote.remote_port, "/pull/read",
                                           PullRead(remote_request_id=remote.remote_request_id, tokens=tokens),
                                           timeout=self.registration_timeout)
            if req.phase != "remote_wait":
                return  # aborted while reading: abort() released the blocks
            if status != 200:
                self._fail(req, "KV transfer failed: the prefill engine no longer holds the blocks")
                self._release(req)
                return
            self.metrics.transfer(asyncio.get_running_loop().time() - t0, tokens * self.profile.kv_bytes_per_token)
            self._landed(req)
        except SideChannelError as e:
            if req.phase == "remote_wait":
                log.warning("engine emulator: KV handoff of %s from %s failed: %s", req.id, remote.remote_engine_id,
                            e)
                self._fail(req, f"KV transfer failed: {e}")
                self._release(req)

    def push_written(self, msg: PushWritten) -> bool:
        """A prefill's WRITE landed (side channel)."""
        req = self.awaiting_kv.get(msg.request_id)
        if req is None or req.phase != "remote_wait":
            return False
        self._landed(req)
        return True

    def _landed(self, req: Request) -> None:
        """The prompt's KV is here: all of it but the last token, which vLLM computes again for its logits."""
        self.awaiting_kv.pop(req.id, None)
        req.landed.set()
        req.computed = len(req.prompt) - 1
        # vLLM counts the whole prompt as received (its last token too, which it computes again for the logits).
        req.external = len(req.prompt) - req.local_hit
        self._publish(self._store_full_blocks(req))
        req.phase = "remote_ready"
        self.waiting.append(req)
        self._wake.set()

    def _fail(self, req: Request, message: str) -> None:
        self.awaiting_kv.pop(req.id, None)
        if req in self.waiting:
            self.waiting.remove(req)
        req.phase = "done"
        req.queue.put_nowait(Output(error=message))
        self.metrics.failed()

    async def _cancel_then_release(self, req: Request, reason: str) -> None:
        """Tell the prefill, and free the blocks once it has answered (or the deadline and grace are over)."""
        assert req.remote_prefill is not None
        remote = req.remote_prefill
        try:
            await self.peers.send(remote.remote_host, remote.remote_port, "/push/cancel",
                                  PushCancel(remote_request_id=remote.remote_request_id, request_id=req.id),
                                  timeout=self.registration_timeout + CANCEL_GRACE_S)
        except SideChannelError as e:
            log.info("engine emulator: prefill %s did not answer the cancel of %s (%s): freeing its blocks after "
                     "the grace", remote.remote_engine_id, req.id, e)
            await asyncio.sleep(CANCEL_GRACE_S)
        self._release(req)
        if reason == "aborted":
            self.metrics.aborted()

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
