"""A prefill and a decode engine with the plugin, advertising to one rendezvous, and routers in front: the pair every
data-plane test module starts once (tests/engines/conftest.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from disagg.devcluster.engines import EngineSpec, LocalRendezvous
from support.engine_fixtures import TestEngine
from support.engines import Service

RENDEZVOUS = LocalRendezvous(token="engine-tests-token", deployment="tests", heartbeat=2)


class Pair:
    """A prefill engine on core 0 and a decode engine on core 1, each with the plugin and advertising to the
    rendezvous, and a router in front. The engines' modes may differ (`decode_mode`): such a pair is never
    paired, which is what its test shows."""

    def __init__(self, mode: str, python: Path, model: Path, logs: Path, rendezvous: Service, plugin_dir: Path,
                 decode_mode: str | None = None, name: str | None = None, access_log: Path | None = None,
                 router_args: tuple[str, ...] = (), **spec: Any):
        """`spec`: more EngineSpec fields for both engines (num_blocks, max_model_len, extra_env, ...);
        `access_log`: where the routers write theirs; `router_args`: more flags for every router."""
        self.mode, self.rendezvous, self.logs, self.access_log = mode, rendezvous, logs, access_log
        self.router_args = router_args
        prefix = f"{name}-" if name else ""
        self.decode_mode = decode_mode or mode
        env = {**RENDEZVOUS.engine_env(rendezvous.url), **spec.pop("extra_env", {})}
        self.prefill = TestEngine(EngineSpec(f"{prefix}{mode}-prefill", "prefill", model, core=0, mode=mode,
                                             plugin_dir=plugin_dir, extra_env=env, **spec), python, logs)
        self.decode = TestEngine(EngineSpec(f"{prefix}{self.decode_mode}-decode", "decode", model, core=1,
                                            mode=self.decode_mode, plugin_dir=plugin_dir, extra_env=env, **spec),
                                 python, logs)
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
                                "--request-timeout", "60",
                                *(["--access-log", str(self.access_log)] if self.access_log else []),
                                *self.router_args], self.logs)
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
