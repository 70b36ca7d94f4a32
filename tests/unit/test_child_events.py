"""Which pass a child's watch event asks for (controller/handlers.child_event_pass)."""
from __future__ import annotations

import kopf
import pytest

from disagg.operator.controller import handlers
from disagg.operator.controller.settings import Settings


@pytest.mark.parametrize("kind", sorted(handlers.CHILD_KINDS))
def test_a_child_changed_under_us_gets_a_full_pass(kind):
    assert handlers.child_event_pass(kind, changed=True) is True


def test_an_echo_refreshes_status_only_for_the_kinds_status_reads():
    passes = {kind: handlers.child_event_pass(kind, changed=False) for kind in handlers.CHILD_KINDS}
    assert passes == {"StatefulSet": False, "Deployment": False, "Service": None, "ConfigMap": None,
                      "PodDisruptionBudget": None}


def test_every_child_kind_the_operator_indexes_for_status_refreshes_it():
    """Status reads children only through kopf indexes: a child kind with one must be a status kind, or its
    status changes would never reach the CR."""
    registry = kopf.OperatorRegistry()
    handlers.register(registry, Settings())
    plurals = {plural: kind for kind, (_g, _v, plural) in handlers.CHILD_KINDS.items()}
    indexed = {plurals[h.selector.any_name] for h in registry._indexing.get_all_handlers()
               if h.selector is not None and h.selector.any_name in plurals}
    assert indexed and indexed <= handlers.STATUS_KINDS
