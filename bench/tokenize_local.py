"""The local arm of bench/tokenize_cost.py, run by the vLLM environment's Python (it has `tokenizers` and
`transformers`; the router's environment has neither): tokenizes the prompts it reads on stdin, one JSON object a
line, with a model directory's own tokenizer, as a router would that kept one, and writes one JSON line per prompt:
the token ids and this process's CPU and wall time for them.

Completions: the Rust tokenizer's `encode` with the special tokens (what vLLM does to a completions prompt).
Chat: transformers' `apply_chat_template` (the template rendered with jinja2, then encoded without special tokens,
which is what vLLM's chat path does).
"""
from __future__ import annotations

import json
import sys
import time


def main() -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
    rust = tokenizer.backend_tokenizer
    print(json.dumps({"ready": True, "vocab": rust.get_vocab_size()}), flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        if "decode" in ask:  # the bench cuts prompts of an exact token count this way
            print(json.dumps({"text": rust.decode(ask["decode"])}), flush=True)
            continue
        c0, w0 = time.process_time(), time.perf_counter()
        if "messages" in ask:
            text = tokenizer.apply_chat_template(ask["messages"], add_generation_prompt=True, tokenize=False)
            ids = rust.encode(text, add_special_tokens=False).ids
        else:
            ids = rust.encode(ask["prompt"], add_special_tokens=True).ids
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        print(json.dumps({"cpu_ms": cpu * 1e3, "wall_ms": wall * 1e3, "tokens": ids}), flush=True)


if __name__ == "__main__":
    main()
