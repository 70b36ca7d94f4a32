"""Real vLLM CPU engines for the data-plane tests: started once per module, pinned one per core.

Engines load the disagg connector plugin from a directory made by the real `disagg install-plugin` (what an
engine pod's init container does) and advertise themselves to the rendezvous; nothing registers on their
behalf.

Invariant: a core runs at most one engine at any time (`TestEngine.start` refuses a second). A vLLM CPU engine
computes on its pinned core and its NIXL progress thread spins there too, so two engines on one core starve
each other past any start-up deadline (on a fresh 2-core CI machine four engines at once left a decode
unhealthy after 240 s). Hence each module owns at most one engine per core and stops them before the next
module starts its own (module-scoped fixtures), and the session's plain `reference` engine stops before any
module's engines start (every engine fixture depends on it).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from disagg.devcluster import tinymodel, vllm_env
from disagg.devcluster.engines import EngineSpec, LocalEngine, LocalRendezvous, install_plugin
from support.engines import PROMPTS, Service, chat, completion, post, text_of

RENDEZVOUS = LocalRendezvous(token="engine-tests-token", deployment="tests", heartbeat=2)


class TestEngine(LocalEngine):
    """A LocalEngine that refuses to start on a core another running engine of this session holds."""

    __test__ = False
    running: list[TestEngine] = []

    def start(self) -> TestEngine:
        TestEngine.running = [e for e in TestEngine.running if e.proc is not None and e.proc.poll() is None]
        busy = [e.spec.name for e in TestEngine.running if e.spec.core == self.spec.core and e is not self]
        assert not busy, f"core {self.spec.core} already runs engine(s) {busy}; cannot start {self.spec.name}"
        super().start()
        TestEngine.running.append(self)
        return self


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
    engine = TestEngine(EngineSpec("reference", None, model, core=0), vllm_python, engine_logs).start()
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
