"""Session fixtures. The local control plane starts once per test session; DISAGG_TEST_KUBECONFIG points
the same tests at an existing cluster (kind, EKS) instead."""
from __future__ import annotations

import os
import shutil
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import settings
from lightkube import Client, KubeConfig
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Namespace

sys.path.insert(0, str(Path(__file__).parent))  # tests/support

# The real-engine fixtures (the vLLM environment, the tiny model, a plain engine's reference outputs) serve both
# tests/engines and tests/node.
pytest_plugins = ["support.engine_fixtures"]

# Property tests run on every landing, so by default they are reproducible: derandomized (the same examples on
# every run, from each test's own seed), no example database, no deadline (2 shared cores make timings noise).
# HYPOTHESIS_PROFILE=explore searches with fresh random examples, ten times as many, and remembers failures.
settings.register_profile("ci", derandomize=True, database=None, deadline=None, max_examples=150, print_blob=True)
settings.register_profile("explore", deadline=None, max_examples=1500, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@dataclass
class TestCluster:
    kubeconfig: Path
    client: Client
    local: object | None  # LocalCluster when we started it


@pytest.fixture(scope="session")
def cluster():
    existing = os.environ.get("DISAGG_TEST_KUBECONFIG")
    if existing:
        yield TestCluster(Path(existing), Client(KubeConfig.from_file(existing)), None)
        return
    from disagg.devcluster import build
    from disagg.devcluster.cluster import ClusterConfig, LocalCluster

    build.ensure_built(quiet=True)
    # One cluster per session, named by pid, so two test runs on one machine never share or wipe state.
    local = LocalCluster(ClusterConfig(name=f"pytest-{os.getpid()}"))
    local.start(progress=lambda m: print(m, file=sys.stderr, flush=True))
    try:
        yield TestCluster(local.kubeconfig, local.client(), local)
    finally:
        local.stop()
        shutil.rmtree(local.dir, ignore_errors=True)


@pytest.fixture
def namespace(cluster):
    """A fresh namespace per test, deleted afterwards (its pods free their node resources)."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    cluster.client.create(Namespace(metadata=ObjectMeta(name=name)))
    yield name
    cluster.client.delete(Namespace, name)
    # Wait until it is gone so its pods' GPUs and EFA devices are free for the next test.
    from support.kube import watch_until
    watch_until(cluster, Namespace, name, lambda ns: False, timeout=120, what="deleted", gone_ok=True)
    # The rendezvous ClusterRoleBindings of its CRs are cluster-scoped: an operator that stopped before its CRs
    # went leaves them behind (its next resync would remove them). Tests may share a real cluster.
    from lightkube.core.exceptions import ApiError
    from lightkube.resources.rbac_authorization_v1 import ClusterRoleBinding
    for binding in cluster.client.list(ClusterRoleBinding, labels={"serving.disagg.io/namespace": name}):
        try:
            cluster.client.delete(ClusterRoleBinding, binding.metadata.name)
        except ApiError as e:
            if e.status.code != 404:  # an operator removed it meanwhile
                raise
