"""Prefix-aware routing on real vLLM engines (issue 36, item 6): a push pair publishing KV events as the operator
renders them (`--kv-events-config`, `--enable-prompt-tokens-details`) and a `--policy prefix-aware` router.

- Tokenizer parity: the router has an engine tokenize each prompt and keys the index on the events' token ids. A
  request that extends an earlier one's prompt is predicted to hit exactly what the prefill engine then reports
  cached, for completions and for a multi-turn chat. A tokenization that differed from the engine's (another
  tokenizer, a missing template field) would predict 0.
- Decode alone: a prompt decode holds enough of skips prefill, and gives the P/D path's greedy tokens; no prefill
  engine sees it, and decode reports the prompt cached.
- The index follows the engines: a router started after them knows what they hold from each engine's replay,
  blocks an engine evicts leave the index (predicted = reported again after eviction), a cleared prefix cache
  (vLLM's AllBlocksCleared) empties it, and an engine restarted leaves it with its blocks.
Each result counts only with KV events applied, which the router's metrics show."""
from __future__ import annotations

import json
import time
import urllib.request
import uuid

import pytest

from support.engine_pair import Pair
from support.engines import MAX_TOKENS, await_status, metric, polled, post, text_of

pytestmark = pytest.mark.engines
BLOCK = 128  # the engines' block size (EngineSpec's default, as in every engine test)
BLOCKS = 64
"""KV blocks per engine: 8,192 tokens (above a 4,096-token request, as vLLM requires), so that the eviction test
below fills it with a dozen prompts."""


@pytest.fixture(scope="module")
def prefix_pair(vllm_python, model, engine_logs, rendezvous, reference, plugin_dir, tmp_path_factory):
    access_log = tmp_path_factory.mktemp("prefix") / "access.jsonl"
    pair = Pair("push", vllm_python, model, engine_logs, rendezvous, plugin_dir, name="prefix", kv_events=True,
                access_log=access_log, router_args=("--policy", "prefix-aware"), num_blocks=BLOCKS,
                max_model_len=4096, extra_env={"VLLM_SERVER_DEV_MODE": "1"})  # /reset_prefix_cache, a dev endpoint
    try:
        pair.start()
        await_following(pair)
        yield pair
    finally:
        pair.stop()


def await_following(pair: Pair, timeout: float = 60) -> None:
    """Until the router applies events of both engines. A ZMQ subscriber joins its publisher unannounced, and
    what is published before the join is lost until a later frame shows the gap (then the replay fills it): a
    request sent the moment the router starts may leave nothing to see. So requests of their own until it does,
    each given a few seconds to show."""
    url = pair.router.url

    def following() -> bool:
        return metric(url, "disagg_router_kv_frames_total") >= 2 and \
            min(metric(url, "disagg_router_kv_blocks", role=r) for r in ("prefill", "decode")) > 0

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, resp = post(url + "/v1/completions", completion(text(2 * BLOCK + 10)))
        assert status == 200, resp
        if polled(following, 3):
            return
    raise TimeoutError(f"the router applied no KV events of both engines in {timeout} s")


def last_record(pair: Pair) -> dict:
    assert pair.access_log is not None
    return json.loads(pair.access_log.read_text().splitlines()[-1])


def await_indexed(router_url: str, stored_before: float, blocks: int, timeout: float = 30) -> None:
    """Until the router has stored `blocks` more blocks from the engines' events (they arrive on their own)."""
    if not polled(lambda: metric(router_url, "disagg_router_kv_blocks_stored_total") >= stored_before + blocks,
                  timeout):
        with urllib.request.urlopen(router_url + "/metrics", timeout=5) as r:
            kv = [line for line in r.read().decode().splitlines() if line.startswith("disagg_router_kv_")]
        raise TimeoutError(f"the router stored fewer than {blocks} more blocks in {timeout} s: {kv}")


