"""The engine emulator puts on the wire what a real vLLM engine does: held to a real push pair's and pull pair's
recorded answers (tests/emulator/vllm_wire/, made by record_vllm_wire.py), request for request. JSON shapes and the
values a router or an autoscaler reads (kv_transfer_params, usage's cached tokens, the prompt's token ids, errors),
SSE events, metric families (type, labels, buckets), and KV event frames, which vLLM's own msgspec classes decode."""
from __future__ import annotations

import asyncio
import base64
import json
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from disagg.connector.wire import emulator as contract
from disagg.connector.wire import kv_events as kv_wire
from disagg.devcluster import vllm_env
from support.emulators import emulated_pair, http, pd_request

WIRE = Path(__file__).resolve().parent / "vllm_wire"
PROMPT = "the emulator must look like this engine " * 8
COMPLETION = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5, "temperature": 0,
        "ignore_eos": True}
STREAM = {"stream": True, "stream_options": {"include_usage": True}}
SEQUENCE = [("completion", "completions", COMPLETION), ("chat", "chat", CHAT),
            ("completion_stream", "completions", {**COMPLETION, **STREAM}),
            ("chat_stream", "chat", {**CHAT, **STREAM}), ("completion_again", "completions", COMPLETION)]
"""The recorded sequence: its repetitions hit the prefix caches."""


def recorded(mode: str) -> dict[str, Any]:
    return json.loads((WIRE / f"{mode}.json").read_text())


