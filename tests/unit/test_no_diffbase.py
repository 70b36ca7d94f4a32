"""The operator runs kopf with an empty diff base (operator/no_diffbase.py): sound only while no handler needs one."""
from __future__ import annotations

import kopf

from disagg.operator.controller import handlers
from disagg.operator.controller.settings import Settings
from disagg.operator.no_diffbase import NoDiffBase


def test_no_handler_reads_the_diff_base():
    registry = kopf.OperatorRegistry()
    handlers.register(registry, Settings())
    changing = [h.id for h in registry._changing.get_all_handlers()]
    assert changing == [], f"changing handlers need kopf's diff base; the operator runs NoDiffBase: {changing}"
    assert [h.id for h in registry._watching.get_all_handlers()], "the operator's handlers were not registered"


def test_the_empty_diff_base_shows_no_change():
    body = kopf.Body({"metadata": {"name": "m", "annotations": {"a": "b"}}, "spec": {"x": 1}})
    storage = NoDiffBase()
    assert storage.fetch(body=body) is None
    assert storage.build(body=body) == {}
