"""A router with `--policy prefix-aware` routes by what its engines hold (issue 36, items 3 to 5), in front of two
prefill and two decode engine emulators (tests/support/emulators.py: real HTTP, real side channels, KV events in
vLLM's format on real ZMQ sockets):
- a string prompt is tokenized by an engine's /tokenize, and goes to the engines whose KV events say they hold it,
  though least-loaded routing would have sent it elsewhere;
- a prompt decode holds enough of skips prefill: no prefill engine sees it, decode reports the prompt cached, and
  its tokens equal the P/D path's;
- the access log says, per request, what the index predicted and what the engine reported.
Each result counts only with KV events applied (the metrics say how many)."""
from __future__ import annotations

import asyncio
import io
import json

import aiohttp
import pytest

from disagg.connector.emulator.main import advertisement
from disagg.connector.router.access_log import AccessLog
from disagg.connector.router.app import DECODE_HEADER, PREFILL_HEADER, Router, Settings
from disagg.connector.router.engine_pool import EnginePool
from disagg.connector.router.kv_scoring import Weights
from support.emulators import Pair, emulated_pair, http, pd_request
from support.metrics import samples as scrape
from support.stub_engines import serving

BS = 16
WAIT = 10.0


async def settled(router: Router, engine_id: str, tokens: list[int], want: int) -> None:
    """Until the router's index holds `want` tokens of `tokens` for the engine (its events are asynchronous)."""
    assert router.kv is not None
    await router.kv.sync()
    sub = router.kv.subscription(engine_id)
    assert sub is not None
    async with asyncio.timeout(WAIT):
        await sub.wait_for(lambda: router.kv.index.matched_tokens(engine_id, tokens) >= want)


async def prefill_requests(session: aiohttp.ClientSession, emulator_url: str) -> float:
    return sum(v for (name, _), v in (await scrape(session, emulator_url)).items()
               if name == "vllm:request_success_total")


