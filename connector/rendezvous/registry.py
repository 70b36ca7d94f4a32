"""The rendezvous' in-memory registry: advertisements under leases, a version, and a bounded change log.

Pure logic with an injected clock and no I/O. Mutations are synchronous; `wait()` lets asyncio watchers
sleep until the version moves. All calls must come from one thread (the server's event loop).

Rules:
- `register` of a new engine id: ADDED; of a known one with changed content: MODIFIED; unchanged: a renewal
  (lease extended, no event, version unchanged).
- An engine id held by another pod (different `pod_uid`, `pod_name` or `role`) is a `Conflict`: nothing changes.
- At most one engine per pod: registering engine B for pod P removes P's other engine A (DELETED), because a
  pod runs one engine and a new engine id means the old incarnation is gone.
- `expire(now)` removes entries whose lease passed (EXPIRED).
- The log keeps the last `log_size` events. `changes_since(v)` returns the events after v, or a snapshot
  (RESET, ADDED for each engine, at the current version) when v is older than the log, newer than the
  current version, or from another epoch (another rendezvous instance).
"""
from __future__ import annotations

import asyncio
import secrets
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..wire.advertisement import EngineAdvertisement, EventType, RegisterResult, WatchEvent
from ..wire.env import ROLES

Clock = Callable[[], float]


class RegistryError(Exception):
    reason = "registry_error"


class Conflict(RegistryError):
    reason = "conflict"


class NotFound(RegistryError):
    reason = "not_found"


class RegistryFull(RegistryError):
    reason = "registry_full"


@dataclass
class Entry:
    engine: EngineAdvertisement
    expires_at: float
    version: int
    """Version of the event that last changed this entry."""


@dataclass(frozen=True)
class Registration:
    result: RegisterResult
    version: int
    engine: EngineAdvertisement
    expires_at: float
    events: tuple[WatchEvent, ...] = ()
    """Events this call appended (replaced engines of the same pod first, then ADDED/MODIFIED)."""


@dataclass(frozen=True)
class Changes:
    """What a watcher at `since` must apply to catch up to `version`."""

    version: int
    reset: bool
    """True: `events` is a snapshot (RESET first) and replaces the watcher's state."""
    events: list[WatchEvent] = field(default_factory=list)


