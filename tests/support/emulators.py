"""Engine emulators in the test's own event loop, on real ports: `emulated_pair(mode)` starts a prefill and a decode
emulator (`connector/emulator/main.Emulator`, what `disagg emulator` runs) that talk over their real HTTP side
channels, and publish KV events on real ZMQ sockets."""
from __future__ import annotations

import argparse
import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp

from disagg.connector.emulator import flags
from disagg.connector.emulator.main import Emulator, advertisement
from disagg.connector.router import pd_protocol as pd
from disagg.connector.wire import env as wire_env
from disagg.connector.wire.advertisement import EngineAdvertisement
from disagg.devcluster.cluster import free_port


def emulator_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    flags.add_arguments(p)
    return p.parse_args(["--host", "127.0.0.1", "--port", str(free_port()), "--side-channel-port", str(free_port()),
                         "--kv-events-port", str(free_port()), "--kv-events-replay-port", str(free_port()), *argv])


@dataclass
class Pair:
    mode: str
    prefill: Emulator
    decode: Emulator

    @property
    def prefill_url(self) -> str:
        return f"http://127.0.0.1:{self.prefill.args.port}"

    @property
    def decode_url(self) -> str:
        return f"http://127.0.0.1:{self.decode.args.port}"

    @property
    def prefill_advertisement(self) -> EngineAdvertisement:
        return advertisement(self.prefill.ident, self.prefill.side_port)


TIME_SCALE = "0.05"
"""Functional tests run the cpu-kv64k profile twenty times faster than the engines it emulates (a 320-token
prefill takes 0.12 s, not 2.4): they check protocols and bookkeeping, not time."""


@asynccontextmanager
async def emulated_pair(mode: str, *argv: str) -> AsyncIterator[Pair]:
    def one(role: str) -> Emulator:
        env = {wire_env.ENGINE_ID: f"test-{role}-{uuid.uuid4().hex[:8]}", wire_env.SIDE_CHANNEL_HOST: "127.0.0.1"}
        return Emulator(emulator_args("--role", role, "--kv-mode", mode, "--time-scale", TIME_SCALE, *argv), env)

    pair = Pair(mode, one("prefill"), one("decode"))
    await pair.prefill.start()
    await pair.decode.start()
    try:
        yield pair
    finally:
        await pair.decode.stop(drain_seconds=0)
        await pair.prefill.stop(drain_seconds=0)


async def http(session: aiohttp.ClientSession, method: str, url: str, body: Any = None, raw: bytes | None = None,
               request_id: str | None = None) -> dict[str, Any]:
    """One request as tests/emulator/record_vllm_wire.py records it: status, content type, JSON or SSE lines."""
    headers = {"Content-Type": "application/json", **({"X-Request-Id": request_id} if request_id else {})}
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    async with session.request(method, url, data=data, headers=headers) as r:
        payload = await r.read()
        out: dict[str, Any] = {"status": r.status, "content_type": r.headers.get("Content-Type", "")}
    if out["content_type"].startswith("text/event-stream"):
        out["sse"] = [line for line in payload.decode().split("\n") if line]
    else:
        try:
            out["json"] = json.loads(payload)
        except ValueError:
            out["text"] = payload.decode(errors="replace")
    return out


async def pd_request(session: aiohttp.ClientSession, pair: Pair, endpoint: pd.Endpoint, body: dict[str, Any],
                     request_id: str | None = None) -> dict[str, Any]:
    """Both legs as the router sends them: push at once (decode's params name the prefill), pull one after the
    other (decode gets prefill's params unchanged)."""
    rid = request_id or uuid.uuid4().hex
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    if pair.mode == "push":
        params = pd.push_decode_params(endpoint, rid, pair.prefill_advertisement)
        prefill, decode = await asyncio.gather(
            http(session, "POST", pair.prefill_url + path, pd.prefill_body(endpoint, body), request_id=rid),
            http(session, "POST", pair.decode_url + path, pd.decode_body(body, params), request_id=rid))
    else:
        prefill = await http(session, "POST", pair.prefill_url + path, pd.prefill_body(endpoint, body),
                             request_id=rid)
        params = pd.pull_decode_params(prefill["json"])
        decode = await http(session, "POST", pair.decode_url + path, pd.decode_body(body, params), request_id=rid)
    return {"prefill": prefill, "decode": decode, "request_id": rid}
