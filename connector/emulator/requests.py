"""A request in the emulated engine: its tokens, its KV blocks, where its KV comes from or goes, and what it
tells its HTTP handler (`Output`s on its queue). State only; the engine and the handoff change it."""
from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

from ..wire.advertisement import KvMode as KvMode  # the one definition: the wire contract's
from . import prefix_cache as pc
from .scheduler import Phase


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
