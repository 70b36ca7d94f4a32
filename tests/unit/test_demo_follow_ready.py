"""Waiting for the demo's CR to turn Ready (devcluster/demo_node.py `follow_ready`): a Degraded condition that the
kubelet's next try clears is waited out; one that holds fails, naming its reason.

The CR's states come from `ScriptedClient`, a fake API client that returns a scripted sequence of the CR's
status: a transient FailedMount (the node authorizer's graph not yet knowing a new pod's PersistentVolumeClaim) is a
race that cannot be produced on demand on a real cluster."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from disagg.devcluster import demo_node
from disagg.devcluster.demo_engines import DemoFailed

MOUNT = {"type": "Degraded", "status": "True", "reason": "FailedMount",
         "message": 'persistentvolumeclaims "disagg-models" is forbidden: no relationship found between node '
                    "'disagg-node' and this object"}
NOT_READY = {"type": "Ready", "status": "False", "reason": "Progressing", "message": ""}
READY = {"type": "Ready", "status": "True", "reason": "Ready", "message": ""}
HEALTHY = {"type": "Degraded", "status": "False", "reason": "AsExpected", "message": ""}


class ScriptedClient:
    """A fake: each `get` of the CR returns the next scripted conditions (the last one from then on)."""

    def __init__(self, *states: list[dict[str, Any]]) -> None:
        self.states, self.gets = list(states), 0

    def get(self, _kind: Any, _name: str, namespace: str) -> Any:
        conditions = self.states[min(self.gets, len(self.states) - 1)]
        self.gets += 1
        return SimpleNamespace(status={"conditions": conditions, "observedGeneration": 1},
                               metadata=SimpleNamespace(generation=1))

    def list(self, *_args: Any, **_kwargs: Any) -> list[Any]:
        return []


def test_a_failed_mount_the_kubelet_retries_away_is_waited_out(monkeypatch):
    monkeypatch.setattr(demo_node, "DEGRADED_GRACE", 3.0)
    client = ScriptedClient([NOT_READY, MOUNT], [NOT_READY, HEALTHY], [READY, HEALTHY])
    demo_node.follow_ready(client, "tiny-push", timeout=30)  # type: ignore[arg-type]
    assert client.gets == 3


def test_a_degraded_condition_that_holds_fails_naming_its_reason(monkeypatch):
    monkeypatch.setattr(demo_node, "DEGRADED_GRACE", 1.0)
    client = ScriptedClient([NOT_READY, MOUNT])
    with pytest.raises(DemoFailed, match=r"tiny-push is Degraded \(FailedMount\): .*no relationship found"):
        demo_node.follow_ready(client, "tiny-push", timeout=30)  # type: ignore[arg-type]
    assert client.gets == 2  # given its grace, and no more
