"""The benchmark model's KV is realistic (at least a quarter of Qwen3-32B's per token, at tiny's hidden size), and
each model has a cache directory of its own."""
from __future__ import annotations

from disagg.devcluster import tinymodel

QWEN3_32B = {"layers": 64, "kv_heads": 8, "head_dim": 128}  # its config.json: 256 KiB of bf16 KV per token


def test_kv64k_holds_a_quarter_of_qwen3_32b_kv_per_token():
    assert tinymodel.kv_bytes_per_token(QWEN3_32B) == 256 << 10
    kv64k, tiny = tinymodel.SPECS["kv64k"], tinymodel.SPECS["tiny"]
    assert tinymodel.kv_bytes_per_token(kv64k) >= tinymodel.kv_bytes_per_token(QWEN3_32B) // 4
    assert tinymodel.kv_bytes_per_token(tiny) == 4 << 10
    # Compute stays cheap: the residual stream and the vocabulary are tiny's.
    assert (kv64k["hidden"], kv64k["vocab"]) == (tiny["hidden"], tiny["vocab"])


def test_each_shape_has_its_own_directory_and_a_new_corpus_makes_a_new_model(monkeypatch, tmp_path):
    tiny = tinymodel.model_dir("tiny")
    assert tiny.name.startswith("tiny-llama-4l-256h-s1234-t")
    assert tinymodel.model_dir("kv64k").name == "tiny-llama-16l-256h-8kv128d-s1234"  # random: its cache stays
    other = tmp_path / "corpus.txt"
    other.write_text(tinymodel.corpus() + "One more line.\n")
    monkeypatch.setattr(tinymodel, "CORPUS", other)
    assert tinymodel.model_dir("tiny") != tiny


def test_the_demo_prompt_is_in_the_corpus_the_model_learns():
    from disagg.devcluster.demo_engines import PROMPT

    assert PROMPT.strip() in tinymodel.corpus()
