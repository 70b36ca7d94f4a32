"""A stand-in for a vLLM prefill or decode engine that answers at once: the router-overhead microbenchmark.

Real CPU engines on this machine stall for seconds at a time (each one's NIXL progress thread spins a core),
which buries a router's few milliseconds. Against this stub, the only costs left are HTTP and the proxies
themselves, so "through a router" minus "direct" is the router's overhead.

It speaks what routers need: `/health`, `/v1/models` (with max_model_len), and `/v1/completions`. A prefill
leg (`max_tokens: 1` with `do_remote_decode`) gets one JSON answer with pull-style `kv_transfer_params`; any
other request gets `max_tokens` SSE chunks, a usage chunk and `[DONE]` (or one JSON answer without stream).

Run: `python bench/stub_engine.py --port 8100`.
"""
from __future__ import annotations

import argparse
import json
import time
import uuid

from aiohttp import web


def chunk(rid: str, text: str) -> bytes:
    body = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": "tiny",
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    rid = f"cmpl-{request.headers.get('X-Request-Id', uuid.uuid4().hex)}-0"
    params = body.get("kv_transfer_params") or {}
    n = int(body.get("max_tokens") or 16)
    if params.get("do_remote_decode"):
        port = request.app["side_channel_port"]
        return web.json_response({
            "id": rid, "object": "text_completion", "model": "tiny",
            "choices": [{"index": 0, "text": "a", "finish_reason": "length"}],
            "usage": {"prompt_tokens": len(str(body.get("prompt", ""))), "completion_tokens": 1},
            "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False,
                                   "remote_request_id": rid, "remote_engine_id": request.app["engine_id"],
                                   "remote_block_ids": [0], "remote_host": "127.0.0.1", "remote_port": port,
                                   "tp_size": 1}})
    if not body.get("stream"):
        return web.json_response({"id": rid, "object": "text_completion", "model": "tiny",
                                  "choices": [{"index": 0, "text": "a" * n, "finish_reason": "length"}],
                                  "usage": {"completion_tokens": n}})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    for _ in range(n):
        await resp.write(chunk(rid, "a"))
    usage = {"id": rid, "object": "text_completion", "model": "tiny", "choices": [],
             "usage": {"prompt_tokens": 0, "completion_tokens": n, "total_tokens": n}}
    await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def models(_request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model", "max_model_len": 8192}]})


async def health(_request: web.Request) -> web.Response:
    return web.Response(text="")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--side-channel-port", type=int, default=5600)
    p.add_argument("--engine-id", default="stub")
    args = p.parse_args()
    app = web.Application(client_max_size=16 << 20)
    app["side_channel_port"], app["engine_id"] = args.side_channel_port, args.engine_id
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
