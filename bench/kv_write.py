"""One KV handoff's transfer, alone: a NIXL WRITE of a request's KV between two engines' namespaces (issue 15).

A push handoff on the KV-realistic bed moves 16 MiB (256 tokens of kv64k) from prefill to decode, which a TCP
stream between the two namespaces carries in about 11 ms, yet the handoff takes 85-200 ms. This bench isolates
the transfer from vLLM: two processes, each in its own network namespace (devcluster/netns.py) and on its own
core, each with a NIXL agent (UCX over TCP, as `--netns` engines use), the target holding memory laid out as a
vLLM CPU engine's KV cache (one region per layer and K/V, `--block-kib` per block) and the initiator WRITEing
`--blocks` blocks of every region into it, with a notification, as vLLM's push writer does for one request.

Per transfer: the initiator's time from posting the WRITE to NIXL reporting it done, and the time until the
target's poll (every 0.1 ms, where vLLM polls once per engine step) sees the notification. Transfers are
spaced by a random gap, one at a time.

Arms vary what an engine pair has on its cores and how NIXL's progress thread is scheduled:

  idle        nothing else on the cores; the progress thread polls with the `cpu` profile's delay
  busy        a CPU-bound process on each core (an engine's model thread computing the next batch)
  busy-spin   busy, with NIXL's default: the progress thread never sleeps (delay 0)
  busy-nice   busy, NIXL's threads at nice -10 (needs CAP_SYS_NICE)
  busy-slice  busy, NIXL's threads asking the scheduler for a 0.1 ms slice (sched_setattr; no privilege):
              EEVDF lets a waking thread with a shorter slice preempt the running one at once
  busy-low    busy, the CPU-bound processes at nice 10 (an engine lowering its own compute threads)

Arms run in ABBA rounds on fresh processes. Run as root (namespaces, scheduling):
  flock /tmp/disagg-engines.lock .venv/bin/python bench/kv_write.py
Writes bench/results/kv_write.json.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ARMS = {
    # arm: (busy cores, progress delay us, progress thread scheduling)
    "idle": (False, 1000, "normal"),
    "busy": (True, 1000, "normal"),
    "busy-spin": (True, 0, "normal"),
    "busy-nice": (True, 1000, "nice"),
    "busy-slice": (True, 1000, "slice"),
    "busy-low": (True, 1000, "normal"),
}
HOG_NICE = {"busy-low": 10}


def set_slice(tid: int, ns: int) -> None:
    """sched_setattr(2) on one thread: SCHED_OTHER at its nice, with a custom slice of `ns` (Linux >= 6.12)."""
    import ctypes
    import struct

    nice = os.getpriority(os.PRIO_PROCESS, tid)
    # struct sched_attr (SCHED_ATTR_SIZE_VER1): size, policy, flags, nice, priority, runtime, deadline, period,
    # util_min, util_max.
    attr = struct.pack("IIQiIQQQII", 56, 0, 0, nice, 0, ns, 0, 0, 0, 0)
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(attr)
    if libc.syscall(314, tid, buf, 0) != 0:  # SYS_sched_setattr on x86_64
        raise OSError(ctypes.get_errno(), f"sched_setattr({tid}) failed")


# -- the two sides (run inside a namespace, with the vLLM environment's python) ------------------------------------
def _agent(name: str, delay_us: int, sched: str):  # noqa: ANN202 - nixl's agent
    from nixl._api import nixl_agent, nixl_agent_config, nixlBind

    class Bind:  # what connector/plugin/nixl_progress.py does in engines: the delay on the agent's config
        def __getattr__(self, attr: str):  # noqa: ANN204
            return getattr(nixlBind, attr)

        def nixlAgent(self, agent_name: str, config):  # noqa: ANN001, ANN202, N802
            config.pthrDelay = delay_us
            return nixlBind.nixlAgent(agent_name, config)

    import nixl._api as api
    before = set(os.listdir("/proc/self/task"))
    api.nixlBind, real = Bind(), api.nixlBind
    try:
        agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
    finally:
        api.nixlBind = real
    threads = {}
    for tid in sorted(set(os.listdir("/proc/self/task")) - before, key=int):
        comm = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        threads[tid] = comm
        if sched == "slice":
            set_slice(int(tid), 100_000)
        elif sched == "nice":
            os.setpriority(os.PRIO_PROCESS, int(tid), -10)
    return agent, threads


def _wait_file(path: Path, timeout: float = 60) -> bytes:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)  # another process's file: nothing to await
    return path.read_bytes()


def _publish(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.rename(path)


def side(args: argparse.Namespace) -> None:
    import numpy as np

    d = Path(args.dir)
    agent, threads = _agent(args.role, args.delay_us, args.sched)
    region = args.regions_blocks * args.block_kib * 1024
    mem = [np.ones(region, dtype=np.uint8) for _ in range(args.regions)]
    agent.register_memory([(m.ctypes.data, m.nbytes, 0, "") for m in mem], "DRAM")
    peer = "initiator" if args.role == "target" else "target"
    _publish(d / f"{args.role}.meta", agent.get_agent_metadata())
    _publish(d / f"{args.role}.addrs", json.dumps([m.ctypes.data for m in mem]).encode())
    agent.add_remote_agent(_wait_file(d / f"{peer}.meta"))
    block = args.block_kib * 1024
    if args.role == "target":
        seen: dict[str, float] = {}
        _publish(d / "target.ready", b"")
        while "stop" not in seen:
            for msgs in agent.get_new_notifs().values():
                now = time.monotonic()
                for m in msgs:
                    seen.setdefault(m.decode(), now)
            time.sleep(0.0001)
        _publish(d / "target.out", json.dumps({"notified": seen, "threads": threads}).encode())
        return
    remote = json.loads(_wait_file(d / "target.addrs"))
    _wait_file(d / "target.ready")

    def blocks(bases: list[int]) -> list[tuple[int, int, int]]:
        return [(base + b * block, block, 0) for base in bases for b in range(args.regions_blocks)]

    local_h = agent.prep_xfer_dlist("NIXL_INIT_AGENT", blocks([m.ctypes.data for m in mem]), "DRAM")
    remote_h = agent.prep_xfer_dlist("target", blocks(remote), "DRAM")
    rng = random.Random(args.seed)
    posted, done = {}, {}
    agent.make_connection("target")
    for i in range(-args.warmup, args.transfers):
        # A request's blocks: `--blocks` of each region, not adjacent to the last request's.
        first = rng.randrange(0, args.regions_blocks - args.blocks)
        idx = [r * args.regions_blocks + first + k for r in range(args.regions) for k in range(args.blocks)]
        time.sleep(rng.uniform(args.gap_ms[0], args.gap_ms[1]) / 1000)
        handle = agent.make_prepped_xfer("WRITE", local_h, idx, remote_h, idx, str(i).encode())
        t0 = time.monotonic()
        state = agent.transfer(handle)
        while state not in ("DONE", "ERR"):
            time.sleep(0.0001)
            state = agent.check_xfer_state(handle)
        t1 = time.monotonic()
        if state == "ERR":
            raise RuntimeError(f"transfer {i} failed")
        agent.release_xfer_handle(handle)
        if i >= 0:
            posted[str(i)], done[str(i)] = t0, t1
    agent.send_notif("target", b"stop")
    _publish(d / "initiator.out", json.dumps({"posted": posted, "done": done, "threads": threads}).encode())


# -- the orchestrator -------------------------------------------------------------------------------------------
def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def stats(ms: list[float]) -> dict:
    return {"p50_ms": round(quantile(ms, 0.5), 2), "p90_ms": round(quantile(ms, 0.9), 2),
            "p99_ms": round(quantile(ms, 0.99), 2), "mean_ms": round(sum(ms) / len(ms), 2), "n": len(ms)}


def run_arm(arm: str, args: argparse.Namespace, python: str, slots: list, seed: int) -> dict:
    busy, delay, sched = ARMS[arm]
    hogs = []
    if busy:
        for core in (0, 1):
            hogs.append(subprocess.Popen(["nice", "-n", str(HOG_NICE.get(arm, 0)), "taskset", "-c", str(core),
                                          sys.executable, "-c", "while True: pass"]))
    with tempfile.TemporaryDirectory(prefix="kv-write-") as d:
        env = {**os.environ, "UCX_TLS": args.ucx_tls, "PYTHONUNBUFFERED": "1", **dict(args.env)}
        procs = []
        for core, role in ((1, "target"), (0, "initiator")):  # decode on core 1, prefill on core 0
            argv = [*slots[core].exec_prefix(), "taskset", "-c", str(core), python, str(Path(__file__)),
                    "--side", role, "--dir", d, "--delay-us", str(delay), "--sched", sched, "--seed", str(seed),
                    "--transfers", str(args.transfers), "--blocks", str(args.blocks), "--regions",
                    str(args.regions), "--block-kib", str(args.block_kib), "--regions-blocks",
                    str(args.regions_blocks), "--gap-ms", *map(str, args.gap_ms), "--warmup", str(args.warmup)]
            procs.append(subprocess.Popen(argv, env=env))
        try:
            for p in procs:
                if p.wait(timeout=600) != 0:
                    raise RuntimeError(f"{arm}: a side exited {p.returncode}")
        finally:
            for p in procs + hogs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        target = json.loads((Path(d) / "target.out").read_text())
        init = json.loads((Path(d) / "initiator.out").read_text())
    rows = [[int(i), round((init["done"][i] - t0) * 1000, 3),
             round((target["notified"][i] - t0) * 1000, 3) if i in target["notified"] else None]
            for i, t0 in sorted(init["posted"].items(), key=lambda kv: int(kv[0]))]
    return {"rows": rows, "threads": {"initiator": init["threads"], "target": target["threads"]}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--side", choices=("target", "initiator"), dest="role")
    p.add_argument("--dir")
    p.add_argument("--delay-us", type=int, default=1000)
    p.add_argument("--sched", default="normal", choices=("normal", "nice", "slice"))
    p.add_argument("--arms", default="idle,busy,busy-spin,busy-nice,busy-slice,busy-low")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--transfers", type=int, default=100, help="per arm and round")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--regions", type=int, default=32, help="KV regions: kv64k has 16 layers x K and V")
    p.add_argument("--block-kib", type=int, default=256, help="kv64k: 128 tokens x 8 heads x 128 dims x 2 bytes")
    p.add_argument("--blocks", type=int, default=2, help="blocks per region per transfer: 2 = 256 tokens")
    p.add_argument("--regions-blocks", type=int, default=64, help="blocks in each region")
    p.add_argument("--gap-ms", type=float, nargs=2, default=[20.0, 60.0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ucx-tls", default="tcp,self")
    p.add_argument("--env", action="append", default=[], type=lambda s: tuple(s.split("=", 1)),
                   help="NAME=VALUE for both sides (UCX settings), repeatable")
    p.add_argument("--out", default=str(HERE / "results" / "kv_write.json"))
    args = p.parse_args()
    if args.role:
        side(args)
        return
    sys.path.insert(0, str(HERE))
    import result_file
    from pd_serving import abba

    from disagg.devcluster import netns, vllm_env

    made = result_file.provenance()
    python = str(vllm_env.ensure(quiet=True))
    network = netns.Network(prefix="dgk", subnet="10.233.0.0/24")
    slots = network.setup(2)
    arms = [a for a in args.arms.split(",") if a]
    results: dict[str, list] = {a: [] for a in arms}
    threads: dict = {}
    try:
        for r, arm in abba(arms, args.rounds):
            t = time.monotonic()
            got = run_arm(arm, args, python, slots, args.seed + r)
            results[arm] += [[r, *row] for row in got["rows"]]
            threads[arm] = got["threads"]
            done = [row[1] for row in got["rows"]]
            print(f"{arm} round {r}: done p50 {quantile(done, .5):.1f} p99 {quantile(done, .99):.1f} ms "
                  f"({time.monotonic() - t:.0f} s)", flush=True)
    finally:
        network.teardown()
    mib = args.regions * args.blocks * args.block_kib / 1024
    out = {
        **made, "benchmark": "kv_write", "issue": 15, "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {"mib_per_transfer": mib, "descriptors": args.regions * args.blocks, "block_kib": args.block_kib,
                   "ucx_tls": args.ucx_tls, "env": dict(args.env), "transfers_per_round": args.transfers,
                   "rounds": args.rounds, "gap_ms": args.gap_ms,
                   "layout": "initiator (prefill) on core 0 and target (decode) on core 1, each in its own network "
                             "namespace joined by veths on one bridge (MTU 9001)"},
        "definitions": {"done": "initiator: WRITE posted to NIXL reporting it done",
                        "notified": "WRITE posted to the target's 0.1 ms poll seeing the notification"},
        "arms": {a: {"spec": dict(zip(("busy", "delay_us", "sched"), ARMS[a], strict=True)),
                     "done": stats([row[2] for row in rows]),
                     "notified": stats([row[3] for row in rows if row[3] is not None]),
                     "threads": threads.get(a),
                     # [round, transfer, done ms, notified ms]
                     "rows": rows} for a, rows in results.items()},
    }
    result_file.write(Path(args.out), out)
    for a, v in out["arms"].items():
        print(f"{a:10s} done p50 {v['done']['p50_ms']:7.1f} p99 {v['done']['p99_ms']:7.1f}   notified p50 "
              f"{v['notified']['p50_ms']:7.1f} p99 {v['notified']['p99_ms']:7.1f} ms")


if __name__ == "__main__":
    main()
