"""A router with `--policy prefix-aware` indexes what its engines hold (issue 36, items 2 and 5): in front of a
prefill and a decode engine emulator (tests/support/emulators.py: real HTTP, real side channel, and KV events
published in vLLM's format on real ZMQ sockets), one request through the pair leaves blocks in the router's index
for each engine that served it, the router's metrics say so, and a withdrawn engine's blocks are gone at the next
round. Routing by the index is tests/unit/test_router_prefix_routing.py's."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import re

import aiohttp
import pytest

from disagg.connector.emulator.main import advertisement
from disagg.connector.router import flags, kv_index
from disagg.connector.router.app import DECODE_HEADER, PREFILL_HEADER, Router, Settings, build
from disagg.connector.router.engine_pool import EnginePool
from disagg.connector.router.kv_scoring import Weights
from support.emulators import emulated_pair, pd_request
from support.metrics import samples as scrape
from support.stub_engines import serving

BS = 16
PROMPT = list(range(1, 101))  # token ids: 6 full blocks of 16, and 4 tokens the index never keys
EARLY = list(range(200, 232))  # 2 blocks, served before the router started
WAIT = 10.0


@pytest.mark.timeout(30)
async def test_a_prefix_aware_router_indexes_what_its_engines_served_and_drops_a_withdrawn_engine():
    async with emulated_pair("push", "--block-size", str(BS)) as pair:
        prefill, decode = (advertisement(e.ident, e.side_port, e.publisher) for e in (pair.prefill, pair.decode))
        engines = [prefill, decode]
        assert prefill.kv_events_endpoints and decode.kv_events_replay_endpoints
        async with aiohttp.ClientSession() as s:  # before the router: its subscriptions join late, as vLLM's allow
            early = await pd_request(s, pair, "completions", {"model": "tiny", "prompt": EARLY, "max_tokens": 2})
            assert early["decode"]["status"] == 200
        # Never decode alone: this test is about what the index holds after both legs ran.
        router = Router(EnginePool("push", lambda: engines), Settings(mode="push", policy="prefix-aware",
                                                                      prefix_weights=Weights(decode_only_share=2.0)))
        kv = router.kv
        assert kv is not None
        index = kv.index
        async with serving(router.app()) as url, aiohttp.ClientSession() as s:
            await kv.sync()
            assert set(index.engines()) == {prefill.engine_id, decode.engine_id}
            for e in engines:  # each subscription first catches up on what its engine published before
                sub = kv.subscription(e.engine_id)
                assert sub is not None
                async with asyncio.timeout(WAIT):
                    await sub.wait_for(lambda sub=sub: sub.synced)
            # What was stored before the router subscribed, known from each engine's replay before any new event.
            assert [index.matched_tokens(e.engine_id, EARLY) for e in engines] == [2 * BS, 2 * BS]
            assert kv.counters().frames == 0 and kv.catching_up() == 0

            async def both_hold() -> None:
                for e in engines:
                    sub = kv.subscription(e.engine_id)
                    assert sub is not None
                    await sub.wait_for(lambda e=e: index.matched_tokens(e.engine_id, PROMPT) > 0)

            # A SUB joins a PUB unannounced: events published before it did are lost until a later frame shows the
            # gap, which the replay then fills. So one request, and another only if none of the first one's frames
            # came through.
            served = []
            async with asyncio.timeout(WAIT):
                while True:
                    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}
                    async with s.post(url + "/v1/completions", json=body) as r:
                        assert r.status == 200, await r.text()
                        served.append((r.headers[PREFILL_HEADER], r.headers[DECODE_HEADER]))
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(1.0):
                            await both_hold()
                            break
            assert set(served) == {(prefill.engine_id, decode.engine_id)} and len(served) <= 2
            # The prompt's 6 full blocks, exactly: the index holds what the engines stored, not more.
            assert index.matched_tokens(prefill.engine_id, PROMPT) == 6 * BS
            assert index.matched_tokens(decode.engine_id, PROMPT) == 6 * BS
            assert index.matched_tokens(prefill.engine_id, [0, *PROMPT]) == 0
            assert [index.matched_tokens(e.engine_id, EARLY) for e in engines] == [2 * BS, 2 * BS]

            m = await scrape(s, url)
            assert m[("disagg_router_kv_events_applied_total", ())] > 0
            assert m[("disagg_router_kv_blocks", (("role", "prefill"),))] >= 6
            assert m[("disagg_router_kv_blocks", (("role", "decode"),))] >= 6
            assert m[("disagg_router_kv_engines", (("role", "prefill"),))] == 1
            assert m[("disagg_router_kv_engines", (("role", "decode"),))] == 1
            assert m[("disagg_router_kv_index_bound_bytes", ())] == index.index_bound_bytes
            assert m[("disagg_router_kv_resets_total", ())] == 0
            assert m[("disagg_router_kv_engines_catching_up", ())] == 0
            # Frames lost while a SUB joined are gaps, and the replay fills every one.
            assert m[("disagg_router_kv_replays_total", (("outcome", "filled"),))] == \
                m[("disagg_router_kv_gaps_total", ())]
            assert m[("disagg_router_kv_replays_total", (("outcome", "unfilled"),))] == 0

            engines.remove(decode)  # the decode leaves the rendezvous
            await kv.sync()
            assert decode.engine_id not in index and index.blocks_held(decode.engine_id) == 0
            assert index.matched_tokens(prefill.engine_id, PROMPT) == 6 * BS
            m = await scrape(s, url)
            assert m[("disagg_router_kv_blocks", (("role", "decode"),))] == 0
            assert m[("disagg_router_kv_engines", (("role", "decode"),))] == 0
            assert m[("disagg_router_kv_subscription_changes_total", (("change", "stop"),))] == 1
            assert m[("disagg_router_kv_events_applied_total", ())] > 0  # counters never go back
        assert not index.engines()  # the router's stop ended every subscription


async def test_a_least_loaded_router_subscribes_to_nothing_and_exports_no_kv_metrics():
    async with emulated_pair("push", "--block-size", str(BS)) as pair:
        engines = [advertisement(e.ident, e.side_port, e.publisher) for e in (pair.prefill, pair.decode)]
        router = Router(EnginePool("push", lambda: engines), Settings(mode="push"))
        assert router.kv is None
        async with serving(router.app()) as url, aiohttp.ClientSession() as s:
            m = await scrape(s, url)
        assert not [name for name, _ in m if name.startswith("disagg_router_kv_")]


def test_the_flags_size_the_index_and_state_its_bound(tmp_path):
    p = argparse.ArgumentParser()
    flags.add_arguments(p)
    args = p.parse_args(["--engines-file", "x.yaml"])
    assert (args.policy, args.kv_index_max_engines, args.kv_index_max_blocks_per_engine) == \
        ("least-loaded", kv_index.DEFAULT_MAX_ENGINES, kv_index.DEFAULT_MAX_BLOCKS_PER_ENGINE)
    # A router's RSS is about 50 MiB: the default bound keeps the index within a few times that.
    assert kv_index.KvIndex().index_bound_bytes <= 256 << 20
    args = p.parse_args(["--engines-file", "x.yaml", "--policy", "prefix-aware", "--kv-index-max-engines", "4",
                         "--kv-index-max-blocks-per-engine", "1000"])
    assert (args.policy, args.kv_index_max_engines, args.kv_index_max_blocks_per_engine) == ("prefix-aware", 4, 1000)
    (tmp_path / "engines.yaml").write_text("engines: []\n")
    router, _ = build(p.parse_args(["--engines-file", str(tmp_path / "engines.yaml"), "--policy", "prefix-aware",
                                    "--kv-index-max-engines", "4", "--kv-index-max-blocks-per-engine", "1000"]))
    assert router.kv is not None and router.kv.index.index_bound_bytes == 4 * 1000 * kv_index.BYTES_PER_BLOCK
    router, _ = build(p.parse_args(["--engines-file", str(tmp_path / "engines.yaml")]))
    assert router.kv is None
    for bad in (["--kv-index-max-engines", "0"], ["--policy", "random"]):
        with pytest.raises(SystemExit):
            p.parse_args(["--engines-file", "x.yaml", *bad])
    assert f"{kv_index.BYTES_PER_BLOCK} bytes" in re.sub(r"\s+", " ", p.format_help())