class Registry:
    def __init__(self, *, clock: Clock = time.monotonic, log_size: int = 1024, max_engines: int = 4096,
                 warmup_seconds: float = 10.0, epoch: str | None = None) -> None:
        if log_size < 1 or max_engines < 1:
            raise ValueError("log_size and max_engines must be >= 1")
        self.clock = clock
        self.epoch = epoch or secrets.token_hex(8)
        self.max_engines = max_engines
        self.warmup_seconds = warmup_seconds
        self.started_at = clock()
        self.version = 0
        self._entries: dict[str, Entry] = {}
        self._log: deque[WatchEvent] = deque(maxlen=log_size)
        self._log_floor = 0  # every event with version > _log_floor is in the log
        self._waiters: set[asyncio.Future[None]] = set()
        self.closed = False

    # ---- reads ----------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def get(self, engine_id: str) -> EngineAdvertisement | None:
        e = self._entries.get(engine_id)
        return e.engine if e else None

    def entry(self, engine_id: str) -> Entry | None:
        return self._entries.get(engine_id)

    def engines(self, role: str | None = None, layout_key: str | None = None) -> list[EngineAdvertisement]:
        return [e.engine for _, e in sorted(self._entries.items())
                if (role is None or e.engine.role == role)
                and (layout_key is None or e.engine.layout_key == layout_key)]

    def counts_by_role(self) -> dict[str, int]:
        counts = dict.fromkeys(ROLES, 0)
        for e in self._entries.values():
            counts[e.engine.role] += 1
        return counts

    def warming(self) -> bool:
        """True until `warmup_seconds` after start: live engines may not have re-registered yet."""
        return self.clock() - self.started_at < self.warmup_seconds

    def next_deadline(self) -> float | None:
        return min((e.expires_at for e in self._entries.values()), default=None)

    def control(self, kind: EventType) -> WatchEvent:
        """A RESET or BOOKMARK at the current version."""
        return WatchEvent(version=self.version, type=kind, epoch=self.epoch, warming=self.warming())

    def snapshot(self) -> list[WatchEvent]:
        return [self.control("RESET")] + [WatchEvent(version=self.version, type="ADDED", engine=e)
                                          for e in self.engines()]

    def changes_since(self, since: int | None, epoch: str | None = None) -> Changes:
        if since is None or (epoch is not None and epoch != self.epoch) or since < self._log_floor \
                or since > self.version:
            return Changes(self.version, True, self.snapshot())
        # The log is ordered by version; the tail after `since` is what the watcher misses.
        events = [ev for ev in self._log if ev.version > since]
        return Changes(self.version, False, events)

    # ---- writes ---------------------------------------------------------------------------------------------
    def _append(self, kind: EventType, engine: EngineAdvertisement) -> WatchEvent:
        self.version += 1
        ev = WatchEvent(version=self.version, type=kind, engine=engine)
        if len(self._log) == self._log.maxlen:
            self._log_floor = self._log[0].version
        self._log.append(ev)
        return ev

    def _notify(self) -> None:
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)
        self._waiters.clear()

    def register(self, adv: EngineAdvertisement) -> Registration:
        now = self.clock()
        expires_at = now + adv.lease_seconds
        current = self._entries.get(adv.engine_id)
        if current is not None:
            old = current.engine
            for attr in ("pod_uid", "pod_name", "role"):
                if getattr(old, attr) != getattr(adv, attr):
                    raise Conflict(f"engine_id {adv.engine_id!r} is registered with {attr} {getattr(old, attr)!r}, "
                                   f"not {getattr(adv, attr)!r}; a new incarnation needs a new engine id")
            current.expires_at = expires_at
            if old == adv:
                return Registration("renewed", self.version, adv, expires_at)
            current.engine = adv
            ev = self._append("MODIFIED", adv)
            current.version = ev.version
            self._notify()
            return Registration("modified", self.version, adv, expires_at, (ev,))
        replaced = [eid for eid, e in self._entries.items() if adv.pod_name is not None
                    and e.engine.pod_name == adv.pod_name and e.engine.deployment == adv.deployment]
        if len(self._entries) - len(replaced) >= self.max_engines:
            raise RegistryFull(f"the registry holds {len(self._entries)} engines, its limit")
        events = [self._append("DELETED", self._entries.pop(eid).engine) for eid in replaced]
        ev = self._append("ADDED", adv)
        events.append(ev)
        self._entries[adv.engine_id] = Entry(adv, expires_at, ev.version)
        self._notify()
        return Registration("created", self.version, adv, expires_at, tuple(events))

    def renew(self, engine_id: str) -> Registration:
        """Extend a lease without resending the advertisement. NotFound: the caller must PUT it again."""
        e = self._entries.get(engine_id)
        if e is None:
            raise NotFound(f"engine {engine_id!r} is not registered")
        e.expires_at = self.clock() + e.engine.lease_seconds
        return Registration("renewed", self.version, e.engine, e.expires_at)

    def deregister(self, engine_id: str) -> WatchEvent:
        e = self._entries.pop(engine_id, None)
        if e is None:
            raise NotFound(f"engine {engine_id!r} is not registered")
        ev = self._append("DELETED", e.engine)
        self._notify()
        return ev

    def expire(self, now: float | None = None) -> list[WatchEvent]:
        now = self.clock() if now is None else now
        gone = sorted((e.expires_at, eid) for eid, e in self._entries.items() if e.expires_at <= now)
        events = [self._append("EXPIRED", self._entries.pop(eid).engine) for _, eid in gone]
        if events:
            self._notify()
        return events

    # ---- waiting --------------------------------------------------------------------------------------------
    async def wait(self, after_version: int, timeout: float | None = None) -> bool:
        """Until the version exceeds `after_version` (True), the timeout passes or the registry closes (False)."""
        if self.version > after_version:
            return True
        if self.closed:
            return False
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.add(fut)
        try:
            await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            pass
        finally:
            self._waiters.discard(fut)
        return self.version > after_version

    def close(self) -> None:
        """Wake every waiter for good (server shutdown): watch streams end."""
        self.closed = True
        self._notify()

    def load(self, advs: Iterable[EngineAdvertisement]) -> None:
        """Register several advertisements (tests and tools)."""
        for adv in advs:
            self.register(adv)
