"""The README's main command: bring up the local control plane and show what it runs."""
from __future__ import annotations

import subprocess

from . import build
from .cluster import ClusterConfig, LocalCluster


def _kubectl(c: LocalCluster, *args: str) -> None:
    subprocess.run([str(c.bin / "kubectl"), f"--kubeconfig={c.kubeconfig}", *args], check=True)


def _say(msg: str) -> None:
    print(f"\n==> {msg}", flush=True)


def run(keep: bool = False) -> None:
    _say("building the control plane from Go modules (cached after the first run)")
    build.ensure_built()
    _say("starting etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok")
    c = LocalCluster(ClusterConfig(name="demo"))
    c.start(progress=lambda m: print(f"    {m}", flush=True))
    try:
        _kubectl(c, "version")
        _say("simulated nodes: instance type, zone, GPUs, Neuron devices and EFA devices as allocatable")
        _kubectl(c, "get", "nodes", "-o",
                 "custom-columns=NAME:.metadata.name,INSTANCE:.metadata.labels.node\\.kubernetes\\.io/instance-type,"
                 "ZONE:.metadata.labels.topology\\.kubernetes\\.io/zone,"
                 "GPU:.status.allocatable.nvidia\\.com/gpu,NEURON:.status.allocatable.aws\\.amazon\\.com/neuron,"
                 "EFA:.status.allocatable.vpc\\.amazonaws\\.com/efa,"
                 "TAINT:.spec.taints[0].key,READY:.status.conditions[?(@.type=='Ready')].status")
        if keep:
            print(f"\nexport KUBECONFIG={c.kubeconfig}\nThe cluster stays up; Ctrl-C stops it.", flush=True)
            c.processes[0].popen.wait()  # type: ignore[union-attr]
    except KeyboardInterrupt:
        pass
    finally:
        _say("stopping the cluster")
        c.stop()
