"""Fixtures for tests that need the DisaggregatedInference API on the apiserver."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from lightkube import codecs
from lightkube.core.exceptions import ApiError
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.apiextensions_v1 import CustomResourceDefinition

from disagg.operator import api, crdgen
from support.kube import watch_until

CRD_FILE = Path(__file__).resolve().parents[2] / "crds" / crdgen.CRD_FILENAME
ROLE_CRD_FILE = CRD_FILE.with_name(crdgen.ROLE_CRD_FILENAME)

DisaggregatedInference = create_namespaced_resource(api.GROUP, api.VERSION, api.KIND, api.PLURAL)


def _established(crd: CustomResourceDefinition) -> bool:
    return any(c.type == "Established" and c.status == "True" for c in (crd.status.conditions or [])) \
        if crd.status else False


@pytest.fixture(scope="session")
def crd_installed(cluster):
    """The committed CRDs of the API from crds/ (DisaggregatedInference and DisaggregatedRole), created (or
    replaced) on the apiserver and Established.

    Yields the lightkube generic resource class for DisaggregatedInference."""
    for path in (CRD_FILE, ROLE_CRD_FILE):
        crd = codecs.from_dict(yaml.safe_load(path.read_text()))
        name = crd.metadata.name
        try:
            cluster.client.create(crd)
        except ApiError as e:
            if e.status.code != 409:
                raise
            crd.metadata.resourceVersion = cluster.client.get(CustomResourceDefinition, name).metadata.resourceVersion
            cluster.client.replace(crd)
        watch_until(cluster, CustomResourceDefinition, name, _established, timeout=30, what="Established")
    yield DisaggregatedInference


# -- a real rendezvous for rollouts, and a stand-in for the engines that would advertise in it ----------------
ROLLOUT_TOKEN = "rollout-test-token"


@pytest.fixture(scope="module")
def rendezvous(tmp_path_factory):
    """A real `disagg rendezvous` the operator reads for every CR (`operator_args`): a rollout drains old engines
    only once new ones are advertised there."""
    from support.engines import Service

    svc = Service("rendezvous", ["rendezvous", "--auth", "token", "--token", ROLLOUT_TOKEN,
                                 "--heartbeat-seconds", "1"], tmp_path_factory.mktemp("rendezvous")).start()
    svc.operator_args = ["--rendezvous-url-template", svc.url, "--transport-poll-seconds", "1"]
    yield svc
    svc.stop()


@pytest.fixture
def advertised(cluster, namespace, rendezvous):
    """Every Ready engine pod of the test's namespace advertised in `rendezvous` (support/advertiser.py: a fake)."""
    from support.advertiser import StandInAdvertiser

    adv = StandInAdvertiser(cluster.kubeconfig, namespace, rendezvous.url, ROLLOUT_TOKEN).start()
    yield adv
    adv.stop()
