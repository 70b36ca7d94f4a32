"""The plugin's NIXL progress-thread delay window (connector/plugin/nixl_progress.py).

NIXL itself is not installed in the operator's environment, so these tests give the window a fake `nixl._api`
(named as such: a module with the one binding the window wraps). The real agent is covered by the engine suite,
which checks that an idle engine stops spinning a core.
"""
from __future__ import annotations

import logging
import sys
import types

import pytest

from disagg.connector.plugin.nixl_progress import delay_from_env, progress_delay
from disagg.connector.wire import env as wire_env


class FakeAgentConfig:
    def __init__(self) -> None:
        self.pthrDelay = 0  # noqa: N815 - NIXL's name


def fake_nixl_api(monkeypatch: pytest.MonkeyPatch, name: str = "fake_nixl_api") -> types.SimpleNamespace:
    """A fake `nixl._api`: its `nixl_agent` builds a config with pthrDelay 0 and passes it to `nixlBind`, as
    NIXL 1.5's does; `created` records the delay each agent got."""
    created: list[int] = []
    bindings = types.SimpleNamespace(nixlAgentConfig=FakeAgentConfig,
                                     nixlAgent=lambda agent, cfg: created.append(cfg.pthrDelay) or agent)
    api = types.ModuleType(name)
    api.nixlBind = bindings  # type: ignore[attr-defined]

    def nixl_agent(agent: str) -> object:
        cfg = api.nixlBind.nixlAgentConfig()  # type: ignore[attr-defined]
        cfg.pthrDelay = 0
        return api.nixlBind.nixlAgent(agent, cfg)  # type: ignore[attr-defined]

    api.nixl_agent = nixl_agent  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, name, api)
    return types.SimpleNamespace(api=api, bindings=bindings, created=created)


def test_agents_created_inside_the_window_get_the_delay_and_the_module_is_restored(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fake = fake_nixl_api(monkeypatch)
    with progress_delay(1000, module="fake_nixl_api"):
        fake.api.nixl_agent("a")
        assert fake.api.nixlBind is not fake.bindings
        assert fake.api.nixlBind.nixlAgentConfig is FakeAgentConfig  # everything else passes through
    fake.api.nixl_agent("b")
    assert fake.created == [1000, 0]
    assert fake.api.nixlBind is fake.bindings


def test_the_module_is_restored_when_the_block_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = fake_nixl_api(monkeypatch)
    with pytest.raises(RuntimeError), progress_delay(5, module="fake_nixl_api"):
        raise RuntimeError("vLLM's connector failed to start")
    assert fake.api.nixlBind is fake.bindings


def test_no_delay_leaves_nixl_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = fake_nixl_api(monkeypatch)
    with progress_delay(None, module="fake_nixl_api"):
        assert fake.api.nixlBind is fake.bindings
        fake.api.nixl_agent("a")
    assert fake.created == [0]


def test_a_nixl_without_the_binding_gets_a_warning_not_a_failure(monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "fake_nixl_other", types.ModuleType("fake_nixl_other"))
    with caplog.at_level(logging.WARNING, "disagg.plugin"), progress_delay(1000, module="fake_nixl_other"):
        pass
    with caplog.at_level(logging.WARNING, "disagg.plugin"), progress_delay(1000, module="no_such_nixl_module"):
        pass
    assert len([r for r in caplog.records if "progress-thread delay" in r.getMessage()]) == 2


@pytest.mark.parametrize(("raw", "expected"), [
    (None, None), ("", None), (" ", None), ("0", 0), ("1000", 1000), (" 250 ", 250),
    ("1ms", None), ("-1", None), ("1.5", None),
])
def test_delay_from_env(raw: str | None, expected: int | None) -> None:
    env = {} if raw is None else {wire_env.NIXL_PROGRESS_DELAY_US: raw}
    assert delay_from_env(env) == expected
