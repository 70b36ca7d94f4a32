"""disagg_operator_condition: one series per CR, condition and status, 1 for the status it has; nothing left of a
CR the operator forgot."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from disagg.operator.api import Condition
from disagg.operator.condition_metrics import ConditionStates


def cond(ctype: str, status: str) -> Condition:
    return Condition(type=ctype, status=status, reason="R", message="", last_transition_time="2026-12-07T00:00:00Z")


def test_each_condition_is_one_for_its_status_and_a_forgotten_cr_leaves_nothing():
    states, registry = ConditionStates(), CollectorRegistry()
    registry.register(states)
    states.record("ns", "a", [cond("Ready", "True"), cond("TransportVerified", "False")])
    states.record("ns", "b", [cond("Ready", "Unknown")])
    get = registry.get_sample_value
    assert get("disagg_operator_condition", {"namespace": "ns", "name": "a", "type": "Ready", "status": "True"}) == 1
    assert get("disagg_operator_condition", {"namespace": "ns", "name": "a", "type": "Ready", "status": "False"}) == 0
    assert get("disagg_operator_condition",
               {"namespace": "ns", "name": "a", "type": "TransportVerified", "status": "False"}) == 1
    assert get("disagg_operator_condition",
               {"namespace": "ns", "name": "b", "type": "Ready", "status": "Unknown"}) == 1
    states.record("ns", "a", [cond("Ready", "False")])  # the last status replaces the one before, whole
    assert get("disagg_operator_condition", {"namespace": "ns", "name": "a", "type": "Ready", "status": "False"}) == 1
    assert get("disagg_operator_condition",
               {"namespace": "ns", "name": "a", "type": "TransportVerified", "status": "False"}) is None
    states.forget("ns", "a")
    states.forget("ns", "b")
    assert b'name="a"' not in generate_latest(registry) and b'name="b"' not in generate_latest(registry)
