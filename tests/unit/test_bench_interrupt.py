"""A benchmark started in the background (SIGINT ignored) and stopped with SIGTERM still runs its `finally`
(bench/interrupt.py): what stops its cluster or engines."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"

SCRIPT = """
import asyncio, sys
sys.path.insert(0, {bench!r})
from interrupt import stop_cleanly_on_sigterm

async def run():
    try:
        print("running", flush=True)
        await asyncio.Event().wait()  # a benchmark's work: it ends only when stopped
    finally:
        print("cleaned up", flush=True)

stop_cleanly_on_sigterm()
try:
    asyncio.run(run())
except KeyboardInterrupt:
    sys.exit(130)
"""


def test_sigterm_runs_the_benchmarks_finally_even_with_sigint_ignored():
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT.format(bench=str(BENCH))], stdout=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "running"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert "cleaned up" in out
    assert proc.returncode == 130
