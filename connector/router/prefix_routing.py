"""Prefix-aware routing's per-request work: the prompt's token ids from an engine (prompt_tokens.py), then a
`Preference` (kv_scoring.py) over the router's KV index (kv_index.py), or, for an engine whose events the index
does not follow, over what the router sent it lately (kv_recent.py), and the metrics of all that.

A request that cannot be tokenized (no single prompt, no engine answering /tokenize in time, an answer that is not
token ids) gets no preference and is routed least-loaded, as with the policy off: prefix-awareness may make a
request faster, never fail it.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Histogram

from ..wire.advertisement import EngineAdvertisement
from . import prompt_tokens
from .engine_pool import EnginePool
from .kv_index import KvIndex, PromptKeys
from .kv_recent import RecentChoices
from .kv_scoring import Preference, Weights
from .pd_protocol import Endpoint

log = logging.getLogger("disagg.router.prefix")
TOKENIZE_TIMEOUT = 2.0
"""Seconds a request waits for its tokens before it goes least-loaded instead."""
_TIMEOUT = aiohttp.ClientTimeout(total=TOKENIZE_TIMEOUT)
_TOKENIZE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 2)


class PrefixMetrics:
    def __init__(self, r: CollectorRegistry) -> None:
        self.requests = Counter("disagg_router_prefix_requests_total", "Requests seen by prefix-aware routing, by "
                                "outcome: routed by the index (preferred), no single prompt to match (no_prompt), "
                                "or tokenizing failed (tokenize_failed); the last two go least-loaded",
                                ["outcome"], registry=r)
        self.tokenize = Histogram("disagg_router_prefix_tokenize_seconds", "A request's /tokenize round trip to an "
                                  "engine", buckets=_TOKENIZE_BUCKETS, registry=r)
        self.prompt_tokens = Counter("disagg_router_prefix_prompt_tokens_total", "Prompt tokens of the requests "
                                     "routed by the index", registry=r)
        self.predicted = Counter("disagg_router_prefix_predicted_cached_tokens_total", "Prompt tokens the index "
                                 "predicted the chosen engine holds, per role", ["role"], registry=r)
        self.actual = Counter("disagg_router_prefix_actual_cached_tokens_total", "Prompt tokens the engine that "
                              "computed the prompt reported cached (usage.prompt_tokens_details.cached_tokens), "
                              "when it reported them, with the prediction for the same requests",
                              ["kind"], registry=r)
        self.decode_only = Counter("disagg_router_decode_only_total", "Requests sent to decode alone: it held at "
                                   "least --decode-only-share of the prompt", registry=r)


class PrefixRouting:
    def __init__(self, pool: EnginePool, index: KvIndex, weights: Weights, registry: CollectorRegistry,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pool, self.index, self.weights, self.clock = pool, index, weights, clock
        self.recent = RecentChoices()
        self.m = PrefixMetrics(registry)

    async def preference(self, session: aiohttp.ClientSession, endpoint: Endpoint, body: dict[str, Any],
                         request_id: str) -> Preference | None:
        ask = prompt_tokens.tokenize_body(endpoint, body)
        if ask is None:
            self.m.requests.labels(outcome="no_prompt").inc()
            return None
        tokens = ask if isinstance(ask, list) else await self._tokenize(session, ask, request_id)
        if tokens is None:
            self.m.requests.labels(outcome="tokenize_failed").inc()
            return None
        try:
            keys = PromptKeys(tokens)
        except ValueError:
            self.m.requests.labels(outcome="no_prompt").inc()
            return None
        self.m.requests.labels(outcome="preferred").inc()
        self.m.prompt_tokens.inc(len(tokens))
        return Preference(len(tokens), lambda engine_id: self._held(engine_id, keys), self.weights, prompt=keys)

    def chosen(self, prefer: Preference, prefill: EngineAdvertisement | None, decode: EngineAdvertisement) -> None:
        """The engines a request went to (`prefill` None: decode alone). Those whose events the index does not
        follow remember the prompt (kv_recent.py)."""
        if prefill is not None:
            self.m.predicted.labels(role="prefill").inc(prefer.cached(prefill.engine_id))
        self.m.predicted.labels(role="decode").inc(prefer.cached(decode.engine_id))
        if prefill is None:
            self.m.decode_only.inc()
        assert isinstance(prefer.prompt, PromptKeys)
        now = self.clock()
        for engine in (prefill, decode):
            if engine is not None and not self._indexed(engine.engine_id):
                self.recent.record(engine.engine_id, engine.block_size, prefer.prompt, now)

    def reported(self, predicted: int, actual: int) -> None:
        """What the engine that computed the prompt said it had cached, against what the index predicted."""
        self.m.actual.labels(kind="actual").inc(actual)
        self.m.actual.labels(kind="predicted").inc(predicted)

    def _held(self, engine_id: str, keys: PromptKeys) -> int:
        """The index's prediction for an engine: under its id, or, for an engine of several data-parallel ranks
        (kv_follow.stream_key), the best of its ranks (vLLM places the request on one of them itself); for an engine
        the index does not follow, what this router sent it lately (kv_recent.py)."""
        if engine_id in self.index:
            return self.index.matched_tokens(engine_id, keys)
        ranks = self._ranks(engine_id)
        if ranks:
            return max(self.index.matched_tokens(k, keys) for k in ranks)
        # Only engines the index does not follow get here: their block size, from the pool, only then.
        block_size = next((e.block_size for e in self.pool.engines() if e.engine_id == engine_id), None)
        return 0 if block_size is None else self.recent.matched_tokens(engine_id, block_size, keys, self.clock())

    def _ranks(self, engine_id: str) -> list[str]:
        prefix = engine_id + "/dp"
        return [k for k in self.index.engines() if k.startswith(prefix)]

    def _indexed(self, engine_id: str) -> bool:
        return engine_id in self.index or bool(self._ranks(engine_id))

    async def _tokenize(self, session: aiohttp.ClientSession, ask: dict[str, Any],
                        request_id: str) -> list[int] | None:
        body = prompt_tokens.question(ask)
        for engine in self._tokenizers():
            t0 = time.perf_counter()
            try:
                async with session.post(f"{engine.http_url}/tokenize", data=body,
                                        headers={"X-Request-Id": f"tokenize-{request_id}",
                                                 "Content-Type": "application/json"},
                                        timeout=_TIMEOUT) as r:
                    answer = await r.read() if r.status == 200 else None
            except (TimeoutError, aiohttp.ClientError) as e:
                log.info("tokenizing on %s failed: %s", engine.engine_id, type(e).__name__)
                continue
            self.m.tokenize.observe(time.perf_counter() - t0)
            # A 4xx is the request's own fault (the engines will refuse it too): no other engine will do better.
            return None if answer is None else prompt_tokens.token_ids(answer)
        return None

    def _tokenizers(self) -> Sequence[EngineAdvertisement]:
        """At most two engines to ask (the second when the first does not answer), decodes then prefills, each
        least loaded first."""
        load = self.pool.outstanding
        by_load = sorted(self.pool.healthy("decode"), key=lambda e: (load.get(e.engine_id, 0), e.engine_id)) + \
            sorted(self.pool.healthy("prefill"), key=lambda e: (load.get(e.engine_id, 0), e.engine_id))
        return by_load[:2]