def shape(value: Any) -> Any:
    """Keys and value types, recursively: what a client's parser depends on (ids, times and text differ)."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return type(value).__name__


def events(sse: list[str]) -> list[Any]:
    return [json.loads(line[5:]) if line != "data: [DONE]" else "[DONE]" for line in sse]


def usage_of(leg: dict[str, Any]) -> dict[str, Any]:
    if "json" in leg:
        return leg["json"]["usage"]
    return next(e["usage"] for e in events(leg["sse"]) if isinstance(e, dict) and e.get("usage"))


async def run_sequence(mode: str) -> tuple[dict[str, Any], dict[str, str], list[list[bytes]], list[list[bytes]]]:
    """The recorded sequence against an emulated pair; its answers, both engines' /metrics, the prefill's published
    KV event frames and what its replay socket answers."""
    async with emulated_pair(mode) as pair, aiohttp.ClientSession() as session:
        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{pair.prefill.args.kv_events_port}")
        # A subscription takes effect asynchronously: wait until a probe request's events come through.
        frames: list[list[bytes]] = []
        probes = 0
        while not frames:
            probes += 1
            await pd_request(session, pair, "completions", {**COMPLETION, "prompt": f"probe {probes} " * 40})
            if await sub.poll(500):
                frames.append(await sub.recv_multipart())
        out = {name: await pd_request(session, pair, endpoint, body) for name, endpoint, body in SEQUENCE}
        out["plain"] = {
            "models": await http(session, "GET", pair.decode_url + "/v1/models"),
            "health": await http(session, "GET", pair.decode_url + "/health"),
            "tokenize": await http(session, "POST", pair.decode_url + "/tokenize",
                                   {"model": "tiny", "prompt": "hello emulator"}),
            "tokenize_chat": await http(session, "POST", pair.decode_url + "/tokenize",
                                        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}),
            "bad_json": await http(session, "POST", pair.decode_url + "/v1/completions", raw=b"{not json"),
            "too_long": await http(session, "POST", pair.decode_url + "/v1/completions",
                                   {"model": "tiny", "prompt": "x", "max_tokens": 100000}),
            "wrong_model": await http(session, "POST", pair.decode_url + "/v1/completions",
                                      {"model": "nope", "prompt": "x", "max_tokens": 1}),
            "unknown_path": await http(session, "GET", pair.decode_url + "/v1/nothing"),
        }
        while await sub.poll(300):
            frames.append(await sub.recv_multipart())
        sub.close(0)
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{pair.prefill.args.kv_events_replay_port}")
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replay = []
        while await dealer.poll(2000):
            replay.append(await dealer.recv_multipart())
            if replay[-1][-2] == (-1).to_bytes(8, "big", signed=True):
                break
        dealer.close(0)
        ctx.term()
        metrics = {}
        for role, url in (("prefill", pair.prefill_url), ("decode", pair.decode_url)):
            async with session.get(url + "/metrics") as r:
                metrics[role] = await r.text()
        out["probes"] = probes
        return out, metrics, frames, replay


@pytest.fixture(scope="module", params=["push", "pull"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def emulated(mode: str) -> tuple[dict[str, Any], dict[str, str], list[list[bytes]], list[list[bytes]]]:
    return asyncio.run(run_sequence(mode))


def test_answers_have_vllms_shapes_for_both_legs(mode, emulated):
    real, emu = recorded(mode), emulated[0]
    for name, _, _ in SEQUENCE:
        for leg in ("prefill", "decode"):
            r, e = real[name][leg], emu[name][leg]
            assert (e["status"], e["content_type"]) == (r["status"], r["content_type"]), (name, leg)
            if "json" in r:
                want = shape(r["json"])
                got = shape(e["json"])
                # A real prefill's text here is empty where the emulator's is words: both are strings.
                assert got == want, (name, leg)
            else:
                r_events, e_events = events(r["sse"]), events(e["sse"])
                assert len(e_events) == len(r_events), (name, leg)
                for a, b in zip(e_events, r_events, strict=True):
                    assert shape(a) == shape(b), (name, leg, a, b)


def test_kv_transfer_params_and_cached_tokens_are_vllms(mode, emulated):
    """What the router passes on and what a KV-aware router compares its predictions with: prefill's params key for
    key, its blocks and its prefix-cache hit; decode's cached tokens (push reports the received prompt, pull only
    its own hit), request by request through the recorded sequence and its cache hits."""
    real, emu = recorded(mode), emulated[0]
    for name, _, _ in SEQUENCE:
        r_params = real[name]["prefill"]["json"]["kv_transfer_params"]
        e_params = emu[name]["prefill"]["json"]["kv_transfer_params"]
        assert list(e_params) == list(r_params), name
        for key in ("do_remote_prefill", "do_remote_decode", "tp_size", "dcp_size", "pp_size", "remote_num_tokens",
                    "transfer_mode", "remote_prefill_cached_tokens"):
            assert e_params[key] == r_params[key], (name, key)
        assert len(e_params["remote_block_ids"][0]) == len(r_params["remote_block_ids"][0])
        assert e_params["remote_request_id"].startswith(emu[name]["prefill"]["json"]["id"] + "-")
        for leg in ("prefill", "decode"):
            assert usage_of(emu[name][leg]) == usage_of(real[name][leg]), (name, leg)


def test_plain_endpoints_tokenizer_and_errors_are_vllms(mode, emulated):
    real, emu = recorded(mode)["plain"], emulated[0]["plain"]
    for name in ("tokenize", "tokenize_chat"):
        assert emu[name] == real[name], name  # the same token ids: a router tokenizing as the engine does agrees
    assert (emu["health"]["status"], emu["health"].get("text")) == (200, "")
    card, real_card = emu["models"]["json"], real["models"]["json"]
    assert shape(card) == shape(real_card)
    assert card["data"][0]["owned_by"] == contract.OWNER and real_card["data"][0]["owned_by"] == "vllm"
    assert card["data"][0]["max_model_len"] == real_card["data"][0]["max_model_len"]
    for name in ("too_long", "wrong_model", "unknown_path"):
        assert emu[name] == real[name], name
    assert emu["bad_json"]["status"] == 400
    assert {k: v for k, v in emu["bad_json"]["json"]["error"].items() if k != "message"} == \
        {"type": "Bad Request", "param": "body", "code": 400}


def families(text: str) -> dict[str, Any]:
    out = {}
    for fam in text_string_to_metric_families(text):
        samples = [s for s in fam.samples if not s.name.endswith("_created")]
        out[fam.name] = {"type": fam.type, "labels": sorted({k for s in samples for k in s.labels} - {"le"}),
                         "le": sorted({float(s.labels["le"]) for s in samples if "le" in s.labels})}
    return out


def value(text: str, name: str, **labels: str) -> float:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    raise KeyError(name)


def test_every_metric_is_a_vllm_family_and_counts_what_vllm_counts(mode, emulated):
    metrics = emulated[1]
    for role in ("prefill", "decode"):
        real = families((WIRE / f"{mode}_metrics_{role}.txt").read_text())
        emu = families(metrics[role])
        ours = {n for n in emu if n.startswith("vllm:")}
        assert ours >= {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                        "vllm:time_to_first_token_seconds", "vllm:request_time_per_output_token_seconds",
                        "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:prompt_tokens_by_source",
                        "vllm:nixl_xfer_time_seconds"}
        for name in ours:
            assert emu[name] == real[name], (role, name)
        assert value(metrics[role], "disagg_emulator_info", role=role, profile="cpu-kv64k", owner=contract.OWNER) == 1
    # What KvMoved (tests/support/engines.py) proves on real engines holds: decode computed no prompt token of the
    # P/D requests, received the rest, and the engine that drives transfers counted one per request (the probe too).
    decode, driver = metrics["decode"], metrics["prefill" if mode == "push" else "decode"]
    source = "vllm:prompt_tokens_by_source_total"
    assert value(decode, source, source="local_compute") == 0
    assert value(decode, source, source="external_kv_transfer") > 0
    assert value(driver, "vllm:nixl_xfer_time_seconds_count") == len(SEQUENCE) + emulated[0]["probes"]
    # Idle again: nothing running or held (cached blocks are free to evict).
    for role in ("prefill", "decode"):
        assert value(metrics[role], "vllm:num_requests_running") == 0
        assert value(metrics[role], "vllm:kv_cache_usage_perc") == 0


def test_recorded_kv_event_frames_reencode_byte_for_byte():
    """The shared structs (the emulator encodes with them, the router decodes) are vLLM's: a real engine's frames
    decode and encode back to the same bytes."""
    frames = [f for mode in ("push", "pull") for role in ("prefill", "decode")
              for f in recorded(mode)["kv_events"][role]]
    assert frames
    for topic, seq, payload in ([base64.b64decode(x) for x in f] for f in frames):
        batch = kv_wire.decode_batch(payload)
        assert msgspec.msgpack.encode(batch) == payload
        assert topic == b"kv" and len(seq) == 8


VLLM_DECODE = r"""
import importlib.util, json, logging, sys, types
import msgspec

