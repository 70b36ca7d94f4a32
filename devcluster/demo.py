"""The README's main command: bring up the local control plane, run the operator against it, apply the
Qwen3-32B p5en example and show it becoming Ready on the right nodes; then serve a request on real vLLM CPU
engines through the rendezvous and the router in push and pull mode (demo_engines.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from . import build
from .cluster import ClusterConfig, LocalCluster, die_with_parent, free_port

EXAMPLE = Path(__file__).resolve().parents[1] / "manifests" / "examples" / "qwen3-32b-p5en.yaml"


def _kubectl(c: LocalCluster, *args: str, stdin: str | None = None) -> None:
    subprocess.run([str(c.bin / "kubectl"), f"--kubeconfig={c.kubeconfig}", *args], check=True, text=True,
                   input=stdin)


def _say(msg: str) -> None:
    print(f"\n==> {msg}", flush=True)


NODE_COLUMNS = ("custom-columns=NAME:.metadata.name,INSTANCE:.metadata.labels.node\\.kubernetes\\.io/instance-type,"
                "ZONE:.metadata.labels.topology\\.kubernetes\\.io/zone,"
                "GPU:.status.allocatable.nvidia\\.com/gpu,NEURON:.status.allocatable.aws\\.amazon\\.com/neuron,"
                "EFA:.status.allocatable.vpc\\.amazonaws\\.com/efa,"
                "TAINT:.spec.taints[0].key,READY:.status.conditions[?(@.type=='Ready')].status")
POD_COLUMNS = ("custom-columns=POD:.metadata.name,ROLE:.metadata.labels.app\\.kubernetes\\.io/component,"
               "NODE:.spec.nodeName,GPU:.spec.containers[0].resources.limits.nvidia\\.com/gpu,"
               "EFA:.spec.containers[0].resources.limits.vpc\\.amazonaws\\.com/efa,"
               "HUGEPAGES:.spec.containers[0].resources.limits.hugepages-2Mi,READY:.status.containerStatuses[0].ready")


def run(keep: bool = False, engines: bool = True) -> None:
    """The control plane (a CR becoming Ready), then real engines serving through the router in push and pull
    mode. The cluster is stopped before the engines start so they get the cores, unless `keep` leaves it up."""
    from . import demo_engines

    try:
        _control_plane(keep, engines_while_up=engines and keep)
        if engines and not keep:
            demo_engines.run()
    except KeyboardInterrupt:
        print("\nCtrl-C: everything the demo started is stopped", flush=True)
    except demo_engines.DemoFailed as e:
        raise SystemExit(f"\ndemo failed: {e}") from None


def _control_plane(keep: bool, engines_while_up: bool = False) -> None:
    from disagg.operator import crdgen

    from . import demo_engines

    _say("building the control plane from Go modules (cached after the first run)")
    build.ensure_built()
    _say("starting etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok")
    c = LocalCluster(ClusterConfig(name="demo"))
    c.start(progress=lambda m: print(f"    {m}", flush=True))
    operator: subprocess.Popen[bytes] | None = None
    try:
        _kubectl(c, "version")
        _say("simulated nodes: instance type, zone, GPUs, Neuron devices and EFA devices as allocatable")
        _kubectl(c, "get", "nodes", "-o", NODE_COLUMNS)

        _say("installing the DisaggregatedInference CRD (generated from the typed API models)")
        _kubectl(c, "apply", "--server-side", "-f", "-", stdin=crdgen.render())
        _kubectl(c, "wait", "--for=condition=Established", "crd/disaggregatedinferences.serving.disagg.io")

        _say("starting the operator (disagg operator)")
        log = c.dir / "logs" / "operator.log"
        health = free_port()
        operator = subprocess.Popen(
            [str(Path(sys.executable).parent / "disagg"), "operator", "--metrics-port", str(free_port()),
             "--liveness", f"http://127.0.0.1:{health}/healthz"],
            env={**os.environ, "KUBECONFIG": str(c.kubeconfig)}, stdout=log.open("ab"), stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=die_with_parent)
        print(f"    operator log: {log}", flush=True)

        _say(f"applying {EXAMPLE.relative_to(EXAMPLE.parents[2])}: Qwen3-32B, 1 prefill + 1 decode at TP4, push")
        _kubectl(c, "apply", "-f", str(EXAMPLE))
        _kubectl(c, "wait", "--for=condition=Ready", "dinf/qwen3-32b", "--timeout=120s")
        _kubectl(c, "get", "dinf", "qwen3-32b")
        _say("what the operator created")
        _kubectl(c, "get", "statefulsets,deployments,services,poddisruptionbudgets,configmaps",
                 "-l", "app.kubernetes.io/instance=qwen3-32b")
        _say("engine pods and the p5en nodes they landed on (2 EFA per GPU, hugepages)")
        _kubectl(c, "get", "pods", "-l", "serving.disagg.io/role", "-o", POD_COLUMNS)
        _say("status conditions")
        _kubectl(c, "get", "dinf", "qwen3-32b", "-o",
                 "jsonpath={range .status.conditions[*]}{.type}={.status} ({.reason}): {.message}{\"\\n\"}{end}")
        if keep:
            if engines_while_up:
                demo_engines.run()
            print(f"\nexport KUBECONFIG={c.kubeconfig}\nThe cluster stays up; Ctrl-C stops it.", flush=True)
            c.wait()
    finally:
        if operator is not None and operator.poll() is None:
            os.killpg(operator.pid, signal.SIGTERM)
            operator.wait(20)
        _say("stopping the cluster")
        c.stop()
