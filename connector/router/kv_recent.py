"""What an engine probably holds when its KV events are not followed: the prompt blocks this router itself sent
it lately. Pure: the caller passes the clock.

Prefix-aware routing predicts from the KV index (kv_index.py) for every engine whose events it follows. An engine
that publishes none (events off in its args, a connector without the plugin), or one the index has no room for,
would otherwise always predict 0 and be routed on load alone. For those the router remembers, per engine, the block
keys (kv_index.PromptKeys: the same token-id chain) of the prompts it sent there, each for `ttl` seconds: an engine
computes and caches a prompt it is sent, and an LRU cache under steady traffic keeps what was used last. Unlike the
index this may overcount (the engine evicted the blocks, or restarted under the same id): a wrong guess costs a
miss, never a wrong token, since each engine computes whatever it does not hold.

Bounds: at most `max_engines` engines (the least recently used engine's memory goes first) of at most
`max_blocks_per_engine` keys each (the oldest go first), 16-byte keys in ordered dicts: about 200 bytes a block.
"""
from __future__ import annotations

from collections import OrderedDict

from .kv_index import BlockKey, PromptKeys

DEFAULT_TTL = 120.0
"""Seconds a block the router sent an engine counts as held: about how long a busy engine's LRU cache keeps what
it computed (a CPU engine's 16,384 tokens turn over in tens of seconds at full load; a GPU's millions in minutes)."""
DEFAULT_MAX_ENGINES = 64
DEFAULT_MAX_BLOCKS_PER_ENGINE = 16_384


class RecentChoices:
    def __init__(self, *, ttl: float = DEFAULT_TTL, max_engines: int = DEFAULT_MAX_ENGINES,
                 max_blocks_per_engine: int = DEFAULT_MAX_BLOCKS_PER_ENGINE) -> None:
        if ttl <= 0 or max_engines < 1 or max_blocks_per_engine < 1:
            raise ValueError("a positive ttl, and room for at least one block of one engine")
        self.ttl, self.max_engines, self.max_blocks_per_engine = ttl, max_engines, max_blocks_per_engine
        self._engines: OrderedDict[str, OrderedDict[BlockKey, float]] = OrderedDict()  # key -> when it expires

    def record(self, engine_id: str, block_size: int, keys: PromptKeys, now: float) -> None:
        """The prompt `keys` was sent to the engine at `now`: its full blocks count as held until now + ttl."""
        blocks = self._engines.get(engine_id)
        if blocks is None:
            blocks = self._engines[engine_id] = OrderedDict()
            while len(self._engines) > self.max_engines:
                self._engines.popitem(last=False)
        self._engines.move_to_end(engine_id)
        expires = now + self.ttl
        i = 0
        while (key := keys.key(block_size, i)) is not None:
            blocks[key] = expires
            blocks.move_to_end(key)
            i += 1
        self._expire(blocks, now)
        while len(blocks) > self.max_blocks_per_engine:
            blocks.popitem(last=False)

    def matched_tokens(self, engine_id: str, block_size: int, keys: PromptKeys, now: float) -> int:
        """Tokens of the longest prefix of the prompt sent to the engine within the ttl, in whole blocks."""
        blocks = self._engines.get(engine_id)
        if not blocks:
            return 0
        n = 0
        while (key := keys.key(block_size, n)) is not None and blocks.get(key, -1.0) > now:
            n += 1
        return n * block_size

    def forget(self, engine_id: str) -> None:
        self._engines.pop(engine_id, None)

    def blocks_held(self) -> int:
        return sum(len(b) for b in self._engines.values())

    @staticmethod
    def _expire(blocks: OrderedDict[BlockKey, float], now: float) -> None:
        """Drop expired keys from the front: keys are kept in the order they were last recorded, and one ttl for
        all makes that the order they expire in."""
        while blocks:
            key, expires = next(iter(blocks.items()))
            if expires > now:
                return
            del blocks[key]
