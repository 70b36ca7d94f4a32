"""Result files: indented JSON whose innermost lists (a request row, an interval) stay on one line, so a file of
thousands of per-request rows stays readable and diffs row by row; past MAX_PLAIN_BYTES the same text is gzipped
(`<name>.json.gz`), every row kept. Only the standard library: the plot scripts import this in a matplotlib-only venv.
"""
from __future__ import annotations

import gzip
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

MAX_PLAIN_BYTES = 1_000_000
"""Past this a result is gzipped: a git diff of so many raw rows is useless, and the repo grows by the file each run."""


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


SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8")
"""CPU features that set how fast vLLM's CPU engines run: the same engine is several times faster with AVX-512
(bf16) than with AVX2 alone."""


def cpu(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    """The CPU's model name and which of SPEED_FLAGS it has (from `cpuinfo`; empty where there is none)."""
    try:
        info = cpuinfo.read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in info.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())  # the first processor's
    flags = set(fields.get("flags", "").split())
    return {"model": fields.get("model name", ""), "flags": [f for f in SPEED_FLAGS if f in flags]}


def machine() -> dict[str, Any]:
    """The machine a result was made on: cores, platform and CPU."""
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "cpu": cpu()}


def provenance() -> dict[str, Any]:
    """What every result records about how it was made: the command, the code (commit, `-dirty` when tracked files
    differ from it), the machine and the load on it when the run began."""
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True).stdout.strip()

    dirty = git("status", "--porcelain", "--untracked-files=no")
    return {"command": " ".join(sys.argv), "commit": git("rev-parse", "HEAD") + ("-dirty" if dirty else ""),
            "machine": {**machine(), "loadavg_at_start": Path("/proc/loadavg").read_text().split()[:3]}}


def _forms(path: Path) -> tuple[Path, Path]:
    """The plain and the gzipped name of the result `path` names either way."""
    plain = path.with_name(path.name.removesuffix(".gz"))
    return plain, plain.with_name(plain.name + ".gz")


def write(path: Path, obj: Any, max_plain_bytes: int = MAX_PLAIN_BYTES) -> Path:
    """Write `dumps(obj)` to `path` (named either way): plain when it is at most `max_plain_bytes`, else gzipped
    beside it as `<name>.gz` (mtime 0: the same result gives the same bytes). The other form, if any, is removed,
    so a result has exactly one file. Returns the path written."""
    plain, packed = _forms(Path(path))
    data = (dumps(obj) + "\n").encode()
    target, stale = (plain, packed) if len(data) <= max_plain_bytes else (packed, plain)
    if target == packed:
        data = gzip.compress(data, mtime=0)
    # Through a temporary file: a run killed mid-write leaves the previous result, not half of the new one.
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(target)
    stale.unlink(missing_ok=True)
    return target


def load(path: Path) -> Any:
    """The result `path` names either way (`x.json` or `x.json.gz`): the named file, else its other form."""
    path = Path(path)
    if not path.exists():
        plain, packed = _forms(path)
        other = packed if path == plain else plain
        path = other if other.exists() else path
    data = path.read_bytes()
    return json.loads(gzip.decompress(data) if path.name.endswith(".gz") else data)


def results(directory: Path) -> dict[str, Any]:
    """Every result in `directory`, keyed by its plain name (`x.json`, whether it is stored gzipped or not), in name
    order. A result stored both ways is an error: which one is current cannot be told."""
    names = sorted(p.name.removesuffix(".gz") for p in [*directory.glob("*.json"), *directory.glob("*.json.gz")])
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{directory}: stored both plain and gzipped (keep the newer, remove the other): {twice}")
    return {name: load(directory / name) for name in names}
