"""Two operator replicas with kopf peering: one acts, the other stands by and takes over on a clean stop."""
from __future__ import annotations

import pytest
import yaml
from lightkube import codecs
from lightkube.core.exceptions import ApiError

from disagg.operator import crdgen
from support.dinf import Dinf, create, is_ready, small
from support.kube import watch_until
from support.operator import OperatorProcess

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def peering_crds(cluster):
    for doc in yaml.safe_load_all(crdgen.render_peering()):
        try:
            cluster.client.create(codecs.from_dict(doc))
        except ApiError as e:
            if e.status.code != 409:
                raise
    return True


def test_two_replicas_do_not_fight_and_fail_over(cluster, crd_installed, peering_crds, namespace, tmp_path):
    low = OperatorProcess(cluster.kubeconfig, tmp_path / "low.log", extra=["--peering", "t", "--priority", "10"])
    high = OperatorProcess(cluster.kubeconfig, tmp_path / "high.log", extra=["--peering", "t", "--priority", "20"])
    try:
        high.start()
        high.await_log("Resuming operations")  # kopf starts paused until it has seen the peers
        low.start()
        name = create(cluster, namespace, small("peered"))
        watch_until(cluster, Dinf, name, is_ready, namespace=namespace, timeout=60)
        assert high.metric("disagg_operator_reconciles_total") > 0
        assert low.metric("disagg_operator_reconciles_total") == 0, "the standby replica must not reconcile"

        high.stop()  # a clean stop removes its peering record at once
        low.await_log("Resuming operations after the pause")
        second = create(cluster, namespace, small("after-failover"))
        watch_until(cluster, Dinf, second, is_ready, namespace=namespace, timeout=60)
        assert low.metric("disagg_operator_reconciles_total") > 0
    finally:
        high.stop()
        low.stop()
