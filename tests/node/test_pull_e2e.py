"""A pull-mode DisaggregatedInference on the real node: Ready, its transport verified from the engines' own reports,
and the greedy outputs of a single engine through the router Service. One CR for the module (two engines are
what two cores hold)."""
from __future__ import annotations

import pytest

from support.dinf import Dinf
from support.engines import check_outputs
from support.node import deploy, deployed_kv, transport_verdict

pytestmark = [pytest.mark.cluster, pytest.mark.node, pytest.mark.engines]


@pytest.fixture(scope="module")
def pull(cluster, real_node, operator_release, module_namespace, reference):
    return deploy(cluster, real_node, module_namespace, "tiny-pull", "pull")


def test_pull_is_ready_with_its_transport_verified(cluster, pull):
    assert cluster.client.get(Dinf, pull.name, namespace=pull.namespace).spec["kvTransfer"]["mode"] == "pull"
    verified = transport_verdict(cluster, pull)
    assert (verified["status"], verified["reason"]) == ("True", "TransportMatches"), verified


def test_greedy_outputs_through_the_router_service_equal_a_single_engines(pull, reference):
    check_outputs(pull.router_url, reference, deployed_kv(pull, "pull"))