@pytest.mark.timeout(60)
async def test_requests_go_to_the_engines_that_hold_their_prompt_and_a_decode_hit_skips_prefill():
    async with emulated_pair("push", "--block-size", str(BS)) as a, \
            emulated_pair("push", "--block-size", str(BS)) as b:
        emulators = [a.prefill, a.decode, b.prefill, b.decode]
        engines = [advertisement(e.ident, e.side_port, e.publisher) for e in emulators]
        engine_id = {id(e): ad.engine_id for e, ad in zip(emulators, engines, strict=True)}
        # Least-loaded routing breaks ties on engine id: hold the prompt where it would not go.
        prefill, decode = (max((e for e in emulators if e.args.role == role), key=lambda e: engine_id[id(e)])
                           for role in ("prefill", "decode"))
        holder = Pair("push", prefill, decode)
        prefill_id, decode_id = engine_id[id(prefill)], engine_id[id(decode)]
        log = io.StringIO()
        router = Router(EnginePool("push", lambda: engines),
                        Settings(mode="push", policy="prefix-aware", prefix_weights=Weights(decode_only_share=0.9)),
                        access_log=AccessLog(log))
        text = "The quick brown fox jumps over the lazy dog, " * 4  # 180 bytes: 11 blocks of 16 byte tokens
        async with serving(router.app()) as url, aiohttp.ClientSession() as s:
            tokenized = await http(s, "POST", holder.decode_url + "/tokenize", {"model": "tiny", "prompt": text})
            tokens = tokenized["json"]["tokens"]
            full = len(tokens) // BS * BS
            assert full >= 10 * BS
            served = await pd_request(s, holder, "completions", {"model": "tiny", "prompt": text, "max_tokens": 4})
            assert served["decode"]["status"] == 200
            await settled(router, prefill_id, tokens, full)
            await settled(router, decode_id, tokens, full)

            # A longer prompt on the same prefix: decode holds 11 of its 16 blocks (under the decode-only share),
            # so both legs run, on the engines that hold the prefix.
            longer = text + "and then it runs far away into the forest. " * 2
            async with s.post(url + "/v1/completions", json={"model": "tiny", "prompt": longer,
                                                             "max_tokens": 4}) as r:
                assert r.status == 200, await r.text()
                assert (r.headers[PREFILL_HEADER], r.headers[DECODE_HEADER]) == (prefill_id, decode_id)
            line = json.loads(log.getvalue().splitlines()[-1])
            assert line["prefix"]["predicted"] == {"prefill": full, "decode": full}
            assert not line["prefix"]["decode_only"]
            assert line["prefix"]["actual"] == full  # the prefill engine's own report of its hit

            # The prompt decode holds whole: decode alone, no prefill engine sees it.
            before = [await prefill_requests(s, f"http://127.0.0.1:{e.args.port}") for e in (a.prefill, b.prefill)]
            body = {"model": "tiny", "prompt": tokens, "max_tokens": 4, "temperature": 0}
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                assert PREFILL_HEADER not in r.headers and r.headers[DECODE_HEADER] == decode_id
                alone = await r.json()
            after = [await prefill_requests(s, f"http://127.0.0.1:{e.args.port}") for e in (a.prefill, b.prefill)]
            assert after == before
            line = json.loads(log.getvalue().splitlines()[-1])
            assert line["prefill"] is None and line["prefix"]["decode_only"]
            assert line["prefix"]["predicted"] == {"prefill": None, "decode": full}
            assert line["prefix"]["actual"] == alone["usage"]["prompt_tokens_details"]["cached_tokens"] >= full - BS

            # Streamed, with usage asked for: the stream's own usage chunk gives the engine's count.
            streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
            async with s.post(url + "/v1/completions", json=streamed) as r:
                assert r.status == 200 and PREFILL_HEADER not in r.headers
                events = [line for line in (await r.text()).splitlines() if line.startswith("data: {")]
            usage = json.loads(events[-1][6:])["usage"]
            line = json.loads(log.getvalue().splitlines()[-1])
            assert line["prefix"]["decode_only"]
            assert line["prefix"]["actual"] == usage["prompt_tokens_details"]["cached_tokens"] >= full - BS

            # The same request on the P/D path (the engines that do not hold it) gives the same tokens.
            other = Pair("push", *(next(e for e in emulators if e.args.role == role and e not in (prefill, decode))
                                   for role in ("prefill", "decode")))
            pd_answer = await pd_request(s, other, "completions", body)
            assert pd_answer["decode"]["json"]["choices"][0]["text"] == alone["choices"][0]["text"]

            m = await scrape(s, url)
            assert m[("disagg_router_kv_events_applied_total", ())] > 0
            assert m[("disagg_router_prefix_requests_total", (("outcome", "preferred"),))] == 3
            assert m[("disagg_router_decode_only_total", ())] == 2
            assert m[("disagg_router_prefix_tokenize_seconds_count", ())] == 1  # the token-id prompt asked nothing
            assert m[("disagg_router_prefix_predicted_cached_tokens_total", (("role", "decode"),))] == 3 * full


@pytest.mark.timeout(30)
async def test_a_request_no_engine_can_tokenize_is_routed_least_loaded():
    async with emulated_pair("push", "--block-size", str(BS)) as pair:
        engines = [advertisement(e.ident, e.side_port, e.publisher) for e in (pair.prefill, pair.decode)]
        router = Router(EnginePool("push", lambda: engines), Settings(mode="push", policy="prefix-aware"))
        async with serving(router.app()) as url, aiohttp.ClientSession() as s:
            # The emulator refuses an unknown model on /tokenize as on completions: the router asks, gets a 4xx,
            # routes least-loaded, and the engines refuse it there too.
            async with s.post(url + "/v1/completions", json={"model": "nope", "prompt": "hi", "max_tokens": 2}) as r:
                assert r.status != 200 and "does not exist" in await r.text()
            # A token id the index cannot key (beyond 32 bits): no preference; the engines judge it themselves.
            async with s.post(url + "/v1/completions", json={"model": "tiny", "prompt": [1, 1 << 32],
                                                             "max_tokens": 2}) as r:
                assert r.status != 200
            m = await scrape(s, url)
            assert m[("disagg_router_prefix_requests_total", (("outcome", "tokenize_failed"),))] == 1
            assert m[("disagg_router_prefix_requests_total", (("outcome", "no_prompt"),))] == 1
