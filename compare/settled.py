"""When a deployment serves in a mode: what `disagg compare` waits for after it switched spec.kvTransfer.mode."""
from __future__ import annotations

from typing import Any

from disagg.operator import api


def waiting_for(obj: dict[str, Any], mode: str) -> str | None:
    """None once the CR serves `mode`: the operator has seen its latest spec, the mode is effective, the rollout
    is Complete with one revision left (no engine of the other mode still serves) and it is Ready. Else what it is
    still waiting for, in words (for progress output)."""
    cr = api.DisaggregatedInference.model_validate(obj)
    status, generation = cr.status, cr.metadata.get("generation")
    if status is None or status.observed_generation != generation:
        return "the operator to see the change"
    if cr.spec.kv_transfer.mode != mode:
        return f"spec.kvTransfer.mode to be {mode} (it is {cr.spec.kv_transfer.mode})"
    if status.mode != mode:
        return f"the {mode}-mode revision (serving {status.mode})"
    if status.rollout != "Complete" or len(status.revisions) > 1:
        return f"the rollout to complete ({status.rollout}, {len(status.revisions)} revisions)"
    ready = next((c for c in status.conditions if c.type == "Ready"), None)
    if ready is None:
        return "Ready (not reported yet)"
    if ready.status != "True":
        return f"Ready ({ready.reason}: {ready.message})" if ready.message else f"Ready ({ready.reason})"
    return None


def engines_left(obj: dict[str, Any]) -> int:
    """Engine pods the CR's revisions still run (draining ones included), by its status."""
    status = api.DisaggregatedInference.model_validate(obj).status
    if status is None:
        return 0
    return sum(r.prefill.replicas + r.decode.replicas for r in status.revisions)
