"""spec.autoscaling: off unless set, every range checked (min <= max, in the model and by the apiserver's CEL rule),
and scale to zero only when asked for."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from disagg.operator import api, crdgen

MINIMAL = {"model": {"name": "m"}, "accelerator": {"profile": "cpu"}}


def spec(**autoscaling: object) -> api.DisaggregatedInferenceSpec:
    return api.DisaggregatedInferenceSpec.model_validate({**MINIMAL, "autoscaling": autoscaling})


def test_autoscaling_is_off_unless_set():
    assert api.DisaggregatedInferenceSpec.model_validate(MINIMAL).autoscaling is None
    schema = crdgen.openapi_schema()["properties"]["spec"]["properties"]
    assert "default" not in schema["autoscaling"], "a default would turn the planner on for every CR"


def test_only_the_maxima_are_required_and_the_rest_defaults():
    a = spec(prefill={"maxReplicas": 4}, decode={"maxReplicas": 8}).autoscaling
    assert a is not None
    assert (a.prefill.min_replicas, a.prefill.max_replicas) == (1, 4)
    assert (a.decode.min_replicas, a.decode.max_replicas) == (1, 8)
    assert a.prefill.input_tokens_per_second is None and a.decode.output_tokens_per_second is None
    assert (a.slo.percentile, a.slo.ttft_milliseconds, a.slo.tpot_milliseconds) == (90, 1000, 100)
    assert (a.scale_up.max_step, a.scale_up.cooldown_seconds) == (4, 30)
    assert (a.scale_down.max_step, a.scale_down.cooldown_seconds, a.scale_down.utilization) == (1, 300, 0.7)
    assert a.scale_to_zero is None
    with pytest.raises(ValidationError, match="maxReplicas"):
        spec(prefill={"minReplicas": 1}, decode={"maxReplicas": 8})


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_min_above_max_is_refused_by_the_model_and_by_the_apiserver(role):
    other = "decode" if role == "prefill" else "prefill"
    with pytest.raises(ValidationError, match="minReplicas 5 exceeds maxReplicas 4"):
        spec(**{role: {"minReplicas": 5, "maxReplicas": 4}, other: {"maxReplicas": 1}})
    assert spec(**{role: {"minReplicas": 4, "maxReplicas": 4}, other: {"maxReplicas": 1}}).autoscaling is not None
    node = crdgen.openapi_schema()["properties"]["spec"]["properties"]["autoscaling"]["properties"][role]
    assert {"rule": "self.minReplicas <= self.maxReplicas", "fieldPath": ".minReplicas",
            "messageExpression": '"minReplicas %d exceeds maxReplicas %d".format([self.minReplicas, '
                                 'self.maxReplicas])'} in node["x-kubernetes-validations"]


@pytest.mark.parametrize("bad", [
    {"prefill": {"minReplicas": 0, "maxReplicas": 1}},  # a role at 0 alone serves nothing
    {"slo": {"percentile": 100}},
    {"slo": {"ttftMilliseconds": 0}},
    {"scaleUp": {"maxStep": 0}},
    {"scaleDown": {"utilization": 1.0}},
    {"scaleToZero": {"idleSeconds": 10}},
])
def test_out_of_range_values_are_refused(bad):
    base = {"prefill": {"maxReplicas": 2}, "decode": {"maxReplicas": 2}}
    with pytest.raises(ValidationError):
        spec(**{**base, **bad})


def test_scale_to_zero_is_on_once_its_object_is_set():
    a = spec(prefill={"maxReplicas": 2}, decode={"maxReplicas": 2}, scaleToZero={}).autoscaling
    assert a is not None and a.scale_to_zero is not None and a.scale_to_zero.idle_seconds == 900
