"""Real vLLM CPU engines on this machine: one process per engine, pinned to a core, serving the tiny model.

Each engine is started the way the operator starts one in a pod (same kv-transfer-config shape, an engine
id per incarnation), minus the pod. Engines die with their parent and report where their log is.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from disagg.connector.wire import env as wire_env
from disagg.connector.wire import kv_events as wire_kv_events
from disagg.connector.wire.kv_transfer import kv_transfer_config

from .cluster import die_with_parent, free_port
from .netns import NETNS_UCX_TLS, Slot
from .procs import children, disagg_exe, process_group, stack_dump

PUSH, PULL = "NixlPushConnector", "NixlConnector"
SUPERVISOR = str(Path(__file__).resolve().parent / "supervise.py")


@dataclass
class EngineSpec:
    name: str
    role: str | None  # "prefill", "decode" or None for a plain (non-disaggregated) engine
    model: Path
    core: int
    mode: str = "push"
    port: int = 0
    side_channel_port: int = 0
    engine_id: str = ""
    kv_cache_gib: int = 1
    num_blocks: int | None = None
    """KV cache blocks (`--num-gpu-blocks-override`), to have blocks evicted and reused all the time; None: as many
    as `kv_cache_gib` holds."""
    max_model_len: int = 8192
    block_size: int = 128
    extra_env: dict[str, str] = field(default_factory=dict)
    plugin_dir: Path | None = None
    """A directory made by `disagg install-plugin`: the engine loads the disagg connector plugin from it (as an
    engine pod does from its init container's volume). None: vLLM's connector alone."""
    push_registration_timeout: float | None = None
    """Seconds a push decode waits for its prefill's KV (`spec.kvTransfer.registrationTimeoutSeconds`); None:
    vLLM's default (480 s)."""
    kv_events: bool = False
    """Publish KV cache events (vLLM's `--kv-events-config`, on two ports of its own) and advertise them, and report
    cached prompt tokens in each answer's usage: what a prefix-aware router needs (the operator renders the same)."""
    kv_events_ports: tuple[int, int] = (0, 0)
    drain_seconds: int = 5
    """How long a stopped engine finishes what it holds (`--shutdown-timeout`, the CR's `engine.drainSeconds`) before
    it aborts the rest; 0 aborts at once."""
    netns: Slot | None = None
    """A network namespace of its own (devcluster/netns.py), as a pod has: the engine listens on its address and
    its KV crosses a link. None: the host's namespace, on loopback."""

    @property
    def host(self) -> str:
        return self.netns.address if self.netns else "127.0.0.1"

    def kv_transfer_config(self) -> dict[str, Any] | None:
        if self.role is None:
            return None
        return kv_transfer_config(connector=PUSH if self.mode == "push" else PULL, role=self.role,
                                  engine_id=self.engine_id, backend="UCX", use_plugin=self.plugin_dir is not None,
                                  buffer_device="cpu", push_registration_timeout=self.push_registration_timeout)


def install_plugin(target: Path) -> Path:
    """The connector plugin as an engine pod gets it: the real `disagg install-plugin` (its init container)."""
    subprocess.run([disagg_exe(), "install-plugin", str(target)], check=True, stdout=subprocess.DEVNULL)
    return target


@dataclass(frozen=True)
class LocalRendezvous:
    """How local engines and their rendezvous meet: a shared token instead of the pod identity the operator's
    rendezvous checks, plus the deployment and heartbeat both sides must agree on."""

    token: str
    deployment: str
    heartbeat: int | float

    def args(self) -> list[str]:
        """`disagg <args>` for the rendezvous (the caller picks host and port)."""
        return ["rendezvous", "--auth", "token", "--token", self.token, "--heartbeat-seconds", str(self.heartbeat),
                "--deployment", self.deployment]

    def engine_env(self, url: str) -> dict[str, str]:
        """What points an engine's plugin at the rendezvous at `url` (the operator sets the same on engine pods)."""
        return {wire_env.RENDEZVOUS_URL: url, wire_env.RENDEZVOUS_TOKEN: self.token,
                wire_env.HEARTBEAT_SECONDS: str(self.heartbeat), wire_env.DEPLOYMENT: self.deployment}


class EngineFailed(RuntimeError):
    pass


class LocalEngine:
    def __init__(self, spec: EngineSpec, python: Path, log_dir: Path):
        self.spec = spec
        self.python = python
        self.log = log_dir / f"{spec.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        spec.port = spec.port or free_port()
        spec.side_channel_port = spec.side_channel_port or free_port()
        if spec.kv_events and spec.kv_events_ports == (0, 0):
            spec.kv_events_ports = (free_port(), free_port())

    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.spec.port}"

    def command(self) -> list[str]:
        """The engine's own command line, which the supervisor runs."""
        s = self.spec
        argv = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(s.model),
                "--served-model-name", "tiny", "--dtype", "bfloat16", "--block-size", str(s.block_size),
                "--enforce-eager", "--max-model-len", str(s.max_model_len),
                # In a namespace of its own, all addresses, as in a pod: the plugin's warm-up calls 127.0.0.1.
                "--host", "0.0.0.0" if s.netns else "127.0.0.1",
                "--port", str(s.port), "--seed", "0",
                "--shutdown-timeout", str(s.drain_seconds)]
        if s.num_blocks is not None:
            argv += ["--num-gpu-blocks-override", str(s.num_blocks)]
        if (cfg := s.kv_transfer_config()) is not None:
            argv += ["--kv-transfer-config", json.dumps(cfg)]
        if s.kv_events:
            argv += ["--kv-events-config", json.dumps(wire_kv_events.vllm_config(*s.kv_events_ports)),
                     "--enable-prompt-tokens-details"]
        return argv

    def start(self) -> LocalEngine:
        s = self.spec
        # A fresh engine id per start: a restarted engine must never reuse an id peers hold NIXL state for.
        s.engine_id = f"{s.name}-{uuid.uuid4().hex[:12]}"
        argv = self.command()
        env = {
            **{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
            "VLLM_CPU_KVCACHE_SPACE": str(s.kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": str(s.core),
            wire_env.SIDE_CHANNEL_HOST: s.host,
            wire_env.SIDE_CHANNEL_PORT: str(s.side_channel_port),
            **wire_env.CPU_ENGINE_ENV,
            **({"UCX_TLS": NETNS_UCX_TLS} if s.netns else {}),
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            # A native crash in a worker (NIXL, UCX, torch) otherwise ends it with no trace at all: the executor
            # only sees it gone. Python's fault handler prints every thread's stack to the log first.
            "PYTHONFAULTHANDLER": "1",
            "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "INFO"),
            **({"PYTHONPATH": str(s.plugin_dir), wire_env.ENGINE_ID: s.engine_id, wire_env.HTTP_PORT: str(s.port),
                wire_env.ROLE: s.role or ""} if s.plugin_dir is not None else {}),
            **({wire_env.KV_EVENTS_PORT: str(s.kv_events_ports[0]),
                wire_env.KV_EVENTS_REPLAY_PORT: str(s.kv_events_ports[1])} if s.kv_events else {}),
            **s.extra_env,
        }
        with self.log.open("ab") as out:
            out.write(f"\n=== start {s.engine_id} {' '.join(argv)}\n".encode())
            # cwd=/ keeps a checkout off sys.path (its operator/ folder must never meet the stdlib's). The
            # supervisor takes vLLM's engine-core and worker processes down with us, however we end. The whole
            # engine runs on its core, as the launch script confines an engine pod (operator/launch.sh.j2).
            def start_child(core: int = s.core) -> None:
                die_with_parent()
                os.sched_setaffinity(0, {core})

            prefix = s.netns.exec_prefix() if s.netns else []
            self.proc = subprocess.Popen([*prefix, sys.executable, SUPERVISOR, "--", *argv], env=env, stdout=out,
                                         stderr=subprocess.STDOUT, cwd="/", start_new_session=True,
                                         preexec_fn=start_child)
        return self

    def wait_ready(self, timeout: float = 240) -> LocalEngine:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise EngineFailed(f"engine {self.spec.name} exited ({self.proc and self.proc.returncode}) during "
                                   f"start-up; log: {self.log}\n{self.tail()}")
            try:
                if urllib.request.urlopen(f"{self.url}/health", timeout=2).status == 200:
                    return self
            except OSError:
                time.sleep(0.5)  # polling a child's HTTP port: there is nothing to await
        raise EngineFailed(f"engine {self.spec.name} not healthy after {timeout:g}s; log: {self.log}\n{self.tail()}\n"
                           f"Errors in its log:\n{self.errors()}\n"
                           f"Python stacks of its processes (py-spy dump):\n{self.stacks()}")

    def errors(self, n: int = 40) -> str:
        """The current incarnation's log lines that report an error, a traceback or a dead thread, last `n`: the
        tail alone may be all retries (a plugin whose rendezvous is down logs every 2 s)."""
        if not self.log.exists():
            return "(no log)"
        text = self.log.read_text(errors="replace")
        lines = text[text.rfind("\n=== start "):].splitlines()
        hits = [i for i, line in enumerate(lines) if "ClientConnectorError" not in line
                and re.search(r"Traceback|Exception in thread|Error\b|ERROR", line)]
        # A traceback's last line names the exception: keep the line after each hit too.
        keep = sorted({j for i in hits for j in (i, i + 1) if j < len(lines)})
        return "\n".join(lines[j] for j in keep[-n:]) or "(none)"

    def processes(self) -> list[int]:
        """The engine's processes: the API server the supervisor started (leader of its own process group), and
        every process in that group (engine core, workers), leader first. Empty once it is gone."""
        if self.proc is None or self.proc.poll() is not None:
            return []
        return [pid for leader in children(self.proc.pid) for pid in process_group(leader)]

    def stacks(self) -> str:
        """Every thread's Python stack in each of the engine's processes: what a hung start-up was doing."""
        pids = self.processes()
        return stack_dump(pids) if pids else "(no engine processes left)"

    def stop(self, grace: float = 20) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)  # the supervisor stops vLLM's whole process group
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def restart(self) -> LocalEngine:
        self.stop()
        return self.start()

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:]) if self.log.exists() else ""
