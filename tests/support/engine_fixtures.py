"""The real vLLM CPU engines every data-plane suite shares (tests/engines, tests/node): the environment, the tiny
model, and the greedy outputs of one plain engine that every P/D path must reproduce.

Invariant: a core runs at most one engine at any time (`TestEngine.start` refuses a second). A vLLM CPU engine
computes on its pinned core and its NIXL progress thread spins there too, so two engines on one core starve
each other past any start-up deadline (on a fresh 2-core CI machine four engines at once left a decode
unhealthy after 240 s). The session's plain `reference` engine stops before any module's engines start (every
engine fixture depends on it).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from disagg.devcluster import tinymodel, vllm_env
from disagg.devcluster.engines import EngineSpec, LocalEngine
from support.engines import PROMPTS, chat, completion, post, text_of


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
