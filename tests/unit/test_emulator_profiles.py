"""The engine emulator's profiles (connector/emulator/profiles.py) are what their sources say: cpu-kv64k is the fit
of the real engines' measured steps (bench/results/emulator_calibration.json), and qwen3-32b-tp4-p5en reproduces the
published serving figures it is held to, through the same step model the emulator runs."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from disagg.connector.emulator.profiles import CPU_KV64K, PROFILES, QWEN3_32B_TP4_P5EN, Contention, EmulatorProfile
from disagg.connector.emulator.scheduler import Scheduled, StepPlan, step_seconds
from disagg.connector.wire import emulator as contract

BENCH = Path(__file__).resolve().parents[2] / "bench"
CALIBRATION = BENCH / "results" / "emulator_calibration.json"
CONTENTION = CALIBRATION.with_name("emulator_contention.json")


def test_the_profiles_are_the_operators_enum():
    assert tuple(PROFILES) == contract.PROFILES and contract.DEFAULT_PROFILE in PROFILES


def test_cpu_kv64k_is_the_calibrations_fit(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    result_file = importlib.import_module("result_file")
    fit = result_file.load(CALIBRATION)["fit"]
    for key, value in fit["step"].items():
        assert getattr(CPU_KV64K.step, key) == pytest.approx(value, rel=0.01, abs=1e-9), key
    for key, value in fit["transfer"].items():
        assert getattr(CPU_KV64K.transfer, key) == pytest.approx(value, rel=0.01, abs=1e-9), key
    assert CPU_KV64K.api_latency_s == pytest.approx(fit["api_latency_s"], rel=0.01)
    contention = result_file.load(CONTENTION)["fit"]
    for role in ("prefill", "decode"):
        assert CPU_KV64K.contention.of(role) == Contention(**contention[role]), role
    assert QWEN3_32B_TP4_P5EN.contention.of("decode") == Contention(), "a GPU owns its compute"
    # 1 GiB of 64 KiB-per-token KV in blocks of 128: what vLLM reports for the real engine.
    assert CPU_KV64K.num_blocks == 128 and CPU_KV64K.kv_cache_tokens == 16384


def prefill_seconds(p: EmulatorProfile, tokens: int) -> float:
    """A lone prompt's prefill: chunks of the step budget, each a step."""
    total, computed = 0.0, 0
    while computed < tokens:
        n = min(p.max_num_batched_tokens, tokens - computed)
        total += step_seconds(StepPlan((Scheduled("r", computed, n, 0),), ()), p.step)
        computed += n
    return total


def decode_step(p: EmulatorProfile, batch: int, context: int) -> float:
    return step_seconds(StepPlan(tuple(Scheduled(str(i), context, 1, 0) for i in range(batch)), ()), p.step)


def test_qwen3_32b_on_p5en_reproduces_the_published_push_figures():
    """AWS, Qwen3-32B 1P1D on p5en with vLLM's push connector and 16k-token prompts: TTFT about 540 ms and TPOT
    about 7 ms (/work/shared/research/push-protocol.md). Within 15%: a lone request's prefill, handoff and first
    decode step; a decode step of a few 16k-token sequences."""
    p, prompt = QWEN3_32B_TP4_P5EN, 16 * 1024
    ttft = (p.api_latency_s + prefill_seconds(p, prompt) + p.transfer.fixed_s + p.transfer.per_token_s * prompt
            + decode_step(p, 1, prompt))
    assert ttft == pytest.approx(0.540, rel=0.15)
    assert decode_step(p, 4, prompt) == pytest.approx(0.007, rel=0.15)
    # and it holds what a p5en's four H200 hold: well over a million tokens of KV, one 32k request many times over
    assert p.kv_cache_tokens > 1_000_000 and p.kv_cache_tokens // p.max_model_len > 30


def test_a_time_scale_multiplies_every_duration_and_keeps_the_capacity():
    half = CPU_KV64K.scaled(0.5)
    assert half.step.fixed_s == pytest.approx(CPU_KV64K.step.fixed_s / 2)
    assert half.step.per_attention_pair_s == pytest.approx(CPU_KV64K.step.per_attention_pair_s / 2)
    assert half.transfer.per_token_s == pytest.approx(CPU_KV64K.transfer.per_token_s / 2)
    assert half.api_latency_s == pytest.approx(CPU_KV64K.api_latency_s / 2)
    for role in ("prefill", "decode"):
        c, h = CPU_KV64K.contention.of(role), half.contention.of(role)
        assert (h.share, h.per_sequence_s) == pytest.approx((c.share, c.per_sequence_s / 2))
    assert (half.num_blocks, half.max_num_seqs, half.name) == (CPU_KV64K.num_blocks, CPU_KV64K.max_num_seqs,
                                                               CPU_KV64K.name)
