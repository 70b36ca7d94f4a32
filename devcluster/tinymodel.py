"""Generate the tiny Llamas that local engines serve (no model hub is reachable).

Runs inside the vLLM environment (it needs torch and transformers): `vllm-venv/bin/python
devcluster/tinymodel.py OUT_DIR [SPEC]` is what `ensure_model()` does. Deterministic for a seed, so two runs
(and a single engine vs a P/D pair) serve the same weights.

Two shapes (SPECS):
- `tiny`, what tests and the demo serve: 4 KiB of KV per token, so a handoff moves almost nothing. It is trained
  here, for a few minutes on the CPU, until it has learned `tinymodel_corpus.txt` (a page about this project)
  by heart. So it answers legibly, and on that text it is sure of every next token: its top choice beats the
  second by 5 nats or more, where the numerical noise of running a request in one batch or another moves a logit
  by hundredths. A greedy output of it that differs from a reference is a wrong input (KV that is not the
  prompt's), never rounding; and its answers depend on the prompt's KV, so wrong KV shows. Cached by a key of its
  spec and the corpus.
- `kv64k`, for benchmarks of the handoff: 64 KiB of KV per token, a quarter of Qwen3-32B's 256 KiB (64 layers x
  8 KV heads x head dim 128 x K and V x 2 bytes), from 16 layers x 8 KV heads x head dim 128. Hidden size and
  vocabulary stay those of `tiny`, so the weights stay small; attention's compute grows with the KV, as in a real
  model. Random weights: its next-token choices are near ties, so its outputs are for timing, not for checking.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

CORPUS = Path(__file__).resolve().parent / "tinymodel_corpus.txt"
"""What `tiny` learns by heart: plain text about the project, and two chat turns in its chat template's format."""
TRAINING = {"recipe": 1, "steps": 400, "seq": 384, "batch": 8, "lr": 3e-3, "warmup": 20}
"""Enough for `tiny` to recite the corpus (final loss about 0.03) from windows of up to `seq` tokens: prompts
that are longer than that are beyond what it learned. `recipe` is part of the cache key: raise it when
`_learn_by_heart` changes."""
SPECS: dict[str, dict[str, Any]] = {
    "tiny": {"layers": 4, "hidden": 256, "heads": 4, "kv_heads": 4, "head_dim": 64, "vocab": 512, "seed": 1234,
             "max_positions": 8192, "train": TRAINING},
    "kv64k": {"layers": 16, "hidden": 256, "heads": 8, "kv_heads": 8, "head_dim": 128, "vocab": 512, "seed": 1234,
              "max_positions": 8192},
}


def kv_bytes_per_token(spec: dict[str, Any]) -> int:
    """K and V, every layer, every KV head, in bf16."""
    return int(2 * spec["layers"] * spec["kv_heads"] * spec["head_dim"] * 2)


def model_dir(name: str = "tiny") -> Path:
    from .build import cache_dir  # not at module level: this file also runs as a plain script

    spec = SPECS[name]
    shape = "" if name == "tiny" else f"-{spec['kv_heads']}kv{spec['head_dim']}d"
    trained = f"-t{_training_key(spec)}" if "train" in spec else ""
    return cache_dir() / "models" / f"tiny-llama-{spec['layers']}l-{spec['hidden']}h{shape}-s{spec['seed']}{trained}"


def corpus() -> str:
    return CORPUS.read_text()


def _training_key(spec: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode() + CORPUS.read_bytes()).hexdigest()[:10]


def ensure_model(python: Path, name: str = "tiny") -> Path:
    """Generate the model with the vLLM environment's python (torch, transformers) unless it exists."""
    out = model_dir(name)
    if not (out / "disagg-tiny-model.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        # Run as a plain script from / so no checkout on sys.path can shadow anything.
        subprocess.run([str(python), str(Path(__file__).resolve()), str(out), name], check=True, cwd="/",
                       env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    return out


def generate(out_dir: str, name: str = "tiny") -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out, spec = Path(out_dir), SPECS[name]
    torch.manual_seed(spec["seed"])
    config = LlamaConfig(vocab_size=spec["vocab"], hidden_size=spec["hidden"], intermediate_size=spec["hidden"] * 2,
                         num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
                         num_key_value_heads=spec["kv_heads"], head_dim=spec["head_dim"],
                         max_position_embeddings=spec["max_positions"], bos_token_id=256, eos_token_id=257,
                         torch_dtype="bfloat16", tie_word_embeddings=False)
    model = LlamaForCausalLM(config)

    # Byte-level BPE with no merges: every byte is a token, so any text round-trips.
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab |= {"<s>": 256, "</s>": 257}
    for i in range(len(vocab), spec["vocab"]):
        vocab[f"<unused{i}>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant: {% endif %}")
    fast.save_pretrained(out)
    if "train" in spec:
        # The ids the engines' tokenizer gives the text (the byte-level alphabet's order, not the bytes' values).
        _learn_by_heart(model, fast(corpus(), add_special_tokens=False)["input_ids"], spec["train"], spec["seed"])
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    (out / "disagg-tiny-model.json").write_text(json.dumps({**spec, "name": name}))


def _learn_by_heart(model: Any, text: list[int], train: dict[str, Any], seed: int) -> None:
    """Train on windows of the corpus's token ids read round and round (so every window has `seq` tokens and any
    offset can start one), with AdamW, a short warm-up and a cosine decay."""
    import math
    import os
    import time

    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    generator = torch.Generator().manual_seed(seed)
    seq, batch, steps = train["seq"], train["batch"], train["steps"]
    data = torch.tensor(text * (seq // len(text) + 2), dtype=torch.long)
    opt = torch.optim.AdamW(model.parameters(), lr=train["lr"], weight_decay=0.0)
    model.train()
    t0 = time.monotonic()
    print(f"tinymodel: learning {len(text)} tokens of text by heart ({steps} steps on the CPU, a few minutes)",
          file=sys.stderr, flush=True)
    for step in range(steps):
        lr = train["lr"] * min(1.0, (step + 1) / train["warmup"]) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(text), (batch,), generator=generator)
        x = torch.stack([data[i:i + seq] for i in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"tinymodel: step {step + 1}/{steps}, loss {loss.item():.3f}, {time.monotonic() - t0:.0f} s",
                  file=sys.stderr, flush=True)
    model.eval()


if __name__ == "__main__":
    generate(sys.argv[1], *sys.argv[2:3])
