"""Run a command so that its whole process tree dies with our parent.

PR_SET_PDEATHSIG reaches only a direct child; vLLM's API server forks an engine core and workers that
would outlive a killed test run. This supervisor is that direct child: when its parent dies it gets SIGTERM
and takes the command's whole process group down with it.

Usage: python -m disagg.devcluster.supervise -- CMD [ARGS...]   (or run this file directly)
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from types import FrameType
from typing import NoReturn


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--":
        argv = argv[1:]
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    child = subprocess.Popen(argv, start_new_session=True)

    def stop(signum: int, _frame: FrameType | None) -> NoReturn:
        try:
            os.killpg(child.pid, signal.SIGTERM)
            child.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    if os.getppid() == 1:  # the parent died before the death signal was armed
        stop(signal.SIGTERM, None)
    return child.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
