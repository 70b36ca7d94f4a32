"""Result files: indented JSON whose innermost lists (a request row, an interval) stay on one line, so a file of
thousands of per-request rows stays readable and diffs row by row."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any


def _flat(value: Any) -> bool:
    return isinstance(value, list) and not any(isinstance(v, (list, dict)) for v in value)


def dumps(obj: Any, indent: int = 2, _level: int = 0) -> str:
    """json.dumps(obj, indent=indent), except that lists of scalars are written on one line."""
    if _flat(obj) or not isinstance(obj, (list, dict)) or not obj:
        return json.dumps(obj)
    pad, inner = " " * (indent * _level), " " * (indent * (_level + 1))
    if isinstance(obj, dict):
        items = [f"{inner}{json.dumps(str(k))}: {dumps(v, indent, _level + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    return "[\n" + ",\n".join(inner + dumps(v, indent, _level + 1) for v in obj) + "\n" + pad + "]"


def provenance() -> dict[str, Any]:
    """What every result records about how it was made: the command, the code (commit, `-dirty` when tracked files
    differ from it), the machine and the load on it when the run began."""
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True).stdout.strip()

    dirty = git("status", "--porcelain", "--untracked-files=no")
    return {"command": " ".join(sys.argv), "commit": git("rev-parse", "HEAD") + ("-dirty" if dirty else ""),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                        "loadavg_at_start": Path("/proc/loadavg").read_text().split()[:3]}}
