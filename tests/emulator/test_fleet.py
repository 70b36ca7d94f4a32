"""Engine emulators as the processes `disagg emulator` runs, behind the real `disagg router` and `disagg rendezvous`,
in push and in pull mode: the router pairs them from their advertisements like engines, requests of every kind
flow through with their KV moved (the same KvMoved proof as on real engines), client aborts at any moment cancel
both legs and leave nothing held, a push decode whose KV never comes fails at its registration timeout, and a
stopping emulator leaves the rendezvous first."""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from disagg.connector.router import pd_protocol as pd
from disagg.connector.wire import emulator as contract
from disagg.devcluster.emulated_engines import EmulatorSpec, LocalEmulator
from disagg.devcluster.engines import LocalRendezvous
from support.engines import KvMoved, Service, advertised, chat, completion, post, stream_text, text_of
from support.metrics import scrape

RENDEZVOUS = LocalRendezvous(token="emulator-fleet", deployment="fleet", heartbeat=1)
TIME_SCALE = ["--time-scale", "0.1"]
"""Ten times faster than the engines emulated: these tests check protocols and bookkeeping, not time."""
REGISTRATION_TIMEOUT_S = 2


@dataclass
class Fleet:
    mode: str
    rendezvous: Service
    router: Service
    prefill: LocalEmulator
    decode: LocalEmulator


def until(condition, what: str, timeout: float = 20.0) -> None:
    """Poll another process's state until `condition()` holds (there is nothing else to await across processes)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout}s")
        time.sleep(0.1)


@pytest.fixture(scope="module", params=["push", "pull"])
def fleet(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    mode = str(request.param)
    logs: Path = tmp_path_factory.mktemp(f"fleet-{mode}")
    rdv = Service(f"rendezvous-{mode}", [*RENDEZVOUS.args(), "--log-level", "WARNING"], logs).start()
    env = RENDEZVOUS.engine_env(rdv.url)
    flags = [*TIME_SCALE, "--registration-timeout", "30"]
    prefill = LocalEmulator(EmulatorSpec(f"emu-{mode}-prefill", "prefill", mode, rendezvous_env=env, flags=flags),
                            logs).start()
    decode = LocalEmulator(EmulatorSpec(f"emu-{mode}-decode", "decode", mode, rendezvous_env=env, flags=flags),
                           logs).start()
    router = Service(f"router-{mode}", ["router", "--mode", mode, "--rendezvous", rdv.url, "--pair-wait-seconds",
                                        "5", "--request-timeout", "30"], logs)
    try:
        prefill.wait_ready()
        decode.wait_ready()
        router.start(ready_path="/health", ok=(200,))  # 200 once it pairs two advertised emulators
        yield Fleet(mode, rdv, router, prefill, decode)
    finally:
        router.stop()
        decode.stop()
        prefill.stop()
        rdv.stop()


def idle(e: LocalEmulator) -> bool:
    m = e.url + "/metrics"
    return (scrape(m, "vllm:num_requests_running") == 0 and scrape(m, "vllm:num_requests_waiting") == 0
            and scrape(m, "vllm:kv_cache_usage_perc") == 0)


def test_the_router_pairs_emulators_from_their_advertisements_and_a_human_sees_emulators(fleet):
    ads = advertised(fleet.rendezvous.url)
    ours = {ad.engine_id: ad for ad in ads.values()}
    assert {fleet.prefill.engine_id, fleet.decode.engine_id} <= set(ours)
    for e, role in ((fleet.prefill, "prefill"), (fleet.decode, "decode")):
        ad = ours[e.engine_id]
        assert (ad.role, ad.kv_mode, ad.transport, ad.kv_metadata) == (role, fleet.mode, contract.TRANSPORT, None)
        assert ad.side_channel_ports == [e.side_channel_port] and ad.http_url == e.url
    with urllib.request.urlopen(fleet.router.url + "/v1/models", timeout=5) as r:
        card = json.load(r)["data"][0]
    assert (card["id"], card["owned_by"]) == ("tiny", contract.OWNER)
    assert "disagg ENGINE EMULATOR (not a vLLM engine)" in fleet.decode.service.log.read_text()


def test_every_kind_of_request_flows_through_the_router_and_its_kv_moves(fleet):
    kv = KvMoved(fleet.prefill.url, fleet.decode.url, fleet.mode)
    with kv:
        answers = []
        for prompt in ("the engine emulator answers " * 10, "from the same prompt the same words " * 20):
            status, resp = post(fleet.router.url + "/v1/completions", completion(prompt))
            assert status == 200, resp
            answers.append(text_of(resp))
            # Greedy-like: the same prompt gives the same answer, streamed or not, whichever way it goes.
            assert stream_text(fleet.router.url + "/v1/completions", completion(prompt)) == answers[-1]
            status, resp = post(fleet.router.url + "/v1/chat/completions", chat(prompt))
            assert status == 200, resp
            assert stream_text(fleet.router.url + "/v1/chat/completions", chat(prompt)) == text_of(resp)
    kv.check(8)
    assert len(answers[0].split()) == 12  # MAX_TOKENS tokens of one word each
    until(lambda: idle(fleet.prefill) and idle(fleet.decode), "both emulators idle with no KV held")


def abort_after(url: str, path: str, body: dict, how: str, delay: float) -> None:
    """One request to the router that the client drops: `before`-first-token after `delay`, or `mid`-stream after
    its first chunk."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    if how == "before":
        time.sleep(delay)  # the moment of the abort is the test's input
    else:
        resp = conn.getresponse()
        assert resp.status == 200
        resp.fp.readline()
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()


