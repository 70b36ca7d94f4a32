"""Which engines the router may use right now, and how busy each is.

Engines come from the rendezvous (EngineCache) or from a static list. Whether an engine is down is decided by its
health, probed every second (`probe_once`), and by nothing a request saw, with one exception:
- a probe that is refused or reset, or a /health that is not 200: down at once;
- a probe that times out: down only after `slow_strikes` timeouts in a row, so a busy engine on a saturated host is
  not dropped for being slow;
- a good probe: up again. Every round replaces the whole down set.
- Between rounds, a request whose connection to an engine is refused (nothing listens, or no route: not slow,
  gone) takes it out at once (`refused`), until the next round confirms or clears it.
A request that times out, is reset, loses its stream or gets a 5xx proves nothing about the engine: a read timeout
is a slow request (a decode waiting for KV that never comes, a long queue), and a reset mid-stream under load may be
a client abort passed on or an engine dying; the probes tell which within a second. The failed request still avoids
that engine for its own retry (the router's `tried` set).

A request can `watch` the engine it waits on (a prefill, for its answer and for the KV it owes decode): the probes
keep probing a watched engine after it has left the rendezvous (a stopping engine leaves first and drains after),
and the watch completes when a probe finds it dead (refused, reset or not 200), never when it is merely slow.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Set as AbstractSet

import aiohttp

from ..wire.advertisement import EngineAdvertisement
from .kv_scoring import Preference
from .pd_protocol import compatible

log = logging.getLogger("disagg.router.pool")
Pair = tuple[EngineAdvertisement, EngineAdvertisement]
"""A prefill engine and a compatible decode engine."""


class EnginePool:
    def __init__(self, mode: str, source: Callable[[], Iterable[EngineAdvertisement]], *,
                 probe_interval: float = 1.0, probe_timeout: float = 2.0, slow_strikes: int = 3):
        self.mode = mode
        self._source = source
        self.outstanding: dict[str, int] = {}
        """Legs in flight per engine id (connector/router/admission.py says what holds one); absent when none."""
        self.queued_tokens: dict[str, tuple[int, int]] = {}
        """Per prefill engine id, of its legs in flight: how many carry the prompt tokens the engine computes for
        them (legs routed by the index), and those tokens; absent when none."""
        self.down: set[str] = set()
        self.timeouts: dict[str, int] = defaultdict(int)
        self.max_model_len: dict[str, int] = {}  # from each engine's /v1/models, learned by the probes
        self._answered: dict[str, float] = {}  # engine id -> when the last probe it answered 200 was sent
        self.probe_interval, self.probe_timeout, self.slow_strikes = probe_interval, probe_timeout, slow_strikes
        self._watches: dict[str, tuple[EngineAdvertisement, set[asyncio.Future[None]]]] = {}

    def engines(self) -> list[EngineAdvertisement]:
        return [e for e in self._source() if e.kv_mode == self.mode]

    def healthy(self, role: str) -> list[EngineAdvertisement]:
        return [e for e in self.engines() if e.role == role and e.engine_id not in self.down]

    def choose(self, exclude: AbstractSet[str] = frozenset()) -> Pair | None:
        """Least outstanding work first: the decode engine, then a compatible prefill engine; never an engine in
        `exclude` (those a request already failed on)."""
        return self.place(exclude)[0]

    def place(self, exclude: AbstractSet[str] = frozenset(), limit: int | None = None,
              prefer: Preference | None = None) -> tuple[Pair | None, bool]:
        """`choose` among the engines with fewer than `limit` outstanding legs (None: no bound), and whether any
        compatible pair exists at all, room or not: (None, True) is a full deployment, (None, False) one without a
        pair. With `prefer` (prefix-aware routing, kv_scoring.py), engines go by its cost, which adds to their load
        the share of the prompt each would bring in itself; which pairs have room does not depend on it."""
        load = self.outstanding

        def key(e: EngineAdvertisement) -> tuple[float, str]:
            n = load.get(e.engine_id, 0)
            if prefer is None:
                return n, e.engine_id
            return prefer.cost(e, n, self.queued_tokens.get(e.engine_id, (0, 0))), e.engine_id

        prefills = [p for p in self.healthy("prefill") if p.engine_id not in exclude]
        decodes = [d for d in self.healthy("decode") if d.engine_id not in exclude]
        exists = False
        for decode in sorted(decodes, key=key):
            matches = [p for p in prefills if compatible(p, decode)]
            if not matches:
                continue
            exists = True
            if limit is not None:
                if load.get(decode.engine_id, 0) >= limit:
                    if prefer is None:
                        break  # decodes come least loaded first: every later one is full too
                    continue
                matches = [p for p in matches if load.get(p.engine_id, 0) < limit]
                if not matches:
                    continue
            return (min(matches, key=key), decode), True
        return None, exists

    def answered_since(self, engine_id: str, since: float) -> bool:
        """Whether a probe sent after `since` (time.monotonic()) found the engine alive: proof that it outlived
        whatever happened then, which a probe that merely has not failed yet is not."""
        return self._answered.get(engine_id, float("-inf")) > since

    def refused(self, engine_id: str) -> None:
        """A request could not connect to the engine: down until the next probe round decides. The only
        request-level evidence the pool takes (the module docstring says why)."""
        self.down.add(engine_id)
        self._found_dead(engine_id)

    @contextlib.contextmanager
    def watch(self, engine: EngineAdvertisement) -> Iterator[asyncio.Future[None]]:
        """A future that completes once a probe finds `engine` dead, for as long as the block runs. Event loop
        only."""
        gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        _, futures = self._watches.setdefault(engine.engine_id, (engine, set()))
        futures.add(gone)
        try:
            yield gone
        finally:
            futures.discard(gone)
            if not futures:
                self._watches.pop(engine.engine_id, None)

    def _found_dead(self, engine_id: str) -> None:
        _, futures = self._watches.get(engine_id, (None, set()))
        for gone in futures:
            if not gone.done():
                gone.set_result(None)

    async def probe_forever(self, session: aiohttp.ClientSession) -> None:
        while True:
            try:
                await self.probe_once(session)
            except Exception:  # a probe bug must never stop probing for good
                log.exception("engine probe round failed")
            await asyncio.sleep(self.probe_interval)

    async def probe_once(self, session: aiohttp.ClientSession) -> None:
        engines = self.engines()
        known = {e.engine_id for e in engines}
        departed = [e for eid, (e, _) in self._watches.items() if eid not in known]
        sent = time.monotonic()
        results = await asyncio.gather(*(self._probe(session, e) for e in engines + departed))
        down = set()
        for engine, result in zip(engines, results, strict=False):
            eid = engine.engine_id
            self.timeouts[eid] = self.timeouts[eid] + 1 if result == "slow" else 0
            if result == "dead" or self.timeouts[eid] >= self.slow_strikes:
                down.add(eid)
            if result == "ok":
                self._answered[eid] = sent
        self.down = down
        self._answered = {eid: t for eid, t in self._answered.items() if eid in known}
        for engine, result in zip(engines + departed, results, strict=True):
            if result == "dead":
                self._found_dead(engine.engine_id)

    async def _probe(self, session: aiohttp.ClientSession, engine: EngineAdvertisement) -> str:
        try:
            timeout = aiohttp.ClientTimeout(total=self.probe_timeout)
            async with session.get(f"{engine.http_url}/health", timeout=timeout) as r:
                if r.status != 200:
                    return "dead"
            if engine.engine_id not in self.max_model_len:
                async with session.get(f"{engine.http_url}/v1/models", timeout=timeout) as r:
                    if r.status == 200:
                        limit = _max_model_len(await r.read())
                        if limit is not None:
                            self.max_model_len[engine.engine_id] = limit
            return "ok"
        except TimeoutError:
            return "slow"
        except aiohttp.ClientError:
            return "dead"

    def snapshot(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for e in self.engines():
            out[f"{e.role}/{'down' if e.engine_id in self.down else 'up'}"] += 1
        return dict(out)


def _max_model_len(raw: bytes) -> int | None:
    """The first model card's max_model_len from a /v1/models answer; None for anything else (an engine that
    answers oddly stays in rotation, unlimited, and must not fail the probe round of every other engine)."""
    try:
        cards = json.loads(raw).get("data")
        limit = cards[0].get("max_model_len")
    except (ValueError, AttributeError, TypeError, IndexError, KeyError):
        return None
    return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None
