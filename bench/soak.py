"""A chaos soak on the real node (issue 34): load through the router's Service for an hour while faults are injected
at random, every answer checked, every fault's damage and recovery measured.

The tiny-cpu example in push mode (one prefill and one decode: what two cores hold; two routers; pair wait 240 s)
is applied to the dev cluster's real node, with the operator installed by its chart. A seeded open-loop stream
goes through the router's Service for `--seconds`: background completions (streamed, run to their end) and
verification requests whose greedy answers were recorded on the quiet deployment first (the trained tiny model:
a different answer is a wrong token). Between quiet gaps, one fault at a time, the kinds in shuffled cycles so
that each comes up as often:

  delete-prefill, delete-decode, delete-router,   kubectl delete pod (SIGTERM, the grace period)
  delete-rendezvous, delete-operator
  kill-prefill, kill-decode, kill-router,          kubectl delete pod --grace-period=0 --force (SIGKILL)
  kill-rendezvous, kill-operator
  partition                                       prefill and decode drop each other's packets (iptables in
                                                  both pods' network namespaces) for --partition-seconds
  slow-link                                       prefill's interface (the KV's way out) sends at most
                                                  --slow-rate (tc tbf) for --slow-seconds. A bandwidth limit, not
                                                  a delay: this kernel has no netem ("Error: Specified qdisc kind
                                                  is unknown.")

After each fault the soak waits for recovery: the CR Ready, every one of its pods Ready, both engines advertised,
and a verification request answered correctly; the seconds from the fault to that are its recovery time. Every
request is attributed to the fault window it was sent in (from the fault until recovery) or to `quiet`.

Reported: requests sent, failed (by fault kind and cause), wrong (the goal: 0); recovery time per fault kind; and
the RSS of the router and rendezvous processes sampled every 30 s over the run (their growth is the leak check).

  flock /tmp/disagg-engines.lock .venv/bin/python bench/soak.py            # --seconds 3600: about 75 minutes
  .venv/bin/python bench/soak.py --emulated 8 --out bench/results/soak_emulated.json   # 16 emulated engines
Writes bench/results/soak.json, and every container's log beside it (`<out>.logs/`, not committed: tens of MB).
`--quick` runs a few minutes to check the harness.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import aiohttp
import result_file
from interrupt import stop_cleanly_on_sigterm
from lightkube import codecs
from pd_client import dist, quantile

from disagg.connector.wire import env as wire_env
from disagg.devcluster import demo, demo_node, storm, tinymodel
from disagg.devcluster.cluster import ClusterConfig, LocalCluster
from disagg.devcluster.images import engine
from disagg.operator import names
from disagg.operator.bindings import DinfResource

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
NAMESPACE = demo_node.NAMESPACE
FAULTS = ("delete-prefill", "delete-decode", "delete-router", "delete-rendezvous", "delete-operator",
          "kill-prefill", "kill-decode", "kill-router", "kill-rendezvous", "kill-operator", "partition", "slow-link")
OPERATOR_NAMESPACE = demo.RELEASE_NAMESPACE


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- the load ----------------------------------------------------------------------------------------------------
@dataclass
class Sent:
    kind: str  # "background" or "verify"
    at: float  # seconds since the load began
    window: str  # the window it was sent in
    done: float | None = None  # seconds since the load began, when its answer ended (or failed)
    status: int = 0
    wrong: bool = False
    error: str | None = None
    ttft: float | None = None
    request_id: str | None = None  # the router's X-Request-Id of a failed request (its access log line has the why)


@dataclass
class Load:
    url: str
    references: list[storm.Reference]
    rate: float
    verify_rate: float
    seed: int
    window: str = "quiet"
    sent: list[Sent] = field(default_factory=list)
    t0: float = field(default_factory=time.monotonic)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=420)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s:
            await asyncio.gather(self._arrivals(s, self.rate, self._background, 1),
                                 self._arrivals(s, self.verify_rate, self._verify, 2))

    async def _arrivals(self, session: aiohttp.ClientSession, rate: float, one: Any, k: int) -> None:
        rng = random.Random(self.seed * 10 + k)
        pending: set[asyncio.Task[None]] = set()
        at = time.monotonic()
        while not self._stop.is_set():
            at += rng.expovariate(rate)
            try:
                await asyncio.wait_for(self._stop.wait(), max(0.0, at - time.monotonic()))
                break
            except TimeoutError:
                pass
            r = Sent("background" if k == 1 else "verify", round(time.monotonic() - self.t0, 3), self.window)
            self.sent.append(r)
            task = asyncio.create_task(one(session, r, random.Random(rng.getrandbits(64))))
            pending.add(task)
            task.add_done_callback(pending.discard)
        if pending:
            await asyncio.wait(pending)

    async def _background(self, session: aiohttp.ClientSession, r: Sent, rng: random.Random) -> None:
        report = storm.StormReport()
        await storm.background(session, self.url, rng, (64, 320), report)
        r.status, r.ttft = report.background[0]
        if report.background_errors:
            _, r.request_id, r.error = report.background_errors[0]
        r.done = round(time.monotonic() - self.t0, 3)

    async def _verify(self, session: aiohttp.ClientSession, r: Sent, rng: random.Random) -> None:
        i = rng.randrange(len(self.references))
        v = await storm.verify(session, self.url, i, self.references[i], stream=rng.random() < 0.5)
        r.status = v.status
        r.wrong = v.status == 200 and v.text != self.references[i].text
        r.error = None if v.status == 200 else (v.text or "")[:200]
        r.done = round(time.monotonic() - self.t0, 3)

    def stop(self) -> None:
        self._stop.set()


# -- the deployment and its faults ---------------------------------------------------------------------------------
class Deployment:
    """The soak's CR: the tiny-cpu example (real engines, one per role), or `emulated` engines per role (the engine
    emulator fitted to the CPU engines, connector/emulator/)."""

    def __init__(self, c: LocalCluster, emulated: int = 0) -> None:
        assert c.node is not None
        self.c, self.client = c, c.client()
        self.replicas = emulated or 1
        if emulated:
            self.cr = {"apiVersion": "serving.disagg.io/v1alpha1", "kind": "DisaggregatedInference",
                       "metadata": {"name": "emulated"},
                       "spec": {"model": {"name": "tiny"}, "accelerator": {"profile": "cpu"},
                                "engine": {"emulator": {"profile": "cpu-kv64k"}}, "kvTransfer": {"mode": "push"},
                                "prefill": {"replicas": emulated}, "decode": {"replicas": emulated}}}
        else:
            self.cr = demo_node.tiny_cr(c.node.images, engine.host_env().mounts, "push")
        self.cr["metadata"]["namespace"] = NAMESPACE
        self.cr["spec"]["router"] = {**self.cr["spec"].get("router", {}), "replicas": 2, "pairWaitSeconds": 240}
        self.name = self.cr["metadata"]["name"]

    def pods(self, component: str | None = None, namespace: str = NAMESPACE) -> list[Any]:
        from lightkube.resources.core_v1 import Pod

        labels = {names.LABEL_INSTANCE: self.name, **({names.LABEL_COMPONENT: component} if component else {})}
        if namespace == OPERATOR_NAMESPACE:
            labels = {}
        return [p for p in self.client.list(Pod, namespace=namespace, labels=labels)
                if p.metadata.deletionTimestamp is None]

    def missing(self, routers: int = 2) -> str | None:
        """None when the deployment is whole again, else what is still missing."""
        dinf = self.client.get(DinfResource, self.name, namespace=NAMESPACE).to_dict()
        conds = {c["type"]: c for c in (dinf.get("status") or {}).get("conditions", [])}
        if conds.get("Ready", {}).get("status") != "True":
            return f"not Ready: {conds.get('Ready', {}).get('message', '')[:120]}"
        want = {"prefill": self.replicas, "decode": self.replicas, names.ROUTER: routers, names.RENDEZVOUS: 1}
        for component, n in want.items():
            ready = [p for p in self.pods(component) if _ready(p)]
            if len(ready) != n:
                return f"{len(ready)}/{n} {component} pods Ready"
        if not [p for p in self.pods(namespace=OPERATOR_NAMESPACE) if _ready(p)]:
            return "no operator pod Ready"
        rendezvous = demo_node.service_url(self.client, names.rendezvous_name(self.name))
        try:
            with urllib.request.urlopen(rendezvous + "/v1/engines", timeout=5) as r:
                engines = json.load(r)["engines"]
        except OSError as e:
            return f"rendezvous: {e}"
        roles = Counter(e["role"] for e in engines)
        if roles != {"prefill": self.replicas, "decode": self.replicas}:
            return f"advertised: {dict(roles)}"
        return None

    def delete(self, pod: Any, force: bool, namespace: str = NAMESPACE) -> None:
        from lightkube.resources.core_v1 import Pod

        self.client.delete(Pod, pod.metadata.name, namespace=namespace, grace_period=0 if force else None)


def _ready(pod: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or [])) \
        if pod.status else False


def _pid_of(pod_name: str) -> int:
    """A process of the engine pod `pod_name` on this host (engine containers get POD_NAME from the downward API):
    its network namespace is the pod's."""
    needle = f"{wire_env.POD_NAME}={pod_name}".encode()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if needle in (d / "environ").read_bytes().split(b"\0"):
                    return int(d.name)
            except OSError:
                continue
    raise LookupError(f"no process of pod {pod_name} on this host")