def test_client_aborts_at_any_moment_cancel_both_legs_and_free_every_block(fleet):
    long_prompt = "a prompt long enough that its prefill takes a while " * 60  # ~3000 tokens
    aborts = [("before", 0.05), ("before", 0.3), ("before", 0.6), ("mid", 0.0), ("mid", 0.0)]
    threads = [threading.Thread(target=abort_after, args=(
        fleet.router.url, "/v1/completions",
        {**completion(long_prompt + uuid.uuid4().hex), "max_tokens": 300}, how, delay)) for how, delay in aborts]
    for t in threads:
        t.start()
    # Requests that are not aborted are served meanwhile and after.
    status, resp = post(fleet.router.url + "/v1/completions", completion("served beside the aborts " * 4))
    assert status == 200, resp
    for t in threads:
        t.join(30)
    until(lambda: idle(fleet.prefill) and idle(fleet.decode), "both emulators idle with no KV held after the aborts")
    assert scrape(fleet.decode.url + "/metrics", "vllm:request_success_total", finished_reason="abort") >= 2
    status, resp = post(fleet.router.url + "/v1/completions", completion("and after them " * 4))
    assert status == 200, resp


def test_a_push_decode_whose_kv_never_comes_fails_at_its_registration_timeout(fleet, tmp_path):
    if fleet.mode != "push":
        # Pull's decode READs what its prefill holds: a prefill that holds nothing answers 404 at once.
        rid = uuid.uuid4().hex
        params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": fleet.prefill.engine_id,
                  "remote_request_id": f"cmpl-{rid}-0-deadbeef", "remote_host": "127.0.0.1",
                  "remote_port": fleet.prefill.side_channel_port, "remote_block_ids": [[0]], "tp_size": 1}
        status, resp = post(fleet.decode.url + "/v1/completions", pd.decode_body(completion("x " * 50), params))
        assert status == 500 and resp["error"]["message"] == "Internal server error"
        until(lambda: idle(fleet.decode), "the decode freeing the blocks of the failed READ")
        return
    prefill = advertised(fleet.rendezvous.url)[fleet.prefill.engine_id]
    decode = LocalEmulator(EmulatorSpec(f"emu-{fleet.mode}-timeout", "decode", fleet.mode, kv_events=False, flags=[
        *TIME_SCALE, "--registration-timeout", str(REGISTRATION_TIMEOUT_S)]), tmp_path).start().wait_ready()
    try:
        rid = uuid.uuid4().hex  # a request the prefill never runs: no WRITE will come
        t0 = time.monotonic()
        status, resp = post(decode.url + "/v1/completions",
                            pd.decode_body(completion("x " * 50), pd.push_decode_params("completions", rid, prefill)),
                            request_id=rid)
        waited = time.monotonic() - t0
        assert status == 500 and resp["error"]["message"] == "Internal server error"
        assert REGISTRATION_TIMEOUT_S <= waited < REGISTRATION_TIMEOUT_S + 2
        until(lambda: idle(decode), "the decode freeing the blocks once the prefill answered the cancel")
        assert scrape(decode.url + "/metrics", "vllm:request_success_total", finished_reason="error") == 1
    finally:
        decode.stop()


def test_bad_input_gets_a_4xx_and_the_emulator_stays_up(fleet):
    for raw in (b"{not json", b"[1, 2]", b'{"prompt": 5}', b'{"prompt": "x", "max_tokens": -1}',
                b'{"prompt": "x", "kv_transfer_params": {"do_remote_prefill": true}}', b"\xff\xfe"):
        req = urllib.request.Request(fleet.decode.url + "/v1/completions", data=raw,
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=5)
        assert 400 <= e.value.code < 500, raw
    side = f"http://127.0.0.1:{fleet.prefill.side_channel_port}/emulator/v1/push/register"
    for raw in (b"{}", b"null", b'{"remote_request_id": 1}'):
        req = urllib.request.Request(side, data=raw, headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=5)
        assert e.value.code == 400
    assert urllib.request.urlopen(fleet.decode.url + "/health", timeout=5).status == 200


def test_a_stopping_emulator_leaves_the_rendezvous_before_it_exits(fleet, tmp_path):
    env = RENDEZVOUS.engine_env(fleet.rendezvous.url)
    extra = LocalEmulator(EmulatorSpec(f"emu-{fleet.mode}-extra", "decode", fleet.mode, rendezvous_env=env,
                                       flags=TIME_SCALE), tmp_path).start().wait_ready()
    until(lambda: extra.engine_id in advertised(fleet.rendezvous.url), "the extra emulator advertised")
    assert extra.service is not None and extra.service.popen is not None
    extra.stop(grace=15)
    assert extra.engine_id not in advertised(fleet.rendezvous.url)  # deregistered, not left to its lease
    assert "leaving the rendezvous" in extra.service.log.read_text()
