"""Run the rendered launch script with /bin/sh.

EFA devices, hugepages and a large /dev/shm cannot exist on a test machine, so `fi_info` and `df` are
replaced by FAKE stand-in executables on PATH (exit 0 / exit 1, or a fixed size report), /proc/meminfo by a
fake file, and the vLLM python by a stub that records its argv. These fakes only stand in for hardware; the
script itself runs unmodified.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from disagg.operator.api import DisaggregatedInference
from disagg.operator.builders import build_children
from disagg.operator.launch_script import render_launch_script

SH = "/bin/sh"
ENGINE_ID = "qwen-decode-0-6f1d2c3a-1b2c-4d5e-8f90-0123456789ab"
MEMINFO_OK = "MemTotal:       2113929216 kB\nHugePages_Total:    2560\nHugePages_Free:     2560\n"


def _exe(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


@dataclass
class Pod:
    """A tmp directory dressed up as an engine container."""

    root: Path
    env: dict[str, str]

    @property
    def termlog(self) -> Path:
        return self.root / "termination-log"

    @property
    def argv_file(self) -> Path:
        return self.root / "argv"

    def fake_fi_info(self, exit_code: int) -> None:
        _exe(self.root / "bin" / "fi_info", f"exit {exit_code}\n")

    def fake_df(self, kib: int) -> None:
        _exe(self.root / "bin" / "df", "echo 'Filesystem 1024-blocks Used Available Capacity Mounted on'\n"
                                       f"echo 'shm {kib} 0 {kib} 0% /dev/shm'\n")

    def run(self, script: str) -> subprocess.CompletedProcess[str]:
        path = self.root / "launch.sh"
        path.write_text(script)
        return subprocess.run([SH, str(path)], env=self.env, capture_output=True, text=True, timeout=30)

    def argv(self) -> list[str]:
        return self.argv_file.read_text().split("\0")[:-1]

    def cpu_bind(self) -> str:
        """VLLM_CPU_OMP_THREADS_BIND as vLLM saw it ("<unset>" when unset)."""
        return (self.root / "cpu-bind").read_text()

    def cpus_allowed(self) -> str:
        """The cores the engine process itself may run on (what it inherited from the script's exec)."""
        return (self.root / "cpus-allowed").read_text().strip()

    def proc_status(self, text: str) -> None:
        """A fake /proc/self/status for the CPU binding."""
        (self.root / "status").write_text(text)
        self.env["DISAGG_PROC_STATUS"] = str(self.root / "status")

    def termination_lines(self) -> list[str]:
        return self.termlog.read_text().splitlines()


@pytest.fixture
def fake_pod(tmp_path: Path) -> Pod:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "shm").mkdir()
    (tmp_path / "meminfo").write_text(MEMINFO_OK)
    # Only the basic tools the script needs: a fi_info installed on this machine must not leak in.
    for tool in ("awk", "rm", "cat"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    # Records its argv, and the CPU binding it was started with.
    python = _exe(bin_dir / "python-stub", f"printf '%s\\0' \"$@\" > '{tmp_path / 'argv'}'\n"
                  f"printf '%s' \"${{VLLM_CPU_OMP_THREADS_BIND-<unset>}}\" > '{tmp_path / 'cpu-bind'}'\n"
                  f"printf '%s' \"${{DISAGG_ENGINE_ID-<unset>}}\" > '{tmp_path / 'engine-id'}'\n"
                  f"awk '/^Cpus_allowed_list/ {{print $2}}' /proc/self/status > '{tmp_path / 'cpus-allowed'}'\n")
    env = {
        "PATH": str(bin_dir),
        "DISAGG_TERMINATION_LOG": str(tmp_path / "termination-log"),
        "DISAGG_MEMINFO": str(tmp_path / "meminfo"),
        "DISAGG_SHM_DIR": str(tmp_path / "shm"),
        "DISAGG_PYTHON": str(python),
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.3.17",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "5600",
        "DISAGG_ENGINE_ID": ENGINE_ID,
    }
    pod = Pod(tmp_path, env)
    pod.fake_fi_info(0)
    pod.fake_df(64 * 1024 * 1024)
    _exe(bin_dir / "g++", "exit 0\n")  # FAKE: the C++ compiler a CPU engine's inductor needs; only its presence counts
    return pod


def script(**overrides) -> str:
    values = dict(role="decode", args=["--model", "Qwen/Qwen3-32B", "--kv-transfer-config",
                                       '{"kv_connector":"NixlPushConnector","engine_id":"$DISAGG_ENGINE_ID"}'],
                  efa_expected=True, hugepages_expected=True, shm_min_kib=1024)
    values.update(overrides)
    return render_launch_script(**values)


def assert_failed_with_one_line(result: subprocess.CompletedProcess[str], pod: Pod, *needles: str) -> str:
    assert result.returncode != 0
    lines = pod.termination_lines()
    assert len(lines) == 1, lines
    for needle in needles:
        assert needle in lines[0]
    assert lines[0] in result.stderr
    assert not pod.argv_file.exists(), "vLLM must not start after a failed preflight"
    return lines[0]


def test_operator_rendered_script_execs_vllm_with_expanded_engine_id(fake_pod):
    cr = DisaggregatedInference.model_validate({"metadata": {"name": "qwen", "namespace": "ml"}, "spec": {
        "model": {"name": "Qwen/Qwen3-32B"}, "accelerator": {"profile": "nvidia-h200"},
        "prefill": {"tensorParallelSize": 4}, "decode": {"tensorParallelSize": 4,
                                                         "args": ["--chat-template", "{{ it's $HOME `x` }}"]}}})
    [cm] = [c for c in build_children(cr) if c["kind"] == "ConfigMap"]
    result = fake_pod.run(cm["data"]["decode.sh"])
    assert result.returncode == 0, result.stderr
    argv = fake_pod.argv()
    assert argv[:2] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--model") + 1] == "Qwen/Qwen3-32B"
    assert argv[argv.index("--tensor-parallel-size") + 1] == "4"
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    # The pod's id plus this start's own suffix, the same in vLLM's config and in the env the plugin reads.
    assert re.fullmatch(re.escape(ENGINE_ID) + r"-[0-9a-f]{8}", config["engine_id"]), config["engine_id"]
    assert (fake_pod.root / "engine-id").read_text() == config["engine_id"]
    assert config["kv_role"] == "kv_consumer"
    # A push decode waits spec.kvTransfer.registrationTimeoutSeconds for its KV, not vLLM's 480 s.
    assert config["kv_connector_extra_config"] == {"backends": ["LIBFABRIC"], "push_registration_timeout": 60}
    # Shell metacharacters in user args reach vLLM verbatim.
    assert argv[-2:] == ["--chat-template", "{{ it's $HOME `x` }}"]
    assert not fake_pod.termlog.exists()


def test_each_start_of_the_container_is_a_new_engine(fake_pod):
    """A container restarted in place keeps its pod's name and UID; its peers must not take it for the old process
    (whose NIXL agent they hold), so every start gets an engine id of its own."""
    ids = set()
    for _ in range(3):
        assert fake_pod.run(script()).returncode == 0
        ids.add(json.loads(fake_pod.argv()[fake_pod.argv().index("--kv-transfer-config") + 1])["engine_id"])
    assert len(ids) == 3 and all(i.startswith(ENGINE_ID + "-") for i in ids)


def test_extra_container_args_are_passed_through(fake_pod):
    path = fake_pod.root / "launch.sh"
    path.write_text(script())
    result = subprocess.run([SH, str(path), "--enforce-eager"], env=fake_pod.env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert fake_pod.argv()[-1] == "--enforce-eager"


def test_missing_efa_provider_fails_naming_efa_and_tcp_fallback(fake_pod):
    fake_pod.fake_fi_info(1)
    line = assert_failed_with_one_line(fake_pod.run(script()), fake_pod, "EFA", "fi_info -p efa")
    assert "TCP" in line


def test_missing_fi_info_fails(fake_pod):
    (fake_pod.root / "bin" / "fi_info").unlink()
    line = assert_failed_with_one_line(fake_pod.run(script()), fake_pod, "EFA", "fi_info is not on PATH")
    assert "TCP" in line


def test_efa_not_expected_skips_efa_and_hugepage_checks(fake_pod):
    (fake_pod.root / "bin" / "fi_info").unlink()
    (fake_pod.root / "meminfo").write_text("HugePages_Total:       0\n")
    result = fake_pod.run(script(efa_expected=False, hugepages_expected=False))
    assert result.returncode == 0, result.stderr
    assert fake_pod.argv_file.exists()


@pytest.mark.parametrize("meminfo, shown", [("HugePages_Total:       0\n", "HugePages_Total is 0"),
                                            ("MemTotal: 1 kB\n", "HugePages_Total is missing")])
def test_no_hugepages_fails(fake_pod, meminfo, shown):
    (fake_pod.root / "meminfo").write_text(meminfo)
    assert_failed_with_one_line(fake_pod.run(script()), fake_pod, "hugepages", shown)


def test_unreadable_meminfo_fails(fake_pod):
    (fake_pod.root / "meminfo").unlink()
    assert_failed_with_one_line(fake_pod.run(script()), fake_pod, "HugePages_Total is missing")


def test_missing_shm_fails(fake_pod):
    (fake_pod.root / "shm").rmdir()
    assert_failed_with_one_line(fake_pod.run(script()), fake_pod, "shared memory", "not mounted")


def test_small_shm_fails(fake_pod):
    """The container runtime's 64 MiB default /dev/shm, i.e. the emptyDir is missing."""
    fake_pod.fake_df(65536)
    assert_failed_with_one_line(fake_pod.run(script(shm_min_kib=32 * 1024 * 1024)), fake_pod,
                                "shared memory", "65536 KiB")


def test_shm_size_check_uses_real_df_when_present(fake_pod):
    (fake_pod.root / "bin" / "df").unlink()
    os.symlink(shutil.which("df"), fake_pod.root / "bin" / "df")
    assert fake_pod.run(script(shm_min_kib=1)).returncode == 0
    fake_pod.argv_file.unlink()
    assert_failed_with_one_line(fake_pod.run(script(shm_min_kib=2 ** 50)), fake_pod, "shared memory")


def test_unwritable_shm_fails(fake_pod):
    """procfs refuses new files even to root, so it stands in for a read-only /dev/shm on any runner."""
    fake_pod.env["DISAGG_SHM_DIR"] = "/proc/1"
    assert_failed_with_one_line(fake_pod.run(script()), fake_pod, "not writable")


@pytest.mark.parametrize("var", ["VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT", "DISAGG_ENGINE_ID"])
@pytest.mark.parametrize("unset", [True, False])
def test_empty_side_channel_env_fails(fake_pod, var, unset):
    if unset:
        del fake_pod.env[var]
    else:
        fake_pod.env[var] = ""
    assert_failed_with_one_line(fake_pod.run(script()), fake_pod, var)


def test_engine_id_that_would_break_json_fails(fake_pod):
    fake_pod.env["DISAGG_ENGINE_ID"] = 'x","kv_role":"kv_both'
    assert_failed_with_one_line(fake_pod.run(script()), fake_pod, "DISAGG_ENGINE_ID")


def test_termination_log_holds_only_the_latest_failure(fake_pod):
    fake_pod.termlog.write_text("stale\nlines\n")
    fake_pod.fake_fi_info(1)
    assert_failed_with_one_line(fake_pod.run(script()), fake_pod, "EFA")


def test_render_rejects_bad_input():
    with pytest.raises(ValueError, match="role"):
        script(role="router")
    with pytest.raises(ValueError, match="shm_min_kib"):
        script(shm_min_kib=-1)


def test_rendered_script_is_valid_posix_sh():
    for efa, bind in ((True, False), (False, False), (False, True)):
        result = subprocess.run([SH, "-n"], input=script(efa_expected=efa, hugepages_expected=efa,
                                                         bind_allowed_cpus=bind),
                                capture_output=True, text=True)
        assert result.returncode == 0, result.stderr


def cpu_script(role: str = "decode") -> str:
    """The operator's own script for a cpu-profile engine."""
    cr = DisaggregatedInference.model_validate({"metadata": {"name": "tiny", "namespace": "ml"}, "spec": {
        "model": {"name": "tiny"}, "accelerator": {"profile": "cpu"}}})
    [cm] = [c for c in build_children(cr) if c["kind"] == "ConfigMap"]
    return str(cm["data"][f"{role}.sh"])


STATUS = "Name:\tpython3\nCpus_allowed:\t4c\nCpus_allowed_list:\t2-3,6\nMems_allowed_list:\t0\n"


def test_cpu_engine_binds_the_cores_the_container_may_run_on(fake_pod):
    """What the kubelet's static CPU manager gives a Guaranteed container shows in its Cpus_allowed_list."""
    fake_pod.proc_status(STATUS)
    result = fake_pod.run(cpu_script())
    assert result.returncode == 0, result.stderr
    assert fake_pod.cpu_bind() == "2-3,6"
    assert "binding decode engine threads to cores 2-3,6" in result.stderr
    config = json.loads(fake_pod.argv()[fake_pod.argv().index("--kv-transfer-config") + 1])
    assert config["kv_buffer_device"] == "cpu" and config["kv_connector_extra_config"]["backends"] == ["UCX"]


def test_cpu_engine_binds_this_machines_allowed_cores_from_the_real_proc(fake_pod):
    result = fake_pod.run(cpu_script())
    assert result.returncode == 0, result.stderr
    cores: set[int] = set()
    for part in fake_pod.cpu_bind().split(","):
        low, _, high = part.partition("-")
        cores |= set(range(int(low), int(high or low) + 1))
    assert cores == os.sched_getaffinity(0)


def test_an_explicit_cpu_binding_wins(fake_pod):
    """A role's env pins the engine itself (the dev node: prefill on core 0, decode on core 1)."""
    fake_pod.proc_status("Cpus_allowed_list:\t0-1\n")
    fake_pod.env["VLLM_CPU_OMP_THREADS_BIND"] = "1"
    result = fake_pod.run(cpu_script())
    assert result.returncode == 0, result.stderr
    assert fake_pod.cpu_bind() == "1"


def test_the_whole_cpu_engine_runs_on_its_cores(fake_pod):
    """Not only vLLM's OpenMP threads: its API server, engine core and worker are confined to the bound cores, so
    no spinning thread of this engine lands on another engine's core."""
    os.symlink(shutil.which("taskset"), fake_pod.root / "bin" / "taskset")
    core = str(min(os.sched_getaffinity(0)))
    fake_pod.env["VLLM_CPU_OMP_THREADS_BIND"] = core
    result = fake_pod.run(cpu_script())
    assert result.returncode == 0, result.stderr
    assert fake_pod.cpus_allowed() == core
    # An accelerator engine is left where the kubelet put it.
    result = fake_pod.run(script(efa_expected=False, hugepages_expected=False))
    assert result.returncode == 0, result.stderr
    assert fake_pod.cpus_allowed() != core or len(os.sched_getaffinity(0)) == 1


@pytest.mark.parametrize("bind, said", [("1", "no taskset in the image"), ("0|1", "not one list of cores")])
def test_a_cpu_engine_that_cannot_be_confined_still_starts_and_says_why(fake_pod, bind, said):
    fake_pod.env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    result = fake_pod.run(cpu_script())
    assert result.returncode == 0, result.stderr
    assert said in result.stderr and fake_pod.cpu_bind() == bind


@pytest.mark.parametrize("status, shown", [("Name:\tpython3\n", "is ''"),
                                           ("Cpus_allowed_list:\t0-1; rm -rf /\n", "not a list of cores")])
def test_cpu_engine_without_a_readable_core_list_fails(fake_pod, status, shown):
    fake_pod.proc_status(status)
    assert_failed_with_one_line(fake_pod.run(cpu_script()), fake_pod, "Cpus_allowed_list", shown,
                                "VLLM_CPU_OMP_THREADS_BIND")


def test_missing_proc_status_fails(fake_pod):
    fake_pod.env["DISAGG_PROC_STATUS"] = str(fake_pod.root / "absent")
    assert_failed_with_one_line(fake_pod.run(cpu_script()), fake_pod, "cannot bind the CPU engine")


def test_accelerator_engines_leave_the_cpu_binding_alone(fake_pod):
    fake_pod.proc_status(STATUS)
    assert fake_pod.run(script()).returncode == 0
    assert fake_pod.cpu_bind() == "<unset>"


@pytest.mark.parametrize("cxx", [None, "clang++"])
def test_a_cpu_engine_image_without_the_compiler_inductor_runs_fails(fake_pod, cxx):
    """vLLM's CPU sampler compiles with torch inductor (CXX, else g++) on the first logprobs or top-k/top-p request:
    an image without that compiler would serve greedy requests and then lose its engine core."""
    if cxx is None:
        (fake_pod.root / "bin" / "g++").unlink()
    else:
        fake_pod.env["CXX"] = cxx
    assert_failed_with_one_line(fake_pod.run(cpu_script()), fake_pod, "no C++ compiler", cxx or "g++", "logprobs")
    assert fake_pod.run(script()).returncode == 0  # an accelerator engine's image is not asked for one
