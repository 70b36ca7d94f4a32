"""A CPU engine's worker asks Linux for Intel AMX tiles before its first forward.

vLLM 0.32's CPU attention runs AMX kernels (bf16, block size a multiple of 32) whenever the CPU has AMX. Linux
lets a process touch AMX tile data only after it has asked (`arch_prctl(ARCH_REQ_XCOMP_PERM)`); a process that
has not dies with SIGILL on the first tile instruction. vLLM never asks. oneDNN does, when its own AMX matmul
first runs, and a forward of many tokens runs that in its first layer's projections before any attention; a
forward of one token does not. A decode's first forward after a P/D handoff is exactly one token (the prompt's
KV arrived from prefill), so a decode engine whose first request came before any longer forward died with
"Fatal Python error: Illegal instruction" in `cpu_attention_with_kv_cache`. A plain vLLM 0.32 CPU engine whose
first prompt is one token dies the same way.

Pure apart from the one call into torch it is handed, so it is tested without torch.
"""
from __future__ import annotations

from typing import Any


def request_amx(torch_cpu: Any) -> str | None:
    """Ask for AMX tile permission through torch (`torch.cpu`) when the CPU has AMX. What happened, for the
    log; None when the CPU has no AMX (nothing to ask)."""
    supported = getattr(torch_cpu, "_is_amx_tile_supported", None)
    init = getattr(torch_cpu, "_init_amx", None)
    if supported is None or init is None:
        return ("this torch has no AMX hooks (torch.cpu._is_amx_tile_supported, _init_amx); a first forward of one "
                "token may die with SIGILL on an AMX CPU")
    if not supported():
        return None
    if init():
        return "AMX tile permission granted before the first forward"
    return "the kernel refused AMX tile permission; a first forward of one token may die with SIGILL"
