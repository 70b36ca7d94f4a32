"""The operator's watches are filtered on the server exactly as its handlers filter them (watch_selectors.py)."""
from __future__ import annotations

from typing import Any

import kopf

from disagg.operator import api, names, watch_selectors
from disagg.operator.controller import handlers
from disagg.operator.controller.settings import Settings

MANAGED = f"{names.LABEL_MANAGED_BY}={names.MANAGED_BY}"


def operator_registry() -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    handlers.register(registry, Settings())
    return registry


def test_the_operators_own_watches_ask_only_for_what_its_handlers_take():
    selectors = watch_selectors.derive(operator_registry())
    assert selectors.labels == {
        ("", "v1", "pods"): MANAGED,
        ("apps", "v1", "statefulsets"): MANAGED,
        ("apps", "v1", "deployments"): MANAGED,
        ("", "v1", "services"): MANAGED,
        ("", "v1", "configmaps"): MANAGED,
        ("policy", "v1", "poddisruptionbudgets"): MANAGED,
    }
    # Of the cluster's Events, the StatefulSets' (pod creations) and the FailedMounts (only pods mount volumes),
    # each through its own API group's watch: one resource takes one selector.
    assert selectors.fields == {("", "v1", "events"): "involvedObject.kind=StatefulSet",
                                ("events.k8s.io", "v1", "events"): "reason=FailedMount"}
    cr = (api.GROUP, api.VERSION, api.PLURAL)
    assert cr not in selectors.labels and cr not in selectors.fields, "every CR is ours: its watch is whole"


def _registry(*filters: dict[str, Any]) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    for i, kw in enumerate(filters):
        kopf.on.event("", "v1", "pods", registry=registry, id=f"h{i}", **kw)(lambda **_: None)
    return registry


def test_a_resource_is_filtered_only_when_every_handler_filters_it_the_same():
    same = watch_selectors.derive(_registry({"labels": {"a": "1", "b": "2"}}, {"labels": {"b": "2", "a": "1"}}))
    assert same.labels == {("", "v1", "pods"): "a=1,b=2"}
    # One handler that takes more (another value, no filter, a presence or a callable filter) widens the watch
    # to the whole resource: the server must never drop what some handler would take.
    for other in ({"labels": {"a": "2"}}, {}, {"labels": {"a": kopf.PRESENT}},
                  {"labels": {"a": lambda value, **_: True}}):
        assert watch_selectors.derive(_registry({"labels": {"a": "1"}}, other)).labels == {}, other


def test_field_filters_with_a_value_become_field_selectors():
    selectors = watch_selectors.derive(_registry({"field": "spec.nodeName", "value": "n1"}))
    assert selectors.fields == {("", "v1", "pods"): "spec.nodeName=n1"}
    assert watch_selectors.derive(_registry({"field": "spec.nodeName", "value": "n1"}, {})).fields == {}


def test_configure_sets_kopfs_watch_settings():
    settings = kopf.OperatorSettings()
    handlers.configure_kopf(settings, operator_registry())
    pods = kopf.Resource("", "v1", "pods")
    events = kopf.Resource("", "v1", "events")
    assert settings.watching.label_selectors.collect(pods) == [MANAGED]
    assert settings.watching.field_selectors.collect(events) == ["involvedObject.kind=StatefulSet"]
