"""The plugin's advertiser in a real process against a real rendezvous: register, then leave on SIGTERM.

vLLM's API server stops its engine core with SIGTERM and kills it right after (shutdown timeout 0), so the
advertiser must deregister from the signal, not from a shutdown hook that may never run.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from disagg.connector.rendezvous.auth import TokenAuth
from disagg.connector.rendezvous.client import RendezvousClient
from disagg.connector.rendezvous.server import RendezvousServer

CHILD = textwrap.dedent('''
    import sys, time
    from types import SimpleNamespace
    from disagg.connector.plugin.advertiser import EngineAdvertiser
    from disagg.connector.plugin.settings import PluginSettings
    cfg = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(engine_id="dec-1", kv_connector="NixlPushConnector", kv_role="kv_consumer"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1),
        cache_config=SimpleNamespace(block_size=128), model_config=SimpleNamespace(model="m", dtype="bf16"))
    env = {"DISAGG_RENDEZVOUS_URL": sys.argv[1], "DISAGG_RENDEZVOUS_TOKEN": "tok", "DISAGG_HEARTBEAT_SECONDS": "1"}
    env["DISAGG_WARMUP"] = "0"  # no engine HTTP server here
    EngineAdvertiser(PluginSettings.from_vllm(cfg, env), {(0, 0): b"payload"}, "h", "UCX", "127.0.0.1", 5600).start()
    print("advertising", flush=True)
    while True:
        time.sleep(1)
''')


async def _await(predicate, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)  # another process's state: nothing to await but polling


@pytest.mark.timeout(20)
async def test_registers_with_handshake_metadata_and_deregisters_on_sigterm():
    server = RendezvousServer(auth=TokenAuth("tok"), heartbeat_seconds=0.2, expire_interval=0.02)
    url = await server.start("127.0.0.1", 0)
    client = RendezvousClient(url, token="tok", timeout=5)
    try:
        child = subprocess.Popen([sys.executable, "-c", CHILD, url], stdout=subprocess.PIPE, text=True,
                                 cwd="/", env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        try:
            assert child.stdout.readline().strip() == "advertising"

            async def listed() -> bool:
                return [e.engine_id for e in (await client.list()).engines] == ["dec-1"]
            await _await(listed)
            adv = (await client.list()).engines[0]
            assert (adv.transport, adv.kv_metadata["compatibility_hash"]) == ("UCX", "h")

            child.send_signal(signal.SIGTERM)
            assert child.wait(10) == -signal.SIGTERM  # the default action still ends the process

            async def gone() -> bool:
                return (await client.list()).engines == []
            await _await(gone, timeout=2)  # deregistered: far sooner than the 3 s lease
        finally:
            child.kill()
    finally:
        await client.close()
        await server.stop()
