"""`disagg emulator`: one emulated engine as a process, advertised to the rendezvous as the plugin advertises a
real one, serving until SIGTERM, then leaving the rendezvous and draining as a stopping engine does.

Its advertisement is the plugin's own (`connector/plugin/advertiser.build_advertisement`), from the same env, with
the emulator's transport (`EMULATED`), no KV metadata and the KV event endpoints its publisher bound: the router and
the operator cannot tell it from an engine, and a human can (`/v1/models` is owned by `disagg-engine-emulator`, the
log says so on every start, and `/metrics` has `disagg_emulator_info`).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import logging
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass, replace

from aiohttp import web

from ..plugin.advertiser import build_advertisement
from ..plugin.settings import PluginSettings
from ..rendezvous.client import EngineRegistration, RendezvousClient
from ..wire import emulator as contract
from ..wire import env as wire_env
from ..wire.advertisement import EngineAdvertisement, KvMode, Role
from . import side_channel
from .engine import EmulatedEngine
from .kv_events import KvEventPublisher
from .metrics import EngineMetrics
from .profiles import PROFILES, EmulatorProfile
from .server import EmulatorServer

log = logging.getLogger("disagg.emulator")
DEFAULT_SIDE_CHANNEL_PORT = 5600


@dataclass(frozen=True)
class Identity:
    """Who this emulated engine is, from the engine env (the operator's or a local run's)."""

    settings: PluginSettings
    side_channel_host: str


def profile_for(args: argparse.Namespace) -> EmulatorProfile:
    """The profile with the flags' overrides, validated again (a request of max_model_len must still fit the KV
    cache). A new block size keeps the KV capacity in tokens; --kv-cache-blocks sets it in blocks."""
    profile = PROFILES[args.profile]
    if args.time_scale <= 0:
        raise SystemExit(f"disagg emulator: --time-scale must be positive, got {args.time_scale}")
    if args.time_scale != 1:
        profile = profile.scaled(args.time_scale)
    changes: dict[str, object] = {}
    if args.block_size is not None:
        changes["block_size"] = args.block_size
        changes["num_blocks"] = profile.kv_cache_tokens // args.block_size
    if args.max_model_len is not None:
        changes["max_model_len"] = args.max_model_len
    if args.kv_cache_blocks is not None:
        changes["num_blocks"] = args.kv_cache_blocks
    if args.contention is not None:
        share, _, per_seq_ms = args.contention.partition(",")
        try:
            both = {"share": float(share), "per_sequence_s": float(per_seq_ms) / 1000}
        except ValueError:
            raise SystemExit(f"disagg emulator: --contention wants SHARE,PER_SEQUENCE_MS, got "
                             f"{args.contention!r}") from None
        changes["contention"] = {"prefill": both, "decode": both}
    if not changes:
        return profile
    try:
        return EmulatorProfile.model_validate({**profile.model_dump(), **changes})
    except ValueError as e:
        raise SystemExit(f"disagg emulator: {e}") from None


def identity(args: argparse.Namespace, profile: EmulatorProfile, env: Mapping[str, str]) -> Identity:
    role_name = args.role or env.get(wire_env.ROLE)
    if role_name not in wire_env.ROLES:
        raise SystemExit(f"disagg emulator: say the role: --role prefill|decode or ${wire_env.ROLE}")
    role: Role = "prefill" if role_name == "prefill" else "decode"
    mode: KvMode = "push" if args.kv_mode == "push" else "pull"
    model = args.served_model_name or profile.served_model_name
    engine_id = env.get(wire_env.ENGINE_ID) or f"emulator-{role}-{os.getpid()}"
    settings = PluginSettings(
        engine_id=engine_id, role=role, kv_mode=mode, deployment=env.get(wire_env.DEPLOYMENT) or "local",
        # Without the operator's key, one that pairs only emulators of the same profile, model and mode.
        layout_key=env.get(wire_env.LAYOUT_KEY) or "emulator-" + hashlib.sha256(
            f"{profile.name}|{model}|{profile.block_size}|{mode}".encode()).hexdigest()[:16],
        tp_size=profile.tp_size, pp_size=1, dp_size=1, block_size=profile.block_size, http_port=args.port,
        rendezvous_url=env.get(wire_env.RENDEZVOUS_URL) or None, token=env.get(wire_env.RENDEZVOUS_TOKEN) or None,
        token_file=env.get(wire_env.RENDEZVOUS_TOKEN_FILE) or None,
        heartbeat_seconds=wire_env.heartbeat_seconds(env), env=env, transport=contract.TRANSPORT,
        max_model_len=profile.max_model_len)
    host = env.get(wire_env.SIDE_CHANNEL_HOST) or env.get(wire_env.POD_IP) or "127.0.0.1"
    return Identity(settings, host)


def advertisement(ident: Identity, side_channel_port: int,
                  publisher: KvEventPublisher | None = None) -> EngineAdvertisement:
    """The plugin's advertisement of this emulator; with its KV event publisher, the ports that publisher bound."""
    settings = ident.settings
    if publisher is not None:
        settings = replace(settings, kv_events_port=publisher.port, kv_events_replay_port=publisher.replay_port)
    return build_advertisement(settings, {}, None, contract.TRANSPORT, ident.side_channel_host, side_channel_port)


