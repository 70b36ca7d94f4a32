"""Push-mode prefill/decode through the router on real vLLM engines (one pair for the module): outputs equal a
single engine's, the plugin pre-warms the pair, and the pair survives restarts of its parts."""
from __future__ import annotations

import re
import time
from pathlib import Path

import msgspec
import pytest

from disagg.connector.wire import env as wire_env
from disagg.connector.wire import kv_metadata
from disagg.connector.wire.advertisement import EngineAdvertisement
from disagg.devcluster.procs import thread_cores, thread_cpu_seconds
from support.engines import (
    LAZY_HANDSHAKE,
    PROMPTS,
    Load,
    advertised,
    await_advertised,
    await_log,
    await_status,
    check_outputs,
    completion,
    kv_moved,
    log_lines,
    metric,
    post,
    post_raw,
    push_by_hand,
    text_of,
)

pytestmark = pytest.mark.engines


def null_block_descriptors(adv: EngineAdvertisement) -> list[int]:
    """NIXL descriptor ids of block 0 (vLLM's null block) in each KV region the engine registered, derived from
    its advertised handshake payload: region k's descriptors follow those of regions 0..k-1."""
    payload = msgspec.msgpack.decode(kv_metadata.decode(adv.kv_metadata)[(0, 0)])
    meta = msgspec.msgpack.decode(payload["agent_metadata_bytes"])
    per_region = meta["region_num_blocks"] or [meta["num_blocks"]] * len(meta["block_lens"])
    return [sum(per_region[:k]) for k in range(len(per_region))]


def cores_by_thread(pids_per_engine: list[list[int]], window: float) -> list[dict[str, float]]:
    """Cores each busy thread of each engine used over the next `window` seconds (from /proc), by "name/tid"."""
    before = [thread_cpu_seconds(pids) for pids in pids_per_engine]
    t0 = time.monotonic()
    time.sleep(window)  # the measurement window itself, not a wait for a condition
    elapsed = time.monotonic() - t0
    return [{f"{name}/{tid}": round(cores, 3)
             for (_, tid), (name, cores) in thread_cores(b, thread_cpu_seconds(pids), elapsed).items() if cores > 0}
            for pids, b in zip(pids_per_engine, before, strict=True)]


