"""Push decode learns that its KV has landed in the engine step in which the notification arrived, not a step later.

In vLLM 0.32's push worker, NIXL notifications are read only by the `nixl-push-writer` thread, which forwards
completion notifications to a queue the engine's main thread reads at the end of each step. On a decode engine
the writer sleeps until the main thread wakes it, and the main thread wakes it in that same end-of-step call,
just before reading the queue: the writer cannot have drained anything yet (it also needs the GIL the main
thread holds). So a WRITE that lands during step k is reported at the end of step k + 1, the request is
scheduled in step k + 2, and its first token comes a whole decode step later than the KV allowed. On a busy
decode a step is tens of milliseconds: that step is a large share of the handoff push exists to shorten.

`StepNotifications` moves the read onto the main thread's end-of-step call, under a lock shared with the
writer, so both threads never call into NIXL's notification list at once:

- `drain()` (main thread, before vLLM reads its queue): NIXL's new notifications; completions and heartbeats go
  to vLLM's queue in arrival order, exactly as the writer forwards them; PUSH_REG registrations are held for
  the writer, which alone may act on them;
- `for_writer()` (the writer, in place of NIXL's call): NIXL's new notifications, after any registrations the
  main thread held, in arrival order.

Invariant: every notification NIXL returns is delivered exactly once, to the consumer vLLM would have
delivered it to; only the moment changes.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

Notifications = dict[str, list[bytes]]
"""NIXL's notifications by sending agent name."""


class StepNotifications:
    def __init__(self, read: Callable[..., Notifications], is_registration: Callable[[bytes], bool],
                 forward: Callable[[bytes], Any]) -> None:
        self._read = read
        self._is_registration = is_registration
        self._forward = forward
        self._lock = threading.Lock()
        self._held: Notifications = {}
        self.drained = 0
        """Notifications the main thread has forwarded so far."""

    def for_writer(self, *args: Any, **kwargs: Any) -> Notifications:
        """What the writer thread gets when it asks NIXL: registrations the main thread held, then NIXL's new ones."""
        with self._lock:
            fresh = self._read(*args, **kwargs)
            held, self._held = self._held, {}
        if not held:
            return fresh
        for agent, messages in fresh.items():
            held.setdefault(agent, []).extend(messages)
        return held

    def drain(self) -> int:
        """Read NIXL's new notifications now: forward completions and heartbeats, hold registrations for the
        writer. Returns how many were forwarded."""
        forwarded = 0
        with self._lock:
            for agent, messages in self._read().items():
                for message in messages:
                    if self._is_registration(message):
                        self._held.setdefault(agent, []).append(message)
                    else:
                        self._forward(message)
                        forwarded += 1
        self.drained += forwarded
        return forwarded
