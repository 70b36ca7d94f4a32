"""Engine EMULATORS as local processes (`disagg emulator`), started as the operator starts one in a pod, minus the
pod: the same engine env (identity, rendezvous), its own ports. For the benchmarks and tests at fleet size.

They are not engines (connector/emulator/): they need no core of their own and no lock, and start in about a
second. Each dies with its parent.
"""
from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from disagg.connector.wire import env as wire_env

from .cluster import free_port
from .procs import DisaggService


@dataclass
class EmulatorSpec:
    name: str
    role: str
    mode: str = "push"
    profile: str = "cpu-kv64k"
    rendezvous_env: dict[str, str] = field(default_factory=dict)
    """What points it at a rendezvous (devcluster.engines.LocalRendezvous.engine_env), empty for none."""
    flags: list[str] = field(default_factory=list)
    """More `disagg emulator` flags (--kv-cache-blocks, --registration-timeout, ...)."""
    kv_events: bool = True


class LocalEmulator:
    def __init__(self, spec: EmulatorSpec, log_dir: Path) -> None:
        self.spec = spec
        self.log_dir = log_dir
        self.side_channel_port = free_port()
        self.kv_events_port = free_port() if spec.kv_events else 0
        self.kv_events_replay_port = free_port() if spec.kv_events else 0
        self.engine_id = ""
        self.service: DisaggService | None = None

    @property
    def url(self) -> str:
        assert self.service is not None, "start() first"
        return self.service.url

    def start(self) -> LocalEmulator:
        s = self.spec
        # A fresh engine id per start, as a pod's incarnation has.
        self.engine_id = f"{s.name}-{uuid.uuid4().hex[:12]}"
        args = ["emulator", "--profile", s.profile, "--role", s.role, "--kv-mode", s.mode,
                "--side-channel-port", str(self.side_channel_port),
                "--kv-events-port", str(self.kv_events_port),
                "--kv-events-replay-port", str(self.kv_events_replay_port),
                *s.flags]
        port = self.service.port if self.service is not None else None
        self.service = DisaggService(s.name, args, self.log_dir, port=port)
        self.service.env = {**os.environ, **s.rendezvous_env, wire_env.ENGINE_ID: self.engine_id,
                            wire_env.SIDE_CHANNEL_HOST: "127.0.0.1"}
        self.service.start()
        return self

    def wait_ready(self, timeout: float = 30) -> LocalEmulator:
        assert self.service is not None
        self.service.wait_http(self.url + "/health", timeout)
        return self

    def pid(self) -> int | None:
        return None if self.service is None or self.service.popen is None else self.service.popen.pid

    def stop(self, grace: float = 10.0) -> None:
        if self.service is not None:
            self.service.stop(grace)

    def kill(self) -> None:
        if self.service is not None:
            self.service.kill()
