"""Run a command so that its whole process tree dies with our parent.

PR_SET_PDEATHSIG reaches only a direct child; vLLM's API server forks an engine core and workers that
would outlive a killed test run. This supervisor is that direct child: when its parent dies (or it gets
SIGTERM) it sends SIGTERM to the command, and once the command has exited, or after GRACE_SECONDS, kills
whatever is left of the command's process group.

Usage: python -m disagg.devcluster.supervise -- CMD [ARGS...]   (or run this file directly)
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
from types import FrameType

GRACE_SECONDS = 15
"""How long the command's process group has to exit after SIGTERM before it is killed."""


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--":
        argv = argv[1:]
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    child = subprocess.Popen(argv, start_new_session=True)
    stopping: list[int] = []

    def kill_group() -> None:
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def stop(signum: int, _frame: FrameType | None) -> None:
        # Only signal here, never wait: the handler runs inside the main thread's child.wait(), which holds the
        # Popen's wait lock, so a wait in here could not reap the child and always ran into its full timeout
        # (every engine stop took 15 s). The main thread's wait returns as soon as the command exits.
        if stopping:
            return
        stopping.append(signum)
        # SIGTERM to the command alone, which stops its own children in order (vLLM's API server stops the engine
        # core, which stops its workers). Signalling the whole group killed the workers under a running engine
        # core, which then logged a fatal "RuntimeError: cancelled" on every stop.
        try:
            os.kill(child.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        timer = threading.Timer(GRACE_SECONDS, kill_group)
        timer.daemon = True
        timer.start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    if os.getppid() == 1:  # the parent died before the death signal was armed
        stop(signal.SIGTERM, None)
    code = child.wait()
    if not stopping:
        return code
    kill_group()  # whatever of the group outlived its leader's orderly exit
    return 128 + stopping[0]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