# vllm/distributed/kv_events.py needs only these of vLLM at import; importing vllm itself loads torch (20 s).
for name in ["vllm", "vllm.config", "vllm.config.kv_events", "vllm.logger", "vllm.utils", "vllm.utils.network_utils",
             "vllm.v1", "vllm.v1.core", "vllm.v1.core.kv_cache_utils"]:
    sys.modules[name] = types.ModuleType(name)
sys.modules["vllm.config.kv_events"].KVEventsConfig = object
sys.modules["vllm.logger"].init_logger = logging.getLogger
for fn in ("get_ip", "get_tcp_uri", "is_valid_ipv6_address", "split_zmq_path"):
    setattr(sys.modules["vllm.utils.network_utils"], fn, None)
sys.modules["vllm.v1.core.kv_cache_utils"].ExternalBlockHash = bytes | int
spec = importlib.util.spec_from_file_location("kv_events", sys.argv[1])
kv_events = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kv_events)
decoder = msgspec.msgpack.Decoder(kv_events.KVEventBatch)
out = []
for line in sys.stdin:
    batch = decoder.decode(bytes.fromhex(line.strip()))
    out.append({"rank": batch.data_parallel_rank, "events": [
        {"type": type(e).__name__, **{k: getattr(e, k) for k in e.__struct_fields__ if k != "token_ids"},
         "tokens": len(getattr(e, "token_ids", []) or [])} for e in batch.events]})
print(json.dumps(out))
"""


def decode_with_vllm(payloads: list[bytes]) -> list[dict[str, Any]]:
    python = vllm_env.ensure(quiet=True)
    origin = subprocess.run([str(python), "-c", "import importlib.util; print(importlib.util.find_spec('vllm')"
                                                ".submodule_search_locations[0])"],
                            capture_output=True, text=True, check=True).stdout.strip()
    done = subprocess.run([str(python), "-c", VLLM_DECODE, f"{origin}/distributed/kv_events.py"],
                          input="\n".join(p.hex() for p in payloads), capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def test_published_kv_events_are_what_vllm_decodes_and_replays(mode, emulated):
    _, _, frames, replay = emulated
    assert all(topic == b"" for topic, _, _ in frames)  # vLLM's default topic
    seqs = [int.from_bytes(seq, "big") for _, seq, _ in frames]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    batches = decode_with_vllm([payload for _, _, payload in frames])
    stored = [e for b in batches for e in b["events"] if e["type"] == "BlockStored"]
    assert stored and all(b["rank"] == 0 for b in batches)
    first = stored[0]
    assert first["parent_block_hash"] is None and first["medium"] == "GPU" and first["group_idx"] == 0
    assert first["kv_cache_spec_kind"] == "full_attention" and all(isinstance(h, int) for h in first["block_hashes"])
    assert first["tokens"] == first["block_size"] * len(first["block_hashes"])
    # The recorded prompt's first batch on a real prefill and on the emulated one: the same blocks of the same
    # tokens (hash values differ: vLLM seeds its own; routers key their index on the token ids).
    real = kv_wire.decode_batch(base64.b64decode(recorded(mode)["kv_events"]["prefill"][0][2]))
    ours = [kv_wire.decode_batch(p) for _, _, p in frames]
    real_tokens = [e.token_ids for e in real.events if isinstance(e, kv_wire.BlockStored)]
    assert real_tokens[0] in [e.token_ids for b in ours for e in b.events if isinstance(e, kv_wire.BlockStored)]
    # The replay socket streams every buffered batch from the start, then the end marker.
    assert replay[-1] == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
    assert [int.from_bytes(f[2], "big") for f in replay[:-1]][-len(frames):] == seqs
