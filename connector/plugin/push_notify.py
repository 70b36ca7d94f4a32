"""Push decode learns that its KV has landed in the engine step in which the notification arrived, not a step later.

In vLLM 0.32's push worker, NIXL notifications are read only by the `nixl-push-writer` thread, which forwards
completion notifications to a queue the engine's main thread reads at the end of each step. On a decode engine
the writer sleeps until the main thread wakes it, and the main thread wakes it in that same end-of-step call,
just before reading the queue: the writer cannot have drained anything yet (it also needs the GIL the main
thread holds). So a WRITE that lands during step k is reported at the end of step k + 1, the request is
scheduled in step k + 2, and its first token comes a whole decode step later than the KV allowed. On a busy
decode a step is tens of milliseconds: that step is a large share of the handoff push exists to shorten.

`WriterDrain` keeps every NIXL call on the writer thread, as vLLM does (vLLM creates its NIXL agent without
NIXL's own locking, so a second thread reading notifications while the writer sends, or while a handshake adds
an agent, races inside NIXL). It changes only the order at the end of a step:

- `drain()` (main thread, before vLLM reads its queue): wake the writer and wait, a bounded time, until a read
  of NIXL's notifications that began after the call has finished;
- `for_writer()` (the writer, in place of NIXL's call): read NIXL's notifications, put completions and heartbeats
  on vLLM's queue itself, in arrival order, and return only the PUSH_REG registrations, which the writer alone
  acts on. So by the time `drain()` returns, the queue holds every completion that arrived before it was called.

Invariant: every notification NIXL returns is delivered exactly once, to the consumer vLLM would have delivered
it to; only the moment changes. A writer that does not answer within the bound costs the step that bound and
leaves vLLM's order (the completion is reported a step later), never a lost notification.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

Notifications = dict[str, list[bytes]]
"""NIXL's notifications by sending agent name."""


class WriterDrain:
    def __init__(self, read: Callable[..., Notifications], is_registration: Callable[[bytes], bool],
                 forward: Callable[[bytes], Any], wake: Callable[[], Any], timeout: float) -> None:
        self._read = read
        self._is_registration = is_registration
        self._forward = forward
        self._wake = wake
        self._timeout = timeout
        self._reads = threading.Condition()
        self._begun = 0
        self._done = 0
        self.drains = 0
        """`drain()` calls so far."""
        self.late = 0
        """`drain()` calls that gave up waiting for the writer."""

    def for_writer(self, *args: Any, **kwargs: Any) -> Notifications:
        """The writer's read of NIXL: completions and heartbeats forwarded here, registrations returned."""
        with self._reads:
            self._begun += 1
        registrations: Notifications = {}
        try:
            for agent, messages in self._read(*args, **kwargs).items():
                for message in messages:
                    if self._is_registration(message):
                        registrations.setdefault(agent, []).append(message)
                    else:
                        self._forward(message)
        finally:
            with self._reads:
                self._done += 1
                self._reads.notify_all()
        return registrations

    def drain(self) -> bool:
        """Wake the writer and wait until it has read NIXL after this call began. False if it did not within the
        bound."""
        with self._reads:
            wanted = self._begun + 1
            self._wake()
            caught_up = self._reads.wait_for(lambda: self._done >= wanted, self._timeout)
        self.drains += 1
        if not caught_up:
            self.late += 1
        return caught_up