def _in_netns(pid: int, *argv: str) -> None:
    out = subprocess.run(["nsenter", "-t", str(pid), "-n", *argv], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {out.returncode}: {out.stderr.strip()}")


async def inject(dep: Deployment, kind: str, args: argparse.Namespace) -> str:
    """Do the fault (and undo it, for the timed ones); returns what was done."""
    action, _, target = kind.partition("-")
    if action in ("delete", "kill"):
        force = action == "kill"
        if target == "operator":
            pod = dep.pods(namespace=OPERATOR_NAMESPACE)[0]
            dep.delete(pod, force, OPERATOR_NAMESPACE)
        else:
            component = {"router": names.ROUTER, "rendezvous": names.RENDEZVOUS}.get(target, target)
            pod = random.choice(dep.pods(component))
            dep.delete(pod, force)
        return f"{'force-' if force else ''}deleted pod {pod.metadata.name}"
    prefill, decode = random.choice(dep.pods("prefill")), random.choice(dep.pods("decode"))
    if kind == "partition":
        rules = [(prefill, decode.status.podIP), (decode, prefill.status.podIP)]
        for pod, peer in rules:
            pid = _pid_of(pod.metadata.name)
            _in_netns(pid, "iptables", "-I", "INPUT", "-s", peer, "-j", "DROP")
            _in_netns(pid, "iptables", "-I", "OUTPUT", "-d", peer, "-j", "DROP")
        await asyncio.sleep(args.partition_seconds)  # the fault's length
        for pod, peer in rules:
            pid = _pid_of(pod.metadata.name)
            _in_netns(pid, "iptables", "-D", "INPUT", "-s", peer, "-j", "DROP")
            _in_netns(pid, "iptables", "-D", "OUTPUT", "-d", peer, "-j", "DROP")
        return f"{prefill.metadata.name} <-> {decode.metadata.name} dropped for {args.partition_seconds:g} s"
    if kind == "slow-link":
        pid = _pid_of(prefill.metadata.name)
        _in_netns(pid, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", args.slow_rate, "burst", "32kbit",
                  "latency", "400ms")
        await asyncio.sleep(args.slow_seconds)  # the fault's length
        _in_netns(pid, "tc", "qdisc", "del", "dev", "eth0", "root")
        return f"{prefill.metadata.name}: sending at most {args.slow_rate} for {args.slow_seconds:g} s"
    raise ValueError(kind)


async def await_recovered(dep: Deployment, load: Load, timeout: float) -> float | None:
    """Seconds until the deployment is whole and a verification request is answered right, or None."""
    t0 = time.monotonic()
    last = ""
    async with aiohttp.ClientSession() as s:
        while time.monotonic() - t0 < timeout:
            missing = await asyncio.to_thread(dep.missing)
            if missing is None:
                ref = load.references[0]
                v = await storm.verify(s, load.url, 0, ref, stream=False)
                if v.status == 200 and v.text == ref.text:
                    return time.monotonic() - t0
                missing = f"verification: {v.status}"
            if missing != last:
                log(f"    waiting: {missing}")
                last = missing
            await asyncio.sleep(1)  # progress output; another system's state has nothing to await
    return None


def restarts(dep: Deployment, seen: dict[tuple[str, str], int], at: float) -> list[dict[str, Any]]:
    """Containers of the soak's pods that restarted since last seen, each with the tail of its previous run's log.
    A deleted pod comes back as a new pod at restart count 0, so every restart here is a crash of its own."""
    found = []
    for pod in dep.pods():
        for status in (pod.status.containerStatuses or []) if pod.status else []:
            key = (pod.metadata.uid, status.name)
            if status.restartCount > seen.get(key, 0):
                out = subprocess.run([str(dep.c.bin / "kubectl"), f"--kubeconfig={dep.c.kubeconfig}", "logs", "-n",
                                      NAMESPACE, pod.metadata.name, "-c", status.name, "--previous", "--tail=150"],
                                     capture_output=True, text=True)
                found.append({"at_s": round(at, 1), "pod": pod.metadata.name, "container": status.name,
                              "restarts": status.restartCount, "previous_log": (out.stdout + out.stderr)[-20000:]})
                log(f"  {pod.metadata.name}/{status.name} restarted on its own ({status.restartCount})")
            seen[key] = status.restartCount
    return found


# -- logs ------------------------------------------------------------------------------------------------------------
class LogFollower:
    """Every container of the soak's pods (and the operator's) followed into a file of its own as long as it runs
    (`kubectl logs -f --timestamps`), so that a failure can be read in the logs of pods the soak itself deleted
    since: the routers' access logs (one JSON line per request, with its X-Request-Id, attempts and error), the
    engines', the rendezvous' and the operator's. A StatefulSet's pod comes back under its name, and a restarted
    container keeps its pod's: each container instance (its containerID) is followed, appended to one file per
    pod name and container."""

    def __init__(self, dep: Deployment, into: Path) -> None:
        self.dep, self.into = dep, into
        self.procs: dict[str, subprocess.Popen[bytes]] = {}  # containerID -> its follower
        into.mkdir(parents=True, exist_ok=True)

    def poll(self) -> None:
        for namespace in (NAMESPACE, OPERATOR_NAMESPACE):
            for pod in self.dep.pods(namespace=namespace):
                for status in (pod.status.containerStatuses or []) if pod.status else []:
                    key = status.containerID
                    running = status.state is not None and status.state.running is not None
                    if not key or key in self.procs or not running:
                        continue
                    out = (self.into / f"{pod.metadata.name}_{status.name}.log").open("ab")
                    self.procs[key] = subprocess.Popen(
                        [str(self.dep.c.bin / "kubectl"), f"--kubeconfig={self.dep.c.kubeconfig}", "logs", "-f",
                         "--timestamps", "-n", namespace, pod.metadata.name, "-c", status.name],
                        stdout=out, stderr=subprocess.STDOUT)
                    out.close()  # the child has its own descriptor

    async def run(self, stop: asyncio.Event) -> None:
        """Until `stop`; never raises (the logs are for reading a failure, not a reason to lose the run)."""
        while not stop.is_set():
            try:
                await asyncio.to_thread(self.poll)
            except Exception as e:  # noqa: BLE001 - an apiserver hiccup: the next poll follows what was missed
                log(f"  following logs: {type(e).__name__}: {e}")
            try:
                await asyncio.wait_for(stop.wait(), 3)
            except TimeoutError:
                pass
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)


