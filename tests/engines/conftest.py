"""Real vLLM CPU engines for the data-plane tests: started once per module, pinned one per core.

Engines load the disagg connector plugin from a directory made by the real `disagg install-plugin` (what an
engine pod's init container does) and advertise themselves to the rendezvous; nothing registers on their
behalf.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from disagg.devcluster import tinymodel, vllm_env
from disagg.devcluster.engines import EngineSpec, LocalEngine, LocalRendezvous, install_plugin
from support.engines import PROMPTS, Service, chat, completion, post, text_of

RENDEZVOUS = LocalRendezvous(token="engine-tests-token", deployment="tests", heartbeat=2)


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    return vllm_env.ensure(quiet=True)


@pytest.fixture(scope="session")
def model(vllm_python) -> Path:
    return tinymodel.ensure_model(vllm_python)


@pytest.fixture(scope="session")
def engine_logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("engines")


@pytest.fixture(scope="session")
def reference(vllm_python, model, engine_logs) -> dict[tuple[str, int], str]:
    """Greedy outputs of one plain (non-disaggregated) engine: what every P/D path must reproduce."""
    engine = LocalEngine(EngineSpec("reference", None, model, core=0), vllm_python, engine_logs).start()
    try:
        engine.wait_ready()
        out = {}
        for i, prompt in enumerate(PROMPTS):
            for kind, body, path in (("completion", completion(prompt), "/v1/completions"),
                                     ("chat", chat(prompt), "/v1/chat/completions")):
                status, resp = post(engine.url + path, body)
                assert status == 200, resp
                out[(kind, i)] = text_of(resp)
        return out
    finally:
        engine.stop()


@pytest.fixture(scope="session")
def rendezvous(engine_logs):
    svc = Service("rendezvous", RENDEZVOUS.args(), engine_logs).start()
    yield svc
    svc.stop()


@pytest.fixture(scope="session")
def plugin_dir(tmp_path_factory) -> Path:
    return install_plugin(tmp_path_factory.mktemp("plugin"))


class Pair:
    """A prefill and a decode engine with the plugin, advertising to the rendezvous, and a router in front."""

    def __init__(self, mode: str, python: Path, model: Path, logs: Path, rendezvous: Service, plugin_dir: Path):
        self.mode, self.rendezvous, self.logs = mode, rendezvous, logs
        env = RENDEZVOUS.engine_env(rendezvous.url)
        self.prefill = LocalEngine(EngineSpec(f"{mode}-prefill", "prefill", model, core=0, mode=mode,
                                              plugin_dir=plugin_dir, extra_env=env), python, logs)
        self.decode = LocalEngine(EngineSpec(f"{mode}-decode", "decode", model, core=1, mode=mode,
                                             plugin_dir=plugin_dir, extra_env=env), python, logs)
        self.router: Service | None = None

    def start(self) -> "Pair":
        for e in (self.prefill, self.decode):
            e.start()
        for e in (self.prefill, self.decode):
            e.wait_ready()
        self.router = self.start_router(f"{self.mode}-router", self.mode)
        return self

    def start_router(self, name: str, mode: str, dispatch: str = "concurrent") -> Service:
        router = Service(name, ["router", "--mode", mode, "--dispatch", dispatch, "--rendezvous", self.rendezvous.url,
                                "--request-timeout", "60"], self.logs)
        return router.start(ready_path="/health")

    def stop(self) -> None:
        if self.router:
            self.router.stop()
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
