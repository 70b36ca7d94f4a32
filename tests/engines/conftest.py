"""Real vLLM CPU engines for the data-plane tests: started once per module, pinned one per core.

Engines load the disagg connector plugin from a directory made by the real `disagg install-plugin` (what an
engine pod's init container does) and advertise themselves to the rendezvous; nothing registers on their
behalf.

Each module owns at most one engine per core and stops them before the next module starts its own
(module-scoped fixtures); the shared fixtures and the one-engine-per-core invariant are in
support/engine_fixtures.py.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from disagg.devcluster.engines import install_plugin
from support.engine_pair import RENDEZVOUS, Pair
from support.engines import Service


@pytest.fixture(scope="session")
def rendezvous(engine_logs):
    svc = Service("rendezvous", RENDEZVOUS.args(), engine_logs).start()
    yield svc
    svc.stop()


@pytest.fixture(scope="session")
def plugin_dir(tmp_path_factory) -> Path:
    return install_plugin(tmp_path_factory.mktemp("plugin"))


@pytest.fixture(scope="module")
def push_pair(vllm_python, model, engine_logs, rendezvous, reference, plugin_dir):
    pair = Pair("push", vllm_python, model, engine_logs, rendezvous, plugin_dir)
    try:
        yield pair.start()
    finally:
        pair.stop()


@pytest.fixture(scope="module")
def pull_pair(vllm_python, model, engine_logs, rendezvous, reference, plugin_dir):
    pair = Pair("pull", vllm_python, model, engine_logs, rendezvous, plugin_dir)
    try:
        yield pair.start()
    finally:
        pair.stop()


@pytest.fixture(scope="module")
def mixed_pair(vllm_python, model, engine_logs, rendezvous, reference, plugin_dir):
    """A push prefill and a pull decode, with a push router (`routers[0]`) and a pull router (`routers[1]`)."""
    pair = Pair("push", vllm_python, model, engine_logs, rendezvous, plugin_dir, decode_mode="pull", name="mixed")
    try:
        pair.start()
        pair.start_router("mixed-pull-router", "pull")
        yield pair
    finally:
        pair.stop()
