"""The poll wait of NIXL's progress thread, which NIXL's Python agent fixes at zero.

`nixl._api.nixl_agent` builds its agent with `pthrDelay = 0`, and vLLM enables the progress thread. NIXL's
UCX backend then polls its workers' event descriptors with a zero timeout: the thread spins a whole core for
the life of the engine, idle or not. With a non-zero delay it sleeps in `poll()` until a worker has an event
(a WRITE or notification arriving wakes it at once), or for at most the delay rounded up to a millisecond,
NIXL's guard against an event that `poll()` misses. A CPU engine gets its core back for compute; an engine
with GPUs or Trainium devices keeps the spinning thread unless its env asks otherwise.

`progress_delay(us)` opens a window in which every NIXL agent this process creates gets that delay. The
plugin opens it around vLLM's connector construction, where the worker creates its one agent. Invariant:
outside the window, NIXL's module is exactly as it shipped.

NIXL's internals are not API: if `nixl._api` has no `nixlBind.nixlAgent` to wrap, the window does nothing,
says why once, and the agent keeps NIXL's default.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

from ..wire import env as wire_env

log = logging.getLogger("disagg.plugin")


def delay_from_env(env: Mapping[str, str]) -> int | None:
    """`$DISAGG_NIXL_PROGRESS_DELAY_US` as a non-negative int, or None when unset, empty or not a number."""
    raw = (env.get(wire_env.NIXL_PROGRESS_DELAY_US) or "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        log.warning("disagg plugin: $%s=%r is not a whole number of microseconds; NIXL keeps its default",
                    wire_env.NIXL_PROGRESS_DELAY_US, raw)
        return None
    if value < 0:
        log.warning("disagg plugin: $%s=%d is negative; NIXL keeps its default", wire_env.NIXL_PROGRESS_DELAY_US,
                    value)
        return None
    return value


class _Bindings:
    """NIXL's binding module as `nixl._api` sees it, except that new agents get the delay."""

    def __init__(self, real: Any, delay_us: int) -> None:
        self._real = real
        self._delay_us = delay_us
        self.agents = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def nixlAgent(self, name: str, config: Any) -> Any:  # noqa: N802 - NIXL's name
        config.pthrDelay = self._delay_us
        self.agents += 1
        return self._real.nixlAgent(name, config)


@contextlib.contextmanager
def progress_delay(delay_us: int | None, module: str = "nixl._api") -> Iterator[None]:
    """Within the block, NIXL agents created through `module` poll with `delay_us` (None: leave NIXL alone)."""
    if delay_us is None:
        yield
        return
    try:
        api: Any = importlib.import_module(module)
        real = api.nixlBind
        real.nixlAgent  # noqa: B018 - the one attribute the window wraps must exist before it opens
    except (ImportError, AttributeError) as e:
        log.warning("disagg plugin: cannot set NIXL's progress-thread delay (%s: %s); it stays NIXL's default",
                    type(e).__name__, e)
        yield
        return
    bindings = _Bindings(real, delay_us)
    api.nixlBind = bindings
    try:
        yield
    finally:
        api.nixlBind = real
    if bindings.agents and delay_us:
        log.info("disagg plugin: NIXL progress thread waits up to %d us in poll() (NIXL's default spins)", delay_us)
    elif bindings.agents:
        log.info("disagg plugin: NIXL progress thread spins (delay 0, as asked)")
