"""Both sides of the KV handoff between emulated engines, over the emulated side channel (side_channel.py): what
a prefill engine does with a finished P/D prefill's blocks (hold them for the decode: push WRITEs once the decode
registered, pull waits for its READ; either frees them at the lease's end), and what a decode engine does to get
its KV (push registers and waits, pull READs; an abort or a timeout cancels, and the blocks go once the prefill
answered, as the plugin's push cancel does).

Invariants:
- a prefill never WRITEs a registration it was told to cancel, nor one whose deadline has passed;
- a push decode whose request ends before its KV landed frees its blocks only once its prefill has answered the
  cancel (no WRITE in flight) or the deadline plus a grace has passed.

A mixin of the engine (engine.EmulatedEngine): it shares the engine's state, declared below.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from . import prefix_cache as pc
from .metrics import EngineMetrics
from .profiles import EmulatorProfile
from .requests import KvMode, Output, Request
from .scheduler import blocks_for
from .side_channel import Client, PullRead, PushCancel, PushRegistration, PushWritten, SideChannelError

log = logging.getLogger("disagg.emulator")
CANCEL_GRACE_S = 10.0
"""A cancelled push decode frees its blocks this long past its deadline without its prefill's answer (the
plugin's DEADLINE_GRACE)."""
LEASE_SWEEP_S = 1.0


@dataclass
class _Held:
    """A finished P/D prefill leg's blocks, kept for its decode."""

    request: Request
    until: float  # monotonic: the lease
    writing: asyncio.Task[None] | None = None


class KvHandoff:
    """The engine's handoff bookkeeping; the engine's state it uses is declared here, and set by the engine."""

    profile: EmulatorProfile
    kv_mode: KvMode
    engine_id: str
    host: str
    port: int
    metrics: EngineMetrics
    peers: Client
    registration_timeout: float
    lease_seconds: float
    waiting: deque[Request]
    awaiting_kv: dict[str, Request]
    held: dict[str, _Held]
    registrations: dict[str, PushRegistration]
    cancelled: dict[str, float]
    _wake: asyncio.Event

    def _release(self, req: Request) -> None:
        raise NotImplementedError

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        raise NotImplementedError

    def _publish(self, events: list[pc.Event]) -> None:
        raise NotImplementedError

    def _store_full_blocks(self, req: Request) -> list[pc.Event]:
        raise NotImplementedError

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
        # At the queue's head: it holds its blocks already, and vLLM keeps a request waiting for its KV in the
        # waiting queue ahead of later arrivals. Behind a request that does not fit, which stops admission, it would
        # wait for blocks that only its own progress frees: the decode would stall until its timeout.
        self.waiting.appendleft(req)
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
