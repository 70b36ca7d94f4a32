"""The DisaggregatedRole API (serving.disagg.io/v1alpha1): one role's engine count, with a /scale subresource.

A CRD can have only one scale subresource, and a DisaggregatedInference has two roles to scale, so each role gets
an object of its own (as LWS's DisaggregatedSetRoleScaler and Dynamo's DynamoGraphDeploymentScalingAdapter do):
`<cr>-prefill` and `<cr>-decode`, created by the operator and owned by the DisaggregatedInference. `kubectl
scale`, an HPA or KEDA write its spec.replicas through /scale; the operator runs the role at that count
(operator/scale/ decides which count wins). `crdgen.py` turns these models into the CRD, like `api.py`'s.
"""
from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field

from disagg.connector.wire.advertisement import Role

from .api import GROUP, MAX_ENGINE_REPLICAS, NAME_LIMIT, VERSION, Model, _cel, _validations

KIND = "DisaggregatedRole"
PLURAL = "disaggregatedroles"
SINGULAR = "disaggregatedrole"
SHORT_NAMES = ["drole"]

SPEC_REPLICAS_ANNOTATION = "serving.disagg.io/spec-replicas"
"""On a DisaggregatedRole: the DisaggregatedInference's spec.<role>.replicas as the operator last copied it into
spec.replicas, written in the same request as the count it came with."""

_IMMUTABLE = "self == oldSelf"


class DisaggregatedRoleSpec(Model):
    """One role's desired engine count, and whose role it is."""

    deployment: str = Field(min_length=1, max_length=NAME_LIMIT.length, json_schema_extra=_validations(
        _cel(_IMMUTABLE, "deployment is immutable: a DisaggregatedRole belongs to one DisaggregatedInference")))
    """The DisaggregatedInference (in the same namespace) whose role this is. Set by the operator; immutable."""
    role: Role = Field(json_schema_extra=_validations(
        _cel(_IMMUTABLE, "role is immutable: a DisaggregatedRole scales one role")))
    """The role this object scales: prefill or decode. Set by the operator; immutable."""
    replicas: int = Field(ge=0, le=MAX_ENGINE_REPLICAS)
    """The role's desired engine count: what `kubectl scale`, an HPA or KEDA set through the /scale subresource.
    The operator runs the role at this count through its rollout (a scale-up adds engines and counts them once
    they are Ready and advertised; a scale-down withdraws engines from the rendezvous and lets them drain before
    their pods go). It starts at the DisaggregatedInference's spec.<role>.replicas (1 when that is unset), and the
    operator copies spec.<role>.replicas here again only when it changes: applying the same manifest again keeps
    this count. 0 stops the role's engines, and the deployment serves nothing until both roles have some."""


class DisaggregatedRoleStatus(Model):
    """The role as the operator last observed it."""

    observed_generation: int | None = None
    """The .metadata.generation (so the spec.replicas) the operator last acted on."""
    replicas: int = 0
    """Engine pods of this role, in every revision, draining ones included: the current count /scale reports."""
    ready_replicas: int = 0
    """Engines of this role that are Ready and not withdrawn from the rendezvous, in every revision."""
    selector: str = ""
    """The label selector of this role's engine pods in every revision (/scale's status.selector): the pods an HPA
    averages its resource metrics over."""


ROLE_NAME_RULE = _cel("self.metadata.name == self.spec.deployment + '-' + self.spec.role",
                      "a DisaggregatedRole must be named <spec.deployment>-<spec.role>, e.g. qwen3-32b-decode")
"""On the root: the name the operator gives each role object, so `kubectl scale drole/<cr>-<role>` finds it."""


class DisaggregatedRole(Model):
    """One role (prefill or decode) of a DisaggregatedInference: its engine count, scalable through /scale by
    `kubectl scale`, an HPA or KEDA. Created by the operator as <cr>-prefill and <cr>-decode, owned by the
    DisaggregatedInference (deleted with it)."""

    model_config = ConfigDict(extra="ignore", json_schema_extra=_validations(ROLE_NAME_RULE))
    api_version: str = f"{GROUP}/{VERSION}"
    """APIVersion of this object."""
    kind: str = KIND
    """Kind of this object."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """Standard object metadata."""
    spec: DisaggregatedRoleSpec
    """The role and its desired engine count."""
    status: DisaggregatedRoleStatus | None = None
    """Observed state, written by the operator."""
