"""An engine is registered again with a restarted rendezvous before the new instance's warm-up ends.

The warm-up (two heartbeats) is how long routers keep engines a restarted rendezvous does not list yet; an
engine that comes back later is dropped by every router meanwhile. Issue 12 saw more than 8 s with the 5 s
heartbeat: a renewal sent on the connection to the old instance waited for the client's whole 5 s timeout. One
attempt now lasts at most half a heartbeat (EngineRegistration.attempt_timeout), so the worst case is a
heartbeat of sleep, half a heartbeat on the dead connection and one short backoff: under two heartbeats.

The rendezvous sits behind a TCP front here, as behind a Kubernetes Service: a restart sends new connections
to the new instance, and the old instance's connections either close (a clean stop) or go silent (the pod
vanished with its node: no FIN, no RST), the slow case.
"""
from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from disagg.connector.rendezvous.auth import TokenAuth
from disagg.connector.rendezvous.client import EngineRegistration, RendezvousClient
from disagg.connector.rendezvous.server import RendezvousServer
from support.rendezvous import advert

TOKEN = "t0ken"
HEARTBEAT = 1.5  # seconds; the margin the bound leaves (a quarter of the warm-up) must absorb a loaded machine


class ServiceFront:
    """Forwards each connection to the backend port current when it opened. `cut_over(port)`: new connections
    go to `port`; open ones are closed (`silently=False`) or stop forwarding without closing (`silently=True`)."""

    def __init__(self, backend: int) -> None:
        self.backend, self.generation = backend, 0
        self._server: asyncio.Server | None = None
        self._conns: list[tuple[int, asyncio.StreamWriter, asyncio.StreamWriter]] = []
        self._tasks: set[asyncio.Task] = set()
        self._silence = asyncio.Event()  # never set: what a silenced connection waits for

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        gen = self.generation
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.backend)
        self._conns.append((gen, writer, up_writer))
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            t = asyncio.create_task(self._pipe(src, dst, gen))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, gen: int) -> None:
        with contextlib.suppress(ConnectionError):
            while True:
                data = await src.read(65536)
                if gen != self.generation:
                    await self._silence.wait()  # the old pod is gone: bytes go nowhere, nothing comes back
                if not data:
                    break
                dst.write(data)
                await dst.drain()
        dst.close()

    def cut_over(self, backend: int, *, silently: bool) -> None:
        self.backend, self.generation = backend, self.generation + 1
        if not silently:
            for gen, a, b in self._conns:
                if gen < self.generation:
                    a.close()
                    b.close()

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        for _, a, b in self._conns:
            a.close()
            b.close()
        if self._server is not None:
            self._server.close()


class RenewalsSeen(RendezvousClient):
    """The engine's client, telling the test when a renewal (not a registration) succeeded."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.renewed = asyncio.Event()

    async def renew(self, engine_id: str):
        resp = await super().renew(engine_id)
        self.renewed.set()
        return resp


def _server() -> RendezvousServer:
    # The default warm-up: two heartbeats.
    return RendezvousServer(auth=TokenAuth(TOKEN), heartbeat_seconds=HEARTBEAT, expire_interval=0.05)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("silently", [False, True], ids=["old-instance-closed", "old-instance-silent"])
async def test_an_engine_re_registers_with_a_restarted_rendezvous_within_its_warm_up(silently):
    first = _server()
    second: RendezvousServer | None = None
    await first.start()
    front = ServiceFront(int(first.url.rsplit(":", 1)[1]))
    url = f"http://127.0.0.1:{await front.start()}"
    # As the plugin builds it: the client's own timeout is 5 s, five times the heartbeat here.
    client = RenewalsSeen(url, token=TOKEN, timeout=5.0)
    reg = EngineRegistration(client, advert("e1", lease_seconds=3 * HEARTBEAT), heartbeat_seconds=HEARTBEAT)
    reg.start()
    try:
        async with asyncio.timeout(5):
            await client.renewed.wait()  # registered, then renewed once on its kept-alive connection
        # Restart right after a renewal: the longest wait, a whole heartbeat before the next attempt.
        second = _server()  # a new process: its warm-up starts now
        await second.start()
        front.cut_over(int(second.url.rsplit(":", 1)[1]), silently=silently)
        restarted = time.monotonic()
        await first.stop()
        assert await second.registry.wait(0, timeout=10), "never registered again"
        took = time.monotonic() - restarted
        assert second.registry.get("e1") is not None
        assert second.registry.warming(), f"re-registered {took:.2f}s after the restart, after the warm-up"
        assert took < 2 * HEARTBEAT, took
    finally:
        await reg.stop(deregister=False)
        await client.close()
        await front.stop()
        await first.stop()
        if second is not None:
            await second.stop()
