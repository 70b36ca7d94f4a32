"""Real vLLM CPU engines for the data-plane tests: started once per module, pinned one per core.

Until the connector plugin advertises engines itself, the harness registers each engine's advertisement
with the rendezvous on its behalf, with the identity the engine really runs with.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from disagg.connector.advertisement import EngineAdvertisement
from disagg.connector.rendezvous_client import EngineRegistration, RendezvousClient
from disagg.devcluster import tinymodel, vllm_env
from disagg.devcluster.engines import EngineSpec, LocalEngine
from support.engines import PROMPTS, Service, chat, completion, post, text_of

TOKEN = "engine-tests-token"
LAYOUT = "tiny-bf16-128"

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
    svc = Service("rendezvous", ["rendezvous", "--auth", "token", "--token", TOKEN, "--heartbeat-seconds", "2",
                                 "--deployment", "tests"], engine_logs).start()
    yield svc
    svc.stop()


def advertise(engine: LocalEngine, mode: str) -> EngineAdvertisement:
    s = engine.spec
    return EngineAdvertisement(role=s.role, engine_id=s.engine_id, deployment="tests", pod_name=s.name,
                               http_url=engine.url, side_channel_host="127.0.0.1",
                               side_channel_ports=[s.side_channel_port], tp_size=1, pp_size=1, dp_size=1,
                               block_size=s.block_size, layout_key=LAYOUT, kv_mode=mode, transport="UCX",
                               lease_seconds=10)


class Pair:
    """A prefill and a decode engine, their registrations, and a router in front of them."""

    def __init__(self, mode: str, python: Path, model: Path, logs: Path, rendezvous: Service):
        self.mode, self.rendezvous, self.logs = mode, rendezvous, logs
        self.prefill = LocalEngine(EngineSpec(f"{mode}-prefill", "prefill", model, core=0, mode=mode), python, logs)
        self.decode = LocalEngine(EngineSpec(f"{mode}-decode", "decode", model, core=1, mode=mode), python, logs)
        self.registrations: dict[str, EngineRegistration] = {}
        self.router: Service | None = None

    def register(self, engine: LocalEngine) -> None:
        old = self.registrations.pop(engine.spec.role, None)
        if old is not None:
            old.stop_thread(deregister=True)
        reg = EngineRegistration(None, advertise(engine, self.mode), heartbeat_seconds=2,
                                 client_factory=lambda: RendezvousClient(self.rendezvous.url, token=TOKEN))
        reg.start_thread()
        self.registrations[engine.spec.role] = reg

    def start(self) -> "Pair":
        for e in (self.prefill, self.decode):
            e.start()
        for e in (self.prefill, self.decode):
            e.wait_ready()
            self.register(e)
        self.router = self.start_router(f"{self.mode}-router", self.mode)
        return self

    def start_router(self, name: str, mode: str, dispatch: str = "concurrent") -> Service:
        router = Service(name, ["router", "--mode", mode, "--dispatch", dispatch, "--rendezvous", self.rendezvous.url,
                                "--request-timeout", "60"], self.logs)
        return router.start(ready_path="/health")

    def stop(self) -> None:
        for reg in self.registrations.values():
            reg.stop_thread(deregister=True)
        if self.router:
            self.router.stop()
        for e in (self.prefill, self.decode):
            e.stop()


@pytest.fixture(scope="module")
def push_pair(vllm_python, model, engine_logs, rendezvous, reference):
    pair = Pair("push", vllm_python, model, engine_logs, rendezvous)
    try:
        yield pair.start()
    finally:
        pair.stop()


@pytest.fixture(scope="module")
def pull_pair(vllm_python, model, engine_logs, rendezvous, reference):
    pair = Pair("pull", vllm_python, model, engine_logs, rendezvous)
    try:
        yield pair.start()
    finally:
        pair.stop()