def text(n: int) -> str:
    """About `n` tokens (the tiny model's tokenizer takes a byte at a time), starting with what no earlier request
    sent, so nothing of it is cached anywhere yet."""
    head = f"[{uuid.uuid4().hex}] "
    body = "Disaggregated serving splits prefill and decode across engines. "
    return (head + body * (n // len(body) + 1))[:n]


def completion(prompt: str) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}


def test_a_prompt_extending_an_earlier_one_is_predicted_to_hit_what_the_engine_reports(prefix_pair):
    url = prefix_pair.router.url
    first = text(4 * BLOCK + 40)
    stored = metric(url, "disagg_router_kv_blocks_stored_total")
    status, resp = post(url + "/v1/completions", completion(first))
    assert status == 200, resp
    tokens = resp["usage"]["prompt_tokens"]
    await_indexed(url, stored, 2 * (tokens // BLOCK))  # the prompt's full blocks, on prefill and on decode

    status, resp = post(url + "/v1/completions", completion(first + text(6 * BLOCK)))
    assert status == 200, resp
    record = last_record(prefix_pair)
    held = tokens // BLOCK * BLOCK
    assert record["prefix"]["predicted"] == {"prefill": held, "decode": held} and not record["prefix"]["decode_only"]
    assert record["prefix"]["actual"] == held  # the prefill engine's own count of its prefix-cache hit
    assert metric(url, "disagg_router_kv_events_applied_total") > 0


def test_a_multi_turn_chat_is_predicted_to_hit_its_earlier_turns(prefix_pair):
    url = prefix_pair.router.url
    turn = [{"role": "system", "content": text(3 * BLOCK)}, {"role": "user", "content": "Say something."}]
    body = {"model": "tiny", "messages": turn, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    stored = metric(url, "disagg_router_kv_blocks_stored_total")
    status, resp = post(url + "/v1/chat/completions", body)
    assert status == 200, resp
    first_tokens = resp["usage"]["prompt_tokens"]
    await_indexed(url, stored, 2 * (first_tokens // BLOCK))

    conversation = [*turn, {"role": "assistant", "content": text_of(resp)},
                    {"role": "user", "content": text(4 * BLOCK)}]
    status, resp = post(url + "/v1/chat/completions", {**body, "messages": conversation})
    assert status == 200, resp
    record = last_record(prefix_pair)
    predicted = record["prefix"]["predicted"]["prefill"]
    # The earlier turn's full blocks, up to where the rendered template first differs (the generation prompt).
    assert predicted >= (first_tokens // BLOCK - 1) * BLOCK > 0
    assert record["prefix"]["actual"] == predicted


def test_a_prompt_decode_holds_skips_prefill_and_gives_the_p_d_paths_tokens(prefix_pair):
    p, d, url = prefix_pair.prefill, prefix_pair.decode, prefix_pair.router.url
    prompt = text(8 * BLOCK + 60)  # 8 of its 8.5 blocks held after it ran once: above the 0.9 share
    stored = metric(url, "disagg_router_kv_blocks_stored_total")
    status, pd_resp = post(url + "/v1/completions", completion(prompt))
    assert status == 200, pd_resp
    assert last_record(prefix_pair)["prefill"] == p.spec.engine_id
    tokens = pd_resp["usage"]["prompt_tokens"]
    await_indexed(url, stored, 2 * (tokens // BLOCK))

    prefill_requests = metric(p.url, "vllm:request_success_total")
    computed = metric(d.url, "vllm:prompt_tokens_by_source_total", source="local_compute")
    status, alone = post(url + "/v1/completions", completion(prompt))
    assert status == 200, alone
    record = last_record(prefix_pair)
    assert record["prefix"]["decode_only"] and record["prefill"] is None and record["decode"] == d.spec.engine_id
    assert text_of(alone) == text_of(pd_resp)
    assert metric(p.url, "vllm:request_success_total") == prefill_requests  # no prefill leg
    held = tokens // BLOCK * BLOCK
    assert record["prefix"]["predicted"]["decode"] == held
    assert alone["usage"]["prompt_tokens_details"]["cached_tokens"] == record["prefix"]["actual"] >= held - BLOCK
    # Decode computed only what it did not hold: the rest of the prompt, never the whole.
    assert 0 < metric(d.url, "vllm:prompt_tokens_by_source_total", source="local_compute") - computed <= \
        tokens - record["prefix"]["actual"]
    assert metric(url, "disagg_router_decode_only_total") == 1


def test_a_router_started_after_its_engines_knows_what_they_hold_from_their_replays(prefix_pair):
    """A second router, started once the engines have served a prompt, catches up on each engine's replay as it
    subscribes: it holds the prompt's blocks before any live event reaches it, with nothing reset."""
    url = prefix_pair.router.url
    prompt = text(3 * BLOCK + 20)
    stored = metric(url, "disagg_router_kv_blocks_stored_total")
    status, resp = post(url + "/v1/completions", completion(prompt))
    assert status == 200, resp
    await_indexed(url, stored, 2 * 3)  # both engines hold its 3 full blocks

    late = prefix_pair.start_router("prefix-late-router", "push").url

    def caught_up() -> bool:
        return all(metric(late, "disagg_router_kv_engines", role=r) == 1 for r in ("prefill", "decode")) and \
            metric(late, "disagg_router_kv_engines_catching_up") == 0

    assert polled(caught_up, 30), "the late router did not subscribe to both engines and catch up"
    assert metric(late, "disagg_router_kv_frames_total") == 0  # nothing live yet: all of it from the replays
    assert min(metric(late, "disagg_router_kv_blocks", role=r) for r in ("prefill", "decode")) >= 3
    assert metric(late, "disagg_router_kv_resets_total") == 0
    # Its prediction for the prompt is what the engine that computes it then reports cached (decode, alone: it
    # holds 3 of the prompt's 3.2 blocks, above the 0.9 share).
    status, again = post(late + "/v1/completions", completion(prompt))
    assert status == 200, again
    record = last_record(prefix_pair)
    leg = "decode" if record["prefix"]["decode_only"] else "prefill"
    assert record["prefix"]["predicted"][leg] == 3 * BLOCK == record["prefix"]["actual"]


def test_blocks_an_engine_evicts_leave_the_index(prefix_pair):
    url = prefix_pair.router.url
    first = text(5 * BLOCK + 20)
    removed = metric(url, "disagg_router_kv_blocks_removed_total")
    for prompt in [first] + [text(5 * BLOCK + 20) for _ in range(BLOCKS // 5 + 2)]:  # more blocks than it has
        status, resp = post(url + "/v1/completions", completion(prompt))
        assert status == 200, resp
    # One more prompt, and its blocks in the index: each engine's events apply in order, so everything before them
    # (the evictions above) has applied too.
    stored = metric(url, "disagg_router_kv_blocks_stored_total")
    status, resp = post(url + "/v1/completions", completion(text(2 * BLOCK + 20)))
    assert status == 200, resp
    await_indexed(url, stored, 2 * 2)
    assert metric(url, "disagg_router_kv_blocks_removed_total") > removed
    # The first prompt's blocks were the least recently used: what the index predicts for it now is what the
    # prefill engine then reports, whatever eviction left of it.
    status, resp = post(url + "/v1/completions", completion(first + text(5 * BLOCK)))
    assert status == 200, resp
    record = last_record(prefix_pair)
    assert record["prefix"]["predicted"]["prefill"] == record["prefix"]["actual"] < 5 * BLOCK


def post_ok(url: str, body: dict) -> dict:
    status, resp = post(url, body)
    assert status == 200, resp
    return resp


def test_a_cleared_prefix_cache_empties_the_index(prefix_pair):
    """vLLM's /reset_prefix_cache publishes AllBlocksCleared: the router drops everything it held for that engine,
    so a prompt it had cached is predicted to hit nothing, as the engine then reports."""
    p, d, url = prefix_pair.prefill, prefix_pair.decode, prefix_pair.router.url
    first = text(4 * BLOCK + 40)
    stored = metric(url, "disagg_router_kv_blocks_stored_total")
    tokens = post_ok(url + "/v1/completions", completion(first))["usage"]["prompt_tokens"]
    await_indexed(url, stored, 2 * (tokens // BLOCK))
    clears = metric(url, "disagg_router_kv_clears_total")
    for engine in (p, d):
        req = urllib.request.Request(engine.url + "/reset_prefix_cache", method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200
    # vLLM publishes an engine's events with its next step: a prompt shorter than a block makes one on both
    # engines and stores nothing.
    post_ok(url + "/v1/completions", completion(text(BLOCK // 2)))
    assert polled(lambda: metric(url, "disagg_router_kv_clears_total") >= clears + 2, 30), "no AllBlocksCleared"
    assert all(metric(url, "disagg_router_kv_blocks", role=role) == 0 for role in ("prefill", "decode"))
    post_ok(url + "/v1/completions", completion(first + text(2 * BLOCK)))
    record = last_record(prefix_pair)
    assert record["prefix"]["predicted"] == {"prefill": 0, "decode": 0}
    assert record["prefix"]["actual"] == 0


def test_an_engine_restarted_leaves_the_index_with_its_blocks(prefix_pair):
    """A restarted prefill is a new engine (a new id, an empty cache): the router drops the old one's blocks with
    its subscription and follows the new one's events from its first."""
    p, url = prefix_pair.prefill, prefix_pair.router.url
    first = text(4 * BLOCK + 40)
    stored = metric(url, "disagg_router_kv_blocks_stored_total")
    tokens = post_ok(url + "/v1/completions", completion(first))["usage"]["prompt_tokens"]
    await_indexed(url, stored, 2 * (tokens // BLOCK))
    old, stopped = p.spec.engine_id, metric(url, "disagg_router_kv_subscription_changes_total", change="stop")
    p.stop()
    p.start().wait_ready()
    assert p.spec.engine_id != old
    assert polled(lambda: metric(url, "disagg_router_kv_subscription_changes_total", change="stop") > stopped, 60)
    await_status(url + "/health", timeout=60)  # the router pairs the new prefill (its /health is 200 once it can)
    await_following(prefix_pair)
    second = first + text(2 * BLOCK)
    indexed = metric(url, "disagg_router_kv_blocks", role="prefill")
    tokens = post_ok(url + "/v1/completions", completion(second))["usage"]["prompt_tokens"]
    record = last_record(prefix_pair)
    assert record["prefill"] == p.spec.engine_id
    assert record["prefix"]["predicted"]["prefill"] == 0 == record["prefix"]["actual"]
    # And the new engine's blocks are followed: the same prompt again is predicted to hit what it now holds.
    assert polled(lambda: metric(url, "disagg_router_kv_blocks", role="prefill") >= indexed + tokens // BLOCK, 30)
    post_ok(url + "/v1/completions", completion(second + text(BLOCK)))
    record = last_record(prefix_pair)
    assert record["prefix"]["predicted"]["prefill"] == record["prefix"]["actual"] > 0
