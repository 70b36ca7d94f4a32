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

from disagg.devcluster.engines import EngineSpec, LocalRendezvous, install_plugin
from support.engine_fixtures import TestEngine
from support.engines import Service

RENDEZVOUS = LocalRendezvous(token="engine-tests-token", deployment="tests", heartbeat=2)


@pytest.fixture(scope="session")
def rendezvous(engine_logs):
    svc = Service("rendezvous", RENDEZVOUS.args(), engine_logs).start()
    yield svc
    svc.stop()


@pytest.fixture(scope="session")
def plugin_dir(tmp_path_factory) -> Path:
    return install_plugin(tmp_path_factory.mktemp("plugin"))


class Pair:
    """A prefill engine on core 0 and a decode engine on core 1, each with the plugin and advertising to the
    rendezvous, and a router in front. The engines' modes may differ (`decode_mode`): such a pair is never
    paired, which is what its test shows."""

    def __init__(self, mode: str, python: Path, model: Path, logs: Path, rendezvous: Service, plugin_dir: Path,
                 decode_mode: str | None = None, name: str | None = None):
        self.mode, self.rendezvous, self.logs = mode, rendezvous, logs
        prefix = f"{name}-" if name else ""
        self.decode_mode = decode_mode or mode
        env = RENDEZVOUS.engine_env(rendezvous.url)
        self.prefill = TestEngine(EngineSpec(f"{prefix}{mode}-prefill", "prefill", model, core=0, mode=mode,
                                             plugin_dir=plugin_dir, extra_env=env), python, logs)
        self.decode = TestEngine(EngineSpec(f"{prefix}{self.decode_mode}-decode", "decode", model, core=1,
                                            mode=self.decode_mode, plugin_dir=plugin_dir, extra_env=env), python, logs)
        self.router: Service | None = None
        self.routers: list[Service] = []

    def start(self) -> Pair:
        for e in (self.prefill, self.decode):
            e.start()
        for e in (self.prefill, self.decode):
            e.wait_ready()
        self.router = self.start_router(f"{self.prefill.spec.name.removesuffix('-prefill')}-router", self.mode)
        return self

    def start_router(self, name: str, mode: str, dispatch: str = "concurrent") -> Service:
        router = Service(name, ["router", "--mode", mode, "--dispatch", dispatch, "--rendezvous", self.rendezvous.url,
                                "--request-timeout", "60"], self.logs)
        self.routers.append(router)
        return router.start(ready_path="/health")

    def replace_decode(self, **spec: object) -> TestEngine:
        """Stop the decode engine and start another on its core, its spec changed by `spec` (name, mode, ...)."""
        old = self.decode
        old.stop()
        fields = {**vars(old.spec), "port": 0, "side_channel_port": 0, "engine_id": "", **spec}
        self.decode = TestEngine(EngineSpec(**fields), old.python, self.logs)
        self.decode.start().wait_ready()
        return self.decode

    def stop(self) -> None:
        for router in self.routers:
            router.stop()
        for e in (self.prefill, self.decode):
            e.stop()


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
