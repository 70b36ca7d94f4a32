"""How prefix-aware routing weighs what an engine already holds against how busy it is. Pure: no sockets, no
clocks; the router builds a `Preference` per request and pairing (`EnginePool.place`) sorts by its costs.

Cost. A request's cost on an engine is the work ahead of it there plus the part of its own prompt the engine would
bring in itself, in units of this request's prompt:

    prefill: legs in flight of unknown size + their uncached prompt tokens / prompt tokens + prefill weight x miss
    decode:  legs in flight + decode weight x miss

where miss = 1 - cached tokens / prompt tokens. A prefill leg routed by the index carries the prompt tokens its
engine computes (`EnginePool.queued_tokens`): a queue of requests that mostly hit costs little, which counting
requests would not see (an engine holding a shared prefix with one such request in flight beats an idle engine
that holds nothing). A leg of unknown size (routed without a preference) counts as a prompt like this one. Decode's
work per leg is generation, about the same whatever the prompt, so decode counts legs. In push mode decode
registers and receives only the blocks it lacks (pull mode: it reads only those), so a decode hit saves transfer,
not compute: `decode_weight` is smaller by default. Weights of 0 and no legs of known size are least-loaded
routing, exactly (ties then break on engine id, as there).

Decode alone. When the chosen decode engine already holds at least `decode_only_share` of the prompt, the request
skips prefill: decode computes the rest itself, and nothing crosses the wire. Above 1, never.

Predictions come from the router's index (kv_index.py), which errs by missing blocks, never by inventing them: a
prediction can only undercount, so a wrong one costs a miss, never a wrong token (each engine computes whatever it
does not hold).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..wire.advertisement import EngineAdvertisement

DEFAULT_PREFILL_WEIGHT = 1.0
DEFAULT_DECODE_WEIGHT = 0.5
DEFAULT_DECODE_ONLY_SHARE = 0.9
"""At 90% or more of the prompt cached on decode, decode computes at most a tenth of the prompt itself: less than
a prefill leg, its handoff and the transfer of those blocks cost, for any prompt long enough for a hit to matter."""


@dataclass(frozen=True)
class Weights:
    prefill: float = DEFAULT_PREFILL_WEIGHT
    decode: float = DEFAULT_DECODE_WEIGHT
    decode_only_share: float = DEFAULT_DECODE_ONLY_SHARE

    def __post_init__(self) -> None:
        if self.prefill < 0 or self.decode < 0:
            raise ValueError("prefix weights are at least 0")
        if self.decode_only_share <= 0:
            raise ValueError("the decode-only share is above 0 (above 1: never)")


class Preference:
    """One request's predicted cached tokens per engine, each looked up once, and what they weigh.

    `cached(engine_id)` is the index's prediction (tokens of the longest contiguous prefix held, in whole blocks).
    Invariants: 0 <= `uncached` <= prompt tokens; `cost` is at most the engine's legs in flight plus the role's
    weight; with a prompt of no tokens it is the legs in flight alone."""

    def __init__(self, prompt_tokens: int, cached: Callable[[str], int], weights: Weights,
                 prompt: object = None) -> None:
        """`prompt`: the caller's handle on the prompt (its block keys), kept for it, opaque here."""
        self.prompt_tokens, self.weights, self.prompt = prompt_tokens, weights, prompt
        self._lookup = cached
        self._cached: dict[str, int] = {}

    def cached(self, engine_id: str) -> int:
        if (n := self._cached.get(engine_id)) is None:
            n = self._cached[engine_id] = min(self._lookup(engine_id), self.prompt_tokens)
        return n

    def share(self, engine_id: str) -> float:
        return self.cached(engine_id) / self.prompt_tokens if self.prompt_tokens > 0 else 0.0

    def uncached(self, engine_id: str) -> int:
        """Prompt tokens the engine would compute itself."""
        return self.prompt_tokens - self.cached(engine_id)

    def cost(self, engine: EngineAdvertisement, load: int, queued: tuple[int, int] = (0, 0)) -> float:
        """`load`: the engine's legs in flight; `queued`: how many of them carry their uncached prompt tokens, and
        those tokens (prefill legs routed by the index)."""
        if self.prompt_tokens <= 0:
            return float(load)
        if engine.role != "prefill":
            return load + self.weights.decode * (1.0 - self.share(engine.engine_id))
        legs, tokens = queued
        ahead = (load - legs) + tokens / self.prompt_tokens
        return ahead + self.weights.prefill * (1.0 - self.share(engine.engine_id))

    def decode_only(self, decode_id: str) -> bool:
        """Whether decode already holds enough of the prompt to compute the rest alone."""
        return self.prompt_tokens > 0 and self.share(decode_id) >= self.weights.decode_only_share
