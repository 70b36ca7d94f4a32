"""A CPU engine's worker asks for AMX tiles before its first forward (connector/plugin/cpu_amx.py).

torch is not installed here, and whether the kernel grants AMX depends on the CPU, so these tests hand
`request_amx` a named fake of `torch.cpu`. On real engines, tests/engines assert the log line, and a decode's
one-token first forward after a push handoff no longer dies with SIGILL.
"""
from __future__ import annotations

from disagg.connector.plugin.cpu_amx import request_amx


class FakeTorchCpu:
    """FAKE: torch.cpu's two private AMX hooks; counts the permission requests."""

    def __init__(self, amx: bool, granted: bool = True) -> None:
        self.amx, self.granted, self.requests = amx, granted, 0

    def _is_amx_tile_supported(self) -> bool:
        return self.amx

    def _init_amx(self) -> bool:
        self.requests += 1
        return self.granted


def test_an_amx_cpu_gets_its_permission_asked_for_once():
    cpu = FakeTorchCpu(amx=True)
    assert request_amx(cpu) == "AMX tile permission granted before the first forward"
    assert cpu.requests == 1


def test_a_cpu_without_amx_asks_nothing_and_says_nothing():
    cpu = FakeTorchCpu(amx=False)
    assert request_amx(cpu) is None
    assert cpu.requests == 0


def test_a_refusal_and_a_torch_without_the_hooks_are_said_out_loud():
    assert "refused" in (request_amx(FakeTorchCpu(amx=True, granted=False)) or "")
    assert "no AMX hooks" in (request_amx(object()) or "")
