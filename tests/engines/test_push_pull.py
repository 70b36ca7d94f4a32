"""Disaggregated prefill/decode through the router on real vLLM engines: outputs equal a single engine's."""
from __future__ import annotations

import time

import pytest

from support.engines import PROMPTS, Load, chat, completion, await_status, metric, post, post_raw, stream_text, text_of

pytestmark = pytest.mark.engines


def check_outputs(router_url: str, reference: dict) -> None:
    for i, prompt in enumerate(PROMPTS):
        status, resp = post(router_url + "/v1/completions", completion(prompt))
        assert status == 200, resp
        assert text_of(resp) == reference[("completion", i)]
        assert stream_text(router_url + "/v1/completions", completion(prompt)) == reference[("completion", i)]
        status, resp = post(router_url + "/v1/chat/completions", chat(prompt))
        assert status == 200, resp
        assert text_of(resp) == reference[("chat", i)]
        assert stream_text(router_url + "/v1/chat/completions", chat(prompt)) == reference[("chat", i)]


class TestPush:
    def test_first_request_is_push_with_concurrent_dispatch(self, push_pair, reference):
        url = push_pair.router.url
        await_status(url + "/health")
        status, resp = post(url + "/v1/completions", completion(PROMPTS[0]))
        assert status == 200, resp
        assert text_of(resp) == reference[("completion", 0)]
        assert metric(url, "disagg_router_decode_legs_total", mode="push") == 1
        # The decode leg reached its engine while prefill was still computing: the push fast path.
        assert metric(url, "disagg_router_decode_before_prefill_done_total", mode="push") == 1
        assert metric(url, "disagg_router_ttft_seconds_count", mode="push") == 1
        assert metric(url, "disagg_router_handoff_seconds_count", mode="push") == 1

    def test_outputs_equal_a_single_engine_streaming_and_not(self, push_pair, reference):
        check_outputs(push_pair.router.url, reference)

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
        old_id = push_pair.decode.spec.engine_id
        push_pair.decode.restart()
        push_pair.decode.wait_ready()
        assert push_pair.decode.spec.engine_id != old_id
        push_pair.register(push_pair.decode)
        await_status(push_pair.router.url + "/health")
        t0 = time.monotonic()
        status, resp = post(push_pair.router.url + "/v1/completions", completion(PROMPTS[1]), timeout=60)
        assert status == 200 and text_of(resp) == reference[("completion", 1)]
        assert time.monotonic() - t0 < 30, "no registration-timeout hang"

    def test_dead_prefill_leaves_rotation_within_two_seconds(self, push_pair):
        url = push_pair.router.url
        push_pair.prefill.stop()
        t0 = time.monotonic()
        await_status(url + "/health", 503, timeout=5)
        assert time.monotonic() - t0 < 2.5
        status, resp = post(url + "/v1/completions", completion(PROMPTS[0]), timeout=10)
        assert status in (502, 503), "a request with no prefill engine fails fast instead of hanging"


class TestPull:
    def test_outputs_equal_a_single_engine_streaming_and_not(self, pull_pair, reference):
        await_status(pull_pair.router.url + "/health")
        check_outputs(pull_pair.router.url, reference)
        assert metric(pull_pair.router.url, "disagg_router_handoff_seconds_count", mode="pull") >= 8

    def test_push_and_pull_engines_are_never_paired(self, pull_pair, push_pair):
        """The push pair's engines are registered too (push_pair ran first), but a pull router ignores them."""
        # A push router sees only push engines: with the push prefill stopped by the previous test, it has no
        # pair, even though a pull prefill is alive and registered.
        status, _ = post(push_pair.router.url + "/v1/completions", completion(PROMPTS[0]), timeout=10)
        assert status == 503