class TestPush:
    def test_first_request_is_push_with_concurrent_dispatch(self, push_pair, reference):
        """A fresh pair: the plugin loaded each engine's NIXL agent into its peer from the rendezvous, so the first
        request needs no lazy side-channel handshake on either side."""
        p, d = push_pair.prefill, push_pair.decode
        await_log(p, f"loaded decode engine {d.spec.engine_id}'s NIXL agent from its advertisement")
        await_log(d, f"loaded prefill engine {p.spec.engine_id}'s NIXL agent from its advertisement")
        for engine in (p, d):  # each engine served requests of its own (2.5 KV blocks) before it advertised itself
            assert log_lines(engine, "warmed up with two requests of its own (320 prompt tokens")
        url = push_pair.router.url
        await_status(url + "/health")
        with kv_moved(p, d, "push") as kv:
            status, resp = post(url + "/v1/completions", completion(PROMPTS[0]))
        assert status == 200, resp
        assert text_of(resp) == reference[("completion", 0)]
        kv.check(1)
        assert metric(url, "disagg_router_decode_legs_total", mode="push") == 1
        # The decode leg reached its engine while prefill was still computing: the push fast path.
        assert metric(url, "disagg_router_decode_before_prefill_done_total", mode="push") == 1
        assert metric(url, "disagg_router_ttft_seconds_count", mode="push") == 1
        assert metric(url, "disagg_router_handoff_seconds_count", mode="push") == 1
        for engine in (p, d):
            assert log_lines(engine, LAZY_HANDSHAKE) == [] and log_lines(engine, "NIXL compatibility check") == []
            # The real vLLM worker and scheduler have every attribute the plugin's vllm_shim checks for.
            assert log_lines(engine, "stepping aside") == []

    def test_prefill_warmed_the_write_path_through_null_blocks_only(self, push_pair):
        """Right after loading a decode, prefill WRITEs its null block into decode's, so the pair's first real
        WRITE finds the transport set up. The WRITE must touch block 0 of every region on both sides and nothing
        else: any other descriptor could be a live request's KV."""
        p, d = push_pair.prefill, push_pair.decode
        line = await_log(p, f"warmed the WRITE path to decode engine {d.spec.engine_id}")
        found = re.search(r"remote descriptors \[([\d, ]*)\], local descriptors \[([\d, ]*)\]", line)
        assert found, line
        remote, local = ([int(x) for x in g.split(",")] for g in found.groups())
        ads = advertised(push_pair.rendezvous.url)
        assert remote == null_block_descriptors(ads[d.spec.engine_id])
        assert local == null_block_descriptors(ads[p.spec.engine_id])
        assert len(remote) > 1 and remote[0] == 0, "one descriptor per KV region"
        # Decode never warms a WRITE path: it only receives.
        assert log_lines(d, "warmed the WRITE path") == []

    def test_decode_reads_push_notifications_at_the_end_of_each_step(self, push_pair):
        """The real push worker has the shape connector/plugin/push_notify.py wraps: decode's writer reads NIXL's
        notifications before the step's end reads its queue (a landed KV counts in the step it landed in); prefill
        keeps vLLM's path."""
        assert log_lines(push_pair.decode, "has its writer read NIXL notifications at the end of every engine step")
        assert log_lines(push_pair.decode, "notifications stay on vLLM's writer thread") == []
        assert log_lines(push_pair.prefill, "read NIXL notifications") == []
        for engine in (push_pair.prefill, push_pair.decode):  # CPU engines: transfers start before the forward
            assert log_lines(engine, "KV transfers start before its forward")

    def test_engines_advertise_identity_transport_and_handshake_metadata(self, push_pair):
        ads = advertised(push_pair.rendezvous.url)
        for engine in (push_pair.prefill, push_pair.decode):
            adv = ads[engine.spec.engine_id]
            assert (adv.role, adv.kv_mode, adv.transport, adv.http_url) == (engine.spec.role, "push", "UCX", engine.url)
            assert adv.side_channel_ports == [engine.spec.side_channel_port] and adv.tp_size == 1
            assert adv.kv_metadata["format"] == "vllm-nixl-handshake-v1" and list(adv.kv_metadata["ranks"]) == ["0,0"]

    def test_idle_engines_leave_their_cores_to_the_model(self, push_pair):
        """Every CPU engine gets $DISAGG_NIXL_PROGRESS_DELAY_US, so NIXL's progress thread sleeps in poll() between
        events: an idle engine uses a few percent of a core, where NIXL's default (delay 0) spins a whole one.

        vLLM's own workers busy-wait (sched_yield) on the engine core's queue for 1 s after each message, so the
        engines are idle only once a window passes without any: the test awaits such a window. A spinning progress
        thread never yields one."""
        engines = (push_pair.prefill, push_pair.decode)
        for engine in engines:
            delay = wire_env.CPU_ENGINE_ENV[wire_env.NIXL_PROGRESS_DELAY_US]
            assert log_lines(engine, f"NIXL progress thread waits up to {delay} us in poll()")
        deadline = time.monotonic() + 30
        while True:
            busy = cores_by_thread([e.processes() for e in engines], window=2.0)
            used = [sum(threads.values()) for threads in busy]
            if all(u < 0.3 for u in used):
                break
            assert time.monotonic() < deadline, f"no idle 2 s window in 30 s; the last: {used} cores, {busy}"

    def test_outputs_equal_a_single_engine_streaming_and_not(self, push_pair, reference):
        check_outputs(push_pair.router.url, reference, kv_moved(push_pair.prefill, push_pair.decode, "push"))

    def test_bad_requests_get_4xx_and_engines_survive(self, push_pair, reference):
        url = push_pair.router.url
        assert post_raw(url + "/v1/completions", b"{not json")[0] == 400
        assert post_raw(url + "/v1/completions", b"[1, 2]")[0] == 400
        status, resp = post(url + "/v1/completions", {"model": "tiny", "prompt": ""})
        assert status == 400 and "prompt" in resp["error"]["message"]
        status, resp = post(url + "/v1/chat/completions", {"model": "tiny", "messages": []})
        assert status == 400
        # Malformed transfer params would kill a decode engine (KeyError on remote_request_id): refused.
        evil = {**completion(PROMPTS[0]), "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "x"}}
        status, resp = post(url + "/v1/completions", evil)
        assert status == 400 and "kv_transfer_params" in resp["error"]["message"]
        status, resp = post(url + "/v1/completions", {**completion(PROMPTS[0]), "max_tokens": -3})
        assert status == 400
        status, resp = post(url + "/v1/completions", {**completion(PROMPTS[0]), "max_tokens": 10**7})
        assert status == 400 and "max_model_len" in resp["error"]["message"]
        status, resp = post(url + "/v1/completions", completion(PROMPTS[0]))
        assert status == 200 and text_of(resp) == reference[("completion", 0)]
        for engine in (push_pair.prefill, push_pair.decode):
            assert engine.proc.poll() is None, f"{engine.spec.name} died"

    def test_rendezvous_restart_under_load_fails_no_request(self, push_pair, reference):
        url = push_pair.router.url
        load = Load(url + "/v1/completions", completion(PROMPTS[0]))
        load.start()
        try:
            load.await_results(2)  # the stream is going
            push_pair.rendezvous.kill()
            push_pair.rendezvous.start()
            load.await_results(len(load.results) + 3)
        finally:
            results = load.stop()
        assert [r for r in results if r[0] != 200] == []
        await_status(url + "/health")

    def test_decode_restarted_with_a_new_engine_id_keeps_serving(self, push_pair, reference):
        """Prefill loads the new decode's agent from the rendezvous and releases the old one: no stale agent."""
        p, d = push_pair.prefill, push_pair.decode
        old_id = d.spec.engine_id
        # The previous test restarted the rendezvous: the engine re-registers within a few heartbeats, and only an
        # engine that is registered can be seen to deregister.
        await_advertised(push_pair.rendezvous.url, old_id, timeout=30)
        d.restart()
        d.wait_ready()
        assert d.spec.engine_id != old_id
        await_log(p, f"loaded decode engine {d.spec.engine_id}'s NIXL agent from its advertisement")
        await_log(p, f"warmed the WRITE path to decode engine {d.spec.engine_id}")
        await_status(push_pair.router.url + "/health")
        t0 = time.monotonic()
        with kv_moved(p, d, "push") as kv:
            status, resp = post(push_pair.router.url + "/v1/completions", completion(PROMPTS[1]), timeout=60)
        assert status == 200 and text_of(resp) == reference[("completion", 1)]
        assert time.monotonic() - t0 < 30, "no registration-timeout hang"
        kv.check(1)
        await_log(p, f"released NIXL agent of departed engine {old_id}")
        assert old_id not in advertised(push_pair.rendezvous.url)
        # It left on SIGTERM rather than by lease expiry.
        assert f"engine {old_id} deregistered" in push_pair.rendezvous.log.read_text()
        assert log_lines(p, f"{LAZY_HANDSHAKE} {d.spec.engine_id}") == []

    def test_engine_started_while_rendezvous_is_down_serves_lazily_then_advertises(self, push_pair, reference):
        p, d, rendezvous = push_pair.prefill, push_pair.decode, push_pair.rendezvous
        rendezvous.kill()
        try:
            d.restart()
            d.wait_ready()
            await_log(d, "warmed up with two requests of its own")  # its own prompts, computed before it serves ours
            with kv_moved(p, d, "push") as kv:
                status, resp = push_by_hand(p, d, completion(PROMPTS[0]))
            assert status == 200 and text_of(resp) == reference[("completion", 0)]
            kv.check(1)
            # Neither side knew the other from the rendezvous: vLLM's lazy handshake carried the request.
            assert log_lines(d, f"{LAZY_HANDSHAKE} {p.spec.engine_id}")
            assert log_lines(p, f"{LAZY_HANDSHAKE} {d.spec.engine_id}")
        finally:
            rendezvous.start()
        adv = await_advertised(rendezvous.url, d.spec.engine_id)
        assert adv.transport == "UCX" and adv.kv_metadata is not None
        await_status(push_pair.router.url + "/health")
        with kv_moved(p, d, "push") as kv:
            status, resp = post(push_pair.router.url + "/v1/completions", completion(PROMPTS[1]), timeout=60)
        assert status == 200 and text_of(resp) == reference[("completion", 1)]
        kv.check(1)

    def test_a_decode_whose_first_forward_is_one_token_serves(self, push_pair, reference):
        """vLLM's CPU attention uses AMX tiles, which Linux grants only on request, and vLLM never asks: oneDNN
        asks on a long forward's first matmul, a one-token forward never does. A one-token self warm-up makes the
        restarted decode's first forward one token, as a push handoff's first decode step is; on an AMX CPU it
        died of SIGILL unless the plugin asked first (connector/plugin/cpu_amx.py)."""
        d = push_pair.decode
        d.spec.extra_env = {**d.spec.extra_env, wire_env.WARMUP_TOKENS: "1"}
        d.restart()
        d.wait_ready()
        amx = "amx_tile" in Path("/proc/cpuinfo").read_text()
        assert bool(log_lines(d, "AMX tile permission granted before the first forward")) == amx
        await_log(d, "warmed up with two requests of its own (1 prompt tokens")
        await_advertised(push_pair.rendezvous.url, d.spec.engine_id)
        await_status(push_pair.router.url + "/health")
        with kv_moved(push_pair.prefill, d, "push") as kv:
            status, resp = post(push_pair.router.url + "/v1/completions", completion(PROMPTS[0]), timeout=60)
        assert status == 200 and text_of(resp) == reference[("completion", 0)]
        kv.check(1)
        assert log_lines(d, "Illegal instruction") == []

    def test_dead_prefill_leaves_rotation_within_two_seconds(self, push_pair):
        url = push_pair.router.url
        push_pair.prefill.stop()
        t0 = time.monotonic()
        await_status(url + "/health", 503, timeout=5)
        assert time.monotonic() - t0 < 2.5
        status, resp = post(url + "/v1/completions", completion(PROMPTS[0]), timeout=10)
        assert status in (502, 503), "a request with no prefill engine fails fast instead of hanging"
