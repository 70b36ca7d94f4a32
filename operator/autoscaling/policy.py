"""spec.autoscaling as the planner reads it (`from_spec`), plus the saturation thresholds the spec does not expose.
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import api
from ..rollout.state import Role

KV_USAGE_HIGH = 0.8
"""A role grows once its engines' KV caches are this full on average; llm-d's workload-variant-autoscaler counts a
replica saturated from the same 0.8."""
WAITING_HIGH = 5.0
"""A role grows once this many requests wait per engine (the workload-variant-autoscaler's queue threshold)."""


@dataclass(frozen=True, slots=True)
class RolePolicy:
    """One role's range and, when known, one engine's throughput at the SLO."""

    min_replicas: int = 1
    max_replicas: int = 1
    tokens_per_second: float | None = None
    """Prefill: prompt tokens an engine computes per second at the TTFT target; decode: output tokens an engine
    generates per second at the TPOT target. None: no throughput floor for the role."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 1 <= min_replicas <= max_replicas, got {self.min_replicas}, {self.max_replicas}")
        if self.tokens_per_second is not None and not self.tokens_per_second > 0:
            raise ValueError(f"tokens_per_second must be positive, got {self.tokens_per_second}")

    def clamp(self, count: int) -> int:
        return min(max(count, self.min_replicas), self.max_replicas)


@dataclass(frozen=True, slots=True)
class AutoscalingPolicy:
    """How the planner sizes both roles. Field meanings are spec.autoscaling's (operator/api.py)."""

    prefill: RolePolicy = RolePolicy()
    decode: RolePolicy = RolePolicy()
    percentile: float = 90.0
    ttft_ms: float = 1000.0
    tpot_ms: float = 100.0
    up_max_step: int = 4
    up_cooldown_seconds: float = 30.0
    down_max_step: int = 1
    down_cooldown_seconds: float = 300.0
    down_band: float = 0.7
    """Below 1: the gap between a signal's scale-up level (1) and this is the hysteresis."""
    idle_seconds: float | None = None
    """Scale both roles to zero after this long without a request; None: never."""
    kv_usage_high: float = KV_USAGE_HIGH
    waiting_high: float = WAITING_HIGH

    def __post_init__(self) -> None:
        if not 0 < self.percentile < 100:
            raise ValueError(f"percentile must be between 0 and 100, got {self.percentile}")
        if not (self.ttft_ms > 0 and self.tpot_ms > 0 and self.kv_usage_high > 0 and self.waiting_high > 0):
            raise ValueError("the SLO targets and the saturation thresholds must be positive")
        if self.up_max_step < 1 or self.down_max_step < 1:
            raise ValueError("a step is at least one engine")
        if self.up_cooldown_seconds < 0 or self.down_cooldown_seconds < 0:
            raise ValueError("cooldowns must not be negative")
        if not 0 < self.down_band < 1:
            raise ValueError(f"down_band must be between 0 and 1 (exclusive), got {self.down_band}")
        if self.idle_seconds is not None and self.idle_seconds < 0:
            raise ValueError(f"idle_seconds must not be negative, got {self.idle_seconds}")

    def role(self, role: Role) -> RolePolicy:
        return self.prefill if role == "prefill" else self.decode

    def latency_target_ms(self, role: Role) -> float:
        """The SLO a role answers for: prefill the TTFT, decode the TPOT."""
        return self.ttft_ms if role == "prefill" else self.tpot_ms


def from_spec(spec: api.AutoscalingSpec) -> AutoscalingPolicy:
    """The policy spec.autoscaling asks for."""
    return AutoscalingPolicy(
        prefill=RolePolicy(spec.prefill.min_replicas, spec.prefill.max_replicas,
                           spec.prefill.input_tokens_per_second),
        decode=RolePolicy(spec.decode.min_replicas, spec.decode.max_replicas, spec.decode.output_tokens_per_second),
        percentile=spec.slo.percentile, ttft_ms=spec.slo.ttft_milliseconds, tpot_ms=spec.slo.tpot_milliseconds,
        up_max_step=spec.scale_up.max_step, up_cooldown_seconds=spec.scale_up.cooldown_seconds,
        down_max_step=spec.scale_down.max_step, down_cooldown_seconds=spec.scale_down.cooldown_seconds,
        down_band=spec.scale_down.utilization,
        idle_seconds=spec.scale_to_zero.idle_seconds if spec.scale_to_zero is not None else None)
