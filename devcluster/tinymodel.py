"""Generate the tiny random-weight Llama that local engines serve (no model hub is reachable).

Runs inside the vLLM environment (it needs torch and transformers): `vllm-venv/bin/python -m
disagg.devcluster.tinymodel OUT_DIR` is what `ensure_model()` does. Deterministic for a seed, so two runs
(and a single engine vs a P/D pair) serve the same weights.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SPEC = {"layers": 4, "hidden": 256, "heads": 4, "kv_heads": 4, "head_dim": 64, "vocab": 512, "seed": 1234,
        "max_positions": 8192}


def model_dir() -> Path:
    from .build import cache_dir  # not at module level: this file also runs as a plain script

    return cache_dir() / "models" / f"tiny-llama-{SPEC['layers']}l-{SPEC['hidden']}h-s{SPEC['seed']}"


def ensure_model(python: Path) -> Path:
    """Generate the model with the vLLM environment's python (torch, transformers) unless it exists."""
    out = model_dir()
    if not (out / "disagg-tiny-model.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        # Run as a plain script from / so no checkout on sys.path can shadow anything.
        subprocess.run([str(python), str(Path(__file__).resolve()), str(out)], check=True, cwd="/",
                       env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    return out


def generate(out_dir: str) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(out_dir)
    torch.manual_seed(SPEC["seed"])
    config = LlamaConfig(vocab_size=SPEC["vocab"], hidden_size=SPEC["hidden"], intermediate_size=SPEC["hidden"] * 2,
                         num_hidden_layers=SPEC["layers"], num_attention_heads=SPEC["heads"],
                         num_key_value_heads=SPEC["kv_heads"], head_dim=SPEC["head_dim"],
                         max_position_embeddings=SPEC["max_positions"], bos_token_id=256, eos_token_id=257,
                         torch_dtype="bfloat16", tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)

    # Byte-level BPE with no merges: every byte is a token, so any text round-trips.
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab |= {"<s>": 256, "</s>": 257}
    for i in range(len(vocab), SPEC["vocab"]):
        vocab[f"<unused{i}>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant: {% endif %}")
    fast.save_pretrained(out)
    (out / "disagg-tiny-model.json").write_text(json.dumps(SPEC))


if __name__ == "__main__":
    generate(sys.argv[1])
