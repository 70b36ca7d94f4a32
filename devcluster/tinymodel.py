"""Generate the tiny random-weight Llamas that local engines serve (no model hub is reachable).

Runs inside the vLLM environment (it needs torch and transformers): `vllm-venv/bin/python
devcluster/tinymodel.py OUT_DIR [SPEC]` is what `ensure_model()` does. Deterministic for a seed, so two runs
(and a single engine vs a P/D pair) serve the same weights.

Two shapes (SPECS):
- `tiny`, what tests and the demo serve: 4 KiB of KV per token, so a handoff moves almost nothing.
- `kv64k`, for benchmarks of the handoff: 64 KiB of KV per token, a quarter of Qwen3-32B's 256 KiB (64 layers x
  8 KV heads x head dim 128 x K and V x 2 bytes), from 16 layers x 8 KV heads x head dim 128. Hidden size and
  vocabulary stay those of `tiny`, so the weights stay small; attention's compute grows with the KV, as in a real
  model.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SPECS = {
    "tiny": {"layers": 4, "hidden": 256, "heads": 4, "kv_heads": 4, "head_dim": 64, "vocab": 512, "seed": 1234,
             "max_positions": 8192},
    "kv64k": {"layers": 16, "hidden": 256, "heads": 8, "kv_heads": 8, "head_dim": 128, "vocab": 512, "seed": 1234,
              "max_positions": 8192},
}


def kv_bytes_per_token(spec: dict[str, int]) -> int:
    """K and V, every layer, every KV head, in bf16."""
    return 2 * spec["layers"] * spec["kv_heads"] * spec["head_dim"] * 2


def model_dir(name: str = "tiny") -> Path:
    from .build import cache_dir  # not at module level: this file also runs as a plain script

    spec = SPECS[name]
    shape = "" if name == "tiny" else f"-{spec['kv_heads']}kv{spec['head_dim']}d"
    return cache_dir() / "models" / f"tiny-llama-{spec['layers']}l-{spec['hidden']}h{shape}-s{spec['seed']}"


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
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)

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
    (out / "disagg-tiny-model.json").write_text(json.dumps({**spec, "name": name}))


if __name__ == "__main__":
    generate(sys.argv[1], *sys.argv[2:3])
