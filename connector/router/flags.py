"""Flags of `disagg router`, kept apart so building the CLI never imports aiohttp."""
from __future__ import annotations

import argparse
from pathlib import Path

from . import kv_index, kv_scoring

DEFAULT_MAX_INFLIGHT = 1024
"""Requests in flight per router: what one router core streams at a steady pace (the operator's default too)."""
DEFAULT_MAX_INFLIGHT_PER_ENGINE = 256
"""Legs in flight per engine: vLLM's default batch (max_num_seqs) on most GPUs, twice a CPU engine's."""
DEFAULT_MAX_QUEUE = 256
DEFAULT_QUEUE_WAIT_SECONDS = 1.0
POLICIES = ("least-loaded", "prefix-aware")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--mode", choices=("push", "pull"), default="push")
    p.add_argument("--dispatch", choices=("concurrent", "sequential"), default="concurrent",
                   help="push only: send the decode leg with the prefill leg (default) or after it. "
                        "Sequential is for benchmarks; with vLLM 0.32 a decode leg sent after prefill finished "
                        "can wait for KV until --request-timeout")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--rendezvous", help="rendezvous URL to watch for engines")
    src.add_argument("--engines-file", type=Path, help="static engine list (YAML/JSON advertisements)")
    p.add_argument("--request-timeout", type=float, default=300.0, help="per-read timeout of upstream calls")
    p.add_argument("--connect-timeout", type=float, default=5.0)
    p.add_argument("--pair-wait-seconds", type=float, default=0.0,
                   help="how long a request waits for a healthy prefill/decode pair when none is available before "
                        "a 503 (default 0: at once)")
    p.add_argument("--max-inflight", type=_count, default=DEFAULT_MAX_INFLIGHT,
                   help="requests in flight at most, all engines together; beyond it requests wait in the queue "
                        "(0: no bound)")
    p.add_argument("--max-inflight-per-engine", type=_count, default=DEFAULT_MAX_INFLIGHT_PER_ENGINE,
                   help="legs in flight at most per engine: a prefill leg until prefill answers, a decode leg until "
                        "its answer ends; a request is admitted on a pair whose two engines are both below it, least "
                        "outstanding first. Set it near the engines' --max-num-seqs (0: no bound)")
    p.add_argument("--max-queue", type=_count, default=DEFAULT_MAX_QUEUE,
                   help="requests that wait (first come, first served) for a slot at most; one more gets 429 with "
                        "Retry-After at once")
    p.add_argument("--queue-wait-seconds", type=_seconds, default=DEFAULT_QUEUE_WAIT_SECONDS,
                   help="how long a request waits for a slot before it gets 429 with Retry-After")
    p.add_argument("--stop-delay-seconds", type=float, default=0.0,
                   help="on SIGTERM, keep serving (new connections too) this long with /readyz answering 503 before "
                        "the drain, so a load balancer whose endpoints lag the SIGTERM (a Kubernetes Service) stops "
                        "sending first (default 0; the operator's router pods use 5)")
    p.add_argument("--drain-seconds", type=float, default=60.0,
                   help="then stop listening (new connections are refused) and give the requests in flight, streams "
                        "included, this long to finish; whatever is left is cut, and the router exits")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="the model the engines serve: /v1/models lists it while no decode engine answers (a "
                        "deployment scaled to zero, or starting), so clients that check the model first wait for a "
                        "pair like any request instead of failing")
    p.add_argument("--policy", choices=POLICIES, default="least-loaded",
                   help="how requests pick engines: least outstanding legs, or prefix-aware: also by the prompt "
                        "blocks each engine holds, from an index of every advertising engine's KV events "
                        "(disagg_router_kv_* and disagg_router_prefix_* metrics); the prompt is tokenized by an "
                        "engine's /tokenize")
    p.add_argument("--prefill-hit-weight", type=_weight, default=kv_scoring.DEFAULT_PREFILL_WEIGHT,
                   help="prefix-aware: what computing the whole prompt weighs against the work queued on a prefill "
                        "engine, in prompts like this one; 0 ignores prefill caches")
    p.add_argument("--decode-hit-weight", type=_weight, default=kv_scoring.DEFAULT_DECODE_WEIGHT,
                   help="prefix-aware: what a decode engine that holds none of the prompt weighs, in requests in "
                        "flight (decode receives only the blocks it lacks); 0 ignores decode caches")
    p.add_argument("--decode-only-share", type=_share, default=kv_scoring.DEFAULT_DECODE_ONLY_SHARE,
                   help="prefix-aware: a request whose decode engine holds at least this share of its prompt skips "
                        "prefill, and decode computes the rest; above 1: never")
    per_block = kv_index.BYTES_PER_BLOCK
    default_mib = kv_index.DEFAULT_MAX_ENGINES * kv_index.DEFAULT_MAX_BLOCKS_PER_ENGINE * per_block >> 20
    p.add_argument("--kv-index-max-engines", type=_positive, default=kv_index.DEFAULT_MAX_ENGINES,
                   help="prefix-aware: engine event streams indexed at most (one per data-parallel rank); more are "
                        "left out of the index. The index costs at most this x --kv-index-max-blocks-per-engine x "
                        f"{per_block} bytes ({default_mib} MiB by default, for a router of about 50 MiB)")
    p.add_argument("--kv-index-max-blocks-per-engine", type=_positive,
                   default=kv_index.DEFAULT_MAX_BLOCKS_PER_ENGINE,
                   help="prefix-aware: blocks indexed per engine at most; past it the least recently stored is "
                        "dropped, which only shortens predictions. Set it at or above the engines' KV capacity in "
                        "blocks (the default is 2M tokens in blocks of 128)")
    p.add_argument("--transfer-id", action="store_true", help="also send transfer_id (newer vLLM push protocol)")
    p.add_argument("--access-log", metavar="PATH",
                   help="append one JSON line per request with its exact timings (connector/router/access_log.py); "
                        "'-' for standard output")
    p.add_argument("--log-level", default="INFO")


def _count(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {n}")
    return n


def _positive(text: str) -> int:
    n = int(text)
    if not 1 <= n <= 1 << 30:
        raise argparse.ArgumentTypeError(f"must be between 1 and 2**30, got {n}")
    return n


def _weight(text: str) -> float:
    x = float(text)
    if not 0 <= x <= 1000:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1000, got {text}")
    return x


def _share(text: str) -> float:
    x = float(text)
    if not 0 < x <= 2:
        raise argparse.ArgumentTypeError(f"must be above 0 and at most 2 (above 1: never), got {text}")
    return x


def _seconds(text: str) -> float:
    x = float(text)
    if not 0 <= x <= 3600:  # also refuses nan and inf
        raise argparse.ArgumentTypeError(f"must be between 0 and 3600, got {text}")
    return x