class Emulator:
    """One emulated engine: its engine core, its HTTP API and side channel, its KV event sockets, and its place in
    the rendezvous. `start()` serves; `stop()` leaves the rendezvous, then drains (what SIGTERM does)."""

    def __init__(self, args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> None:
        self.args = args
        self.profile = profile = profile_for(args)
        self.ident = ident = identity(args, profile, env)
        s = ident.settings
        assert s.role is not None
        self.model = args.served_model_name or profile.served_model_name
        self.side_port = args.side_channel_port or int(env.get(wire_env.SIDE_CHANNEL_PORT)
                                                       or DEFAULT_SIDE_CHANNEL_PORT)
        self.metrics = EngineMetrics(self.model, profile=profile.name, role=s.role, kv_mode=s.kv_mode,
                                     max_model_len=profile.max_model_len, block_size=profile.block_size,
                                     num_blocks=profile.num_blocks, kv_bytes_per_token=profile.kv_bytes_per_token)
        self.publisher: KvEventPublisher | None = None
        self.engine = EmulatedEngine(profile, role=s.role, kv_mode=s.kv_mode, engine_id=s.engine_id,
                                     side_channel_host=ident.side_channel_host, side_channel_port=self.side_port,
                                     metrics=self.metrics, registration_timeout=args.registration_timeout,
                                     lease_seconds=args.lease_seconds)
        self.server = EmulatorServer(self.engine, self.model)
        self.registration: EngineRegistration | None = None
        self._runners: list[web.AppRunner] = []
        self._api_site: web.TCPSite | None = None
        self._steps: asyncio.Task[None] | None = None

    @property
    def settings(self) -> PluginSettings:
        return self.ident.settings

    async def start(self) -> None:
        args, s = self.args, self.ident.settings
        if args.kv_events_port:
            replay = f"tcp://*:{args.kv_events_replay_port}" if args.kv_events_replay_port else None
            self.publisher = KvEventPublisher(f"tcp://*:{args.kv_events_port}", replay, args.kv_events_topic)
            self.publisher.start()
            self.engine.publisher = self.publisher
        api = web.AppRunner(self.server.app(), handler_cancellation=True, access_log=None)
        side = web.AppRunner(side_channel.app(self.engine), access_log=None)
        for runner in (api, side):
            await runner.setup()
            self._runners.append(runner)
        await web.TCPSite(side, args.host, self.side_port).start()
        self._api_site = web.TCPSite(api, args.host, args.port)
        await self._api_site.start()
        self._steps = asyncio.create_task(self.engine.run(), name="emulator-steps")
        log.info("disagg ENGINE EMULATOR (not a vLLM engine): %s %s, %s mode, emulating %s; engine %s, API on :%d, "
                 "side channel %s:%d, KV events %s", s.role, self.profile.name, s.kv_mode, self.profile.emulates,
                 s.engine_id, args.port, self.ident.side_channel_host, self.side_port,
                 f"on :{args.kv_events_port}" if self.publisher else "off")
        if s.rendezvous_url:
            url, token, token_file = s.rendezvous_url, s.token, s.token_file
            self.registration = EngineRegistration(
                None, advertisement(self.ident, self.side_port, self.publisher),
                heartbeat_seconds=s.heartbeat_seconds,
                client_factory=lambda: RendezvousClient(url, token=token, token_file=token_file, timeout=5.0))
            self.registration.start()

    @property
    def steps(self) -> asyncio.Task[None]:
        """The engine's step loop (started by `start`)."""
        assert self._steps is not None, "start() first"
        return self._steps

    async def stop(self, drain_seconds: float | None = None) -> None:
        """As a stopping engine with the plugin does: leave the rendezvous first, then finish what it holds (at
        most `drain_seconds`, by default --drain-seconds), then close."""
        drain = self.args.drain_seconds if drain_seconds is None else drain_seconds
        log.info("engine emulator %s stopping: leaving the rendezvous, draining for at most %gs",
                 self.settings.engine_id, drain)
        self.server.stopping = True
        if self.registration is not None:
            await self.registration.stop(deregister=True)
        if self._api_site is not None:
            await self._api_site.stop()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(drain):
                while not self.engine.drained():
                    await asyncio.sleep(0.05)  # the engine's own state: nothing to await but its next step
        if self._steps is not None:
            self._steps.cancel()
        for runner in self._runners:
            await runner.cleanup()
        await self.engine.close()
        if self.publisher is not None:
            await self.publisher.close()


async def serve(args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> None:
    emulator = Emulator(args, env)
    await emulator.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    steps = emulator.steps
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({stopping, steps}, return_when=asyncio.FIRST_COMPLETED)
    if steps.done():
        # The step loop ends only by a bug. Without it the engine answers /health and queues every request
        # forever; exiting, as vLLM's API server does when its engine core dies, lets the probes and the pod's
        # restart see it.
        stopping.cancel()
        log.critical("engine emulator: the step loop died; exiting", exc_info=steps.exception())
        raise SystemExit(1)
    await emulator.stop()


def main(args: argparse.Namespace) -> None:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvloop

    uvloop.run(serve(args))
