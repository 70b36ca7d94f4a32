"""Render the engine launch script (`launch.sh.j2`): preflight checks, then `exec` vLLM.

Takes plain values only; the operator computes them from the spec.
"""
from __future__ import annotations

import functools
import shlex
from collections.abc import Sequence
from pathlib import Path

import jinja2

from disagg.connector.wire.env import ROLES

# Written literally into vLLM arguments by the operator (the engine id is only known inside the pod: the pod name
# plus UID, and a suffix the script draws at each start). The rendered script replaces every occurrence with the
# runtime value of $DISAGG_ENGINE_ID; nothing else in an argument is expanded.
ENGINE_ID_PLACEHOLDER = "$DISAGG_ENGINE_ID"

# Beside this module (package data). Not importlib.resources: disagg.operator is a namespace package.
_TEMPLATE = Path(__file__).with_name("launch.sh.j2")


def _quote(arg: str) -> str:
    """Shell-quote one argument, splicing "${DISAGG_ENGINE_ID}" where the placeholder was."""
    return '"${DISAGG_ENGINE_ID}"'.join(shlex.quote(part) for part in arg.split(ENGINE_ID_PLACEHOLDER))


def _lines(args: Sequence[str]) -> list[str]:
    """Quoted arguments grouped one option per line: a `--flag` with its value when the value is no flag."""
    lines: list[str] = []
    i = 0
    while i < len(args):
        if args[i].startswith("-") and i + 1 < len(args) and not args[i + 1].startswith("-"):
            lines.append(f"{_quote(args[i])} {_quote(args[i + 1])}")
            i += 2
        else:
            lines.append(_quote(args[i]))
            i += 1
    return lines


@functools.cache
def _template() -> jinja2.Template:
    """Compiled once per process: compiling costs milliseconds, and every reconcile pass renders the script."""
    text = _TEMPLATE.read_text(encoding="utf-8")
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, autoescape=False, trim_blocks=True,
                             lstrip_blocks=True, keep_trailing_newline=True)
    return env.from_string(text)


def render_launch_script(*, role: str, args: Sequence[str], efa_expected: bool, hugepages_expected: bool,
                         shm_min_kib: int, bind_allowed_cpus: bool = False) -> str:
    """The POSIX sh script that checks the pod's EFA, hugepages, /dev/shm and side-channel env, then runs
    `python3 -m vllm.entrypoints.openai.api_server <args>`. `bind_allowed_cpus` (CPU engines): unless the env
    sets VLLM_CPU_OMP_THREADS_BIND, set it to the cores the container may run on (`Cpus_allowed_list`)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if shm_min_kib < 0:
        raise ValueError(f"shm_min_kib must be >= 0, got {shm_min_kib}")
    return _template().render(role=role, arg_lines=_lines(args), efa_expected=bool(efa_expected),
                              hugepages_expected=bool(hugepages_expected), shm_min_kib=int(shm_min_kib),
                              bind_allowed_cpus=bool(bind_allowed_cpus))