# -- memory ----------------------------------------------------------------------------------------------------------
def rss_by_component() -> dict[str, int]:
    """KiB of resident memory of every `disagg router` and `disagg rendezvous` process on this host (the pods'),
    the largest of each."""
    out: dict[str, int] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
            if len(cmd) < 3 or not cmd[1].endswith(b"disagg") or cmd[2] not in (b"router", b"rendezvous"):
                continue
            rss = next(int(line.split()[1]) for line in (d / "status").read_text().splitlines()
                       if line.startswith("VmRSS:"))
        except (OSError, StopIteration, ValueError):
            continue
        out[cmd[2].decode()] = max(out.get(cmd[2].decode(), 0), rss)
    return out


async def sample_memory(series: list[dict[str, Any]], t0: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        series.append({"s": round(time.monotonic() - t0), **rss_by_component()})
        try:
            await asyncio.wait_for(stop.wait(), 30)
        except TimeoutError:
            pass


# -- the run ---------------------------------------------------------------------------------------------------------
async def run(args: argparse.Namespace) -> dict[str, Any]:
    # SIGTERM cancels the run like Ctrl-C, so the cluster and the real node's pods are cleaned up either way (a
    # soak started in the background from a script ignores SIGINT).
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    made = result_file.provenance()
    c = LocalCluster(ClusterConfig(name="bench-soak", real_node=True))  # emulated engines run on it too
    c.start(progress=lambda m: log(f"  {m}"))
    try:
        assert c.node is not None
        demo._helm_install(c, c.node.images["disagg"])
        demo_node.prepare(c, c.node.spec.name)
        dep = Deployment(c, args.emulated)
        dep.client.create(codecs.from_dict(dep.cr))
        log(f"{dep.name}: applied ({dep.replicas} prefill + {dep.replicas} decode"
            f"{' emulated' if args.emulated else ''}, push, 2 routers); awaiting it whole")
        ready = await await_recovered_setup(dep, args)
        url = demo_node.service_url(dep.client, names.router_name(dep.name))
        prompts = storm.corpus_windows(tinymodel.corpus(), (120, 200, 280, 340), seed=args.seed)
        async with aiohttp.ClientSession() as s:
            refs = [await storm.record(s, url, "completions", p, 24) for p in prompts]
        if not args.emulated:  # the trained model: every answer token is sure (an emulator's are made up)
            assert all(r.margin >= 2.0 for r in refs), [r.margin for r in refs]
        load = Load(url, refs, args.rate, args.verify_rate, args.seed)
        running = asyncio.create_task(load.run())
        memory: list[dict[str, Any]] = []
        stop_memory = asyncio.Event()
        sampler = asyncio.create_task(sample_memory(memory, load.t0, stop_memory))
        logs = asyncio.create_task(LogFollower(dep, args.out.with_suffix(".logs")).run(stop_memory))
        rng = random.Random(args.seed)
        faults: list[dict[str, Any]] = []
        crashes: list[dict[str, Any]] = []
        seen: dict[tuple[str, str], int] = {}
        await asyncio.to_thread(restarts, dep, seen, 0.0)
        cycle: list[str] = []
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            await asyncio.sleep(rng.uniform(*args.quiet))  # the quiet gap between faults is part of the plan
            if time.monotonic() >= end:
                break
            if not cycle:
                cycle = rng.sample(list(args.faults), len(args.faults))
            kind = cycle.pop()
            load.window = f"{kind}#{len(faults)}"
            at = time.monotonic() - load.t0
            log(f"fault {len(faults)}: {kind}")
            injected = True
            try:
                what = await inject(dep, kind, args)
            except Exception as e:  # noqa: BLE001 - a fault that could not be made is reported, the soak goes on
                injected, what = False, f"could not inject: {type(e).__name__}: {e}"
            recovered = await await_recovered(dep, load, args.recovery_timeout)
            log(f"  {what}; recovered in {recovered if recovered is None else round(recovered, 1)} s")
            load.window = "quiet"
            crashes += await asyncio.to_thread(restarts, dep, seen, time.monotonic() - load.t0)
            faults.append({"kind": kind, "window": f"{kind}#{len(faults)}", "at_s": round(at, 1), "what": what,
                           "injected": injected, "end_s": round(time.monotonic() - load.t0, 1),
                           "recovery_s": None if recovered is None else round(recovered, 1)})
        load.stop()
        await running
        stop_memory.set()
        await sampler
        await logs
        crashes += await asyncio.to_thread(restarts, dep, seen, time.monotonic() - load.t0)
        return {**made, **report(config(args), load.sent, faults, memory, ready), "crashes": crashes}
    except BaseException:
        _dump_logs(c)
        raise
    finally:
        c.stop()


def _dump_logs(c: LocalCluster, lines: int = 80) -> None:
    """The tail of every container of the soak's pods (and of its previous run, if it restarted): why a
    deployment broke, printed before the cluster goes."""
    from lightkube.resources.core_v1 import Pod

    for pod in c.client().list(Pod, namespace=NAMESPACE):
        for status in (pod.status.containerStatuses or []) if pod.status else []:
            for previous in (False, True) if status.restartCount else (False,):
                out = subprocess.run([str(c.bin / "kubectl"), f"--kubeconfig={c.kubeconfig}", "logs", "-n", NAMESPACE,
                                      pod.metadata.name, "-c", status.name, f"--tail={lines}",
                                      *(["--previous"] if previous else [])], capture_output=True, text=True)
                log(f"--- {pod.metadata.name}/{status.name}{' (previous)' if previous else ''}\n"
                    f"{out.stdout}{out.stderr}")


async def await_recovered_setup(dep: Deployment, args: argparse.Namespace) -> float:
    t0 = time.monotonic()
    while (missing := await asyncio.to_thread(dep.missing)) is not None:
        if time.monotonic() - t0 > args.recovery_timeout:
            raise TimeoutError(f"{dep.name} not whole after {args.recovery_timeout:g} s: {missing}")
        await asyncio.sleep(2)  # the operator's and kubelet's work; nothing to await
    return time.monotonic() - t0


GRACEFUL = ("delete-prefill", "delete-decode", "delete-router", "delete-rendezvous", "delete-operator")
"""The fault kinds that must lose nothing (issue 34: graceful means lossless)."""


def _blame(r: Sent, faults: list[dict[str, Any]]) -> str:
    """The fault a failed request is charged to, among the injected faults that began before it failed (`done`)
    and whose time, from the fault to its recovery (`end_s`), its life overlaps: the latest that is not graceful
    (a kill, a partition, a slow link) when there is one, else the latest; with none, the window it was sent in.
    The latest, not the first: a request that waited through one fault and then failed in the next (a router killed
    under it) failed of the second. Not graceful first: a graceful stop must lose nothing, so a request that also
    lived through a kill or a broken link is that fault's (its KV lost to a partition fails it at the registration
    timeout, after any stop that began meanwhile); `lived_through` keeps every fault for a closer look."""
    end = r.done if r.done is not None else r.at
    overlapped = [f for f in faults if f["injected"] and f["at_s"] <= end
                  and r.at <= (f["end_s"] if f["recovery_s"] is not None else float("inf"))]
    disruptive = [f for f in overlapped if f["kind"] not in GRACEFUL]
    chosen = disruptive or overlapped
    return str(chosen[-1]["window"]) if chosen else r.window


def _lived_through(r: Sent, faults: list[dict[str, Any]]) -> list[str]:
    """Every injected fault whose time the request's life overlaps."""
    end = r.done if r.done is not None else r.at
    return [str(f["window"]) for f in faults if f["injected"] and f["at_s"] <= end
            and r.at <= (f["end_s"] if f["recovery_s"] is not None else float("inf"))]


def _cause(r: Sent) -> str:
    if r.wrong:
        return "wrong answer"
    text = (r.error or "").lower()
    # "disconnected" before "connect": a server gone mid-request is not a connection that failed to open.
    for needle, cause in (("timeout", "timeout"), ("disconnected", "disconnected"),
                          ("payload is not completed", "cut mid-answer"), ("connect", "connect"), ("reset", "reset"),
                          ("mid-stream", "mid-stream")):
        if needle in text:
            return cause
    return f"HTTP {r.status}"


def config(args: argparse.Namespace) -> dict[str, Any]:
    return {"seconds": args.seconds, "emulated": args.emulated, "rate": args.rate, "verify_rate": args.verify_rate,
            "quiet_s": args.quiet, "faults": list(args.faults), "partition_s": args.partition_seconds,
            "slow_link": f"prefill sends at most {args.slow_rate} (tc tbf) for {args.slow_seconds} s",
            "seed": args.seed,
            "deployment": (f"{args.emulated} emulated prefill and {args.emulated} emulated decode engines "
                           "(profile cpu-kv64k)" if args.emulated else "tiny-cpu: 1 prefill, 1 decode")
                          + " in push mode on the real node, 2 routers, pair wait 240 s"}


def report(config: dict[str, Any], sent: list[Sent], faults: list[dict[str, Any]], memory: list[dict[str, Any]],
           ready: float) -> dict[str, Any]:
    """The result's body from what a run saw (also from a saved result again: `--report`)."""
    failed = [r for r in sent if r.status != 200 or r.wrong]
    not_injected = {f["window"] for f in faults if not f["injected"]}
    for r in failed:  # a failure belongs to the fault its request lived through, even if sent before it
        r.window = _blame(r, faults)
    by_window: dict[str, list[Sent]] = {}
    for r in sent:
        by_window.setdefault(r.window, []).append(r)
    for f in faults:
        rows = by_window.get(f["window"], [])
        f["requests"] = len(rows)
        f["failed"] = sum(r.status != 200 or r.wrong for r in rows)
        f["causes"] = dict(Counter(_cause(r) for r in rows if r.status != 200 or r.wrong))
    kinds: dict[str, dict[str, Any]] = {}
    for f in faults:
        if not f["injected"]:  # listed in `faults` with why; its requests count as the quiet's
            continue
        k = kinds.setdefault(f["kind"], {"count": 0, "requests": 0, "failed": 0, "recovery_s": [], "causes": Counter()})
        k["count"] += 1
        k["requests"] += f["requests"]
        k["failed"] += f["failed"]
        k["recovery_s"].append(f["recovery_s"])
        k["causes"].update(f["causes"])
    for k in kinds.values():
        rec = [x for x in k["recovery_s"] if x is not None]
        k["recovery_p50_s"], k["recovery_max_s"] = quantile(rec, 0.5), max(rec) if rec else None
        k["unrecovered"] = sum(x is None for x in k["recovery_s"])
        k["causes"] = dict(k["causes"])
    ttft = [r.ttft for r in sent if r.kind == "background" and r.status == 200 and r.ttft is not None]
    grow = {comp: [m[comp] for m in memory if comp in m] for comp in ("router", "rendezvous")}
    return {
        "benchmark": "soak", "issue": 34, "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "loadavg_at_end": Path("/proc/loadavg").read_text().split()[:3],
        "config": config,
        "ready_s": round(ready, 1),
        "headline": {"requests": len(sent), "failed": len(failed),
                     "wrong": sum(r.wrong for r in sent),
                     "failed_by_cause": dict(Counter(_cause(r) for r in failed)),
                     "failed_outside_faults": sum(r.window == "quiet" or r.window in not_injected for r in failed),
                     "faults": len(faults) - len(not_injected), "faults_not_injected": len(not_injected),
                     "ttft_ms": dist(ttft),
                     "router_rss_kib": {"first": grow["router"][0] if grow["router"] else None,
                                        "max": max(grow["router"], default=None),
                                        "last": grow["router"][-1] if grow["router"] else None},
                     "rendezvous_rss_kib": {"first": grow["rendezvous"][0] if grow["rendezvous"] else None,
                                            "max": max(grow["rendezvous"], default=None),
                                            "last": grow["rendezvous"][-1] if grow["rendezvous"] else None}},
        "by_kind": kinds,
        "failures": [{"at": r.at, "done": r.done, "kind": r.kind, "status": r.status, "charged_to": r.window,
                      "lived_through": _lived_through(r, faults), "request_id": r.request_id, "error": r.error}
                     for r in failed],
        "faults": faults,
        "memory": memory,
        "requests": [asdict(r) for r in sent],
    }


def rereport(path: Path) -> dict[str, Any]:
    """A saved result with its report made again: the run's provenance, rows and faults kept, the report's parts
    recomputed, and the command that recomputed them."""
    saved = result_file.load(path)
    known = {f.name for f in fields(Sent)}
    sent = [Sent(**{k: v for k, v in row.items() if k in known}) for row in saved["requests"]]
    faults = [{k: v for k, v in f.items() if k not in ("requests", "failed", "causes")} for f in saved["faults"]]
    body = report(saved["config"], sent, faults, saved["memory"], saved["ready_s"])
    run_of = {k: saved[k] for k in ("command", "commit", "machine", "when", "loadavg_at_end")}
    return {**saved, **body, **run_of, "crashes": saved.get("crashes", []),
            "reported_by": {"command": " ".join(sys.argv), "commit": result_file.provenance()["commit"]}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=3600)
    p.add_argument("--rate", type=float, default=1.0, help="background requests per second (Poisson)")
    p.add_argument("--verify-rate", type=float, default=0.5, help="verification requests per second (Poisson)")
    p.add_argument("--quiet", type=lambda s: tuple(float(x) for x in s.split(",")), default=(20.0, 60.0),
                   help="seconds between a recovery and the next fault: min,max")
    p.add_argument("--faults", type=lambda s: tuple(s.split(",")), default=FAULTS)
    p.add_argument("--partition-seconds", type=float, default=20.0)
    p.add_argument("--slow-rate", default="10mbit", help="prefill's egress during slow-link (tc tbf's rate)")
    p.add_argument("--slow-seconds", type=float, default=60.0)
    p.add_argument("--recovery-timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=34)
    p.add_argument("--emulated", type=int, default=0, metavar="N",
                   help="N emulated engines per role instead of the real pair (the soak at fleet size)")
    p.add_argument("--quick", action="store_true", help="a few minutes, a few faults")
    p.add_argument("--out", type=Path, default=RESULTS / "soak.json")
    p.add_argument("--report", type=Path, metavar="FILE",
                   help="no run: the report of a saved result again (its requests, faults and memory), as this "
                        "version of the report reads them, written to --out")
    args = p.parse_args()
    unknown = set(args.faults) - set(FAULTS)
    if unknown:
        p.error(f"unknown faults {sorted(unknown)}; known: {', '.join(FAULTS)}")
    if args.quick:
        args.seconds, args.quiet = 240.0, (10.0, 20.0)
    stop_cleanly_on_sigterm()
    result = rereport(args.report) if args.report else asyncio.run(run(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result_file.write(args.out, result)
    h = result["headline"]
    print(json.dumps({k: h[k] for k in ("requests", "failed", "wrong", "failed_by_cause", "faults")}))
    for kind, k in result["by_kind"].items():
        print(f"{kind:18s} x{k['count']}: {k['failed']}/{k['requests']} failed {k['causes']}, recovery p50 "
              f"{k['recovery_p50_s']} s, max {k['recovery_max_s']} s")
    return 1 if h["wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
