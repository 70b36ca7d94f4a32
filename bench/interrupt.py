"""Stopping a benchmark cleanly: SIGTERM, and SIGINT even in a background job, cancel its run like Ctrl-C.

A shell starts background jobs with SIGINT ignored, and SIGTERM's default ends Python without its `finally`
blocks, so a benchmark stopped either way would leave its cluster, node containers or engines behind.
`asyncio.run` cancels its main task on SIGINT when SIGINT has Python's default handler; this restores that
handler and makes SIGTERM send SIGINT, so `finally` blocks (and the processes' stop) run.
"""
from __future__ import annotations

import signal


def stop_cleanly_on_sigterm() -> None:
    """Call before `asyncio.run`, in the main thread."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda _signum, _frame: signal.raise_signal(signal.SIGINT))
