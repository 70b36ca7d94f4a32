"""The README's main command, the product's real path: bring up the local control plane with kwok's simulated
P5en and Trainium fleet and a real node on this host, `helm install` the operator's chart (the operator runs as
a pod under the chart's ServiceAccount, from the image built from the Dockerfile), apply the Qwen3-32B p5en
example and show where it lands (placement on EFA nodes this machine cannot have), then apply the tiny-cpu
example in push and then pull mode and serve a streamed completion through the router's Service on real vLLM
CPU engine pods (demo_node.py).

`--no-engines` shows the control plane alone (the operator as a local process, no real node); `--local` runs
the engines as local processes instead of pods (demo_engines.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from . import build
from .cluster import ClusterConfig, LocalCluster, die_with_parent, free_port

EXAMPLE = Path(__file__).resolve().parents[1] / "manifests" / "examples" / "qwen3-32b-p5en.yaml"
CHART = Path(__file__).resolve().parents[1] / "charts" / "disagg-operator"
RELEASE = "disagg"
RELEASE_NAMESPACE = "disagg-system"


def _helm_install(c: LocalCluster, operator_image: str, operator: dict[str, object] | None = None) -> None:
    """The chart with the locally built image, placed on the real node (the only node that runs containers);
    `operator`: chart values under `operator` (its flags), beyond the chart's defaults."""
    from disagg.operator.profiles import CPU_ENGINES_LABEL, CPU_ENGINES_TAINT, CPU_ENGINES_VALUE

    repository, tag = operator_image.rsplit(":", 1)
    values = c.dir / "demo-values.yaml"
    values.write_text(yaml.safe_dump({
        "image": {"operator": {"repository": repository, "tag": tag, "pullPolicy": "Never"}},
        "nodeSelector": {CPU_ENGINES_LABEL: CPU_ENGINES_VALUE},
        "tolerations": [{**CPU_ENGINES_TAINT, "operator": "Equal"}],
        **({"operator": operator} if operator else {}),
    }))
    subprocess.run([str(c.bin / "helm"), f"--kubeconfig={c.kubeconfig}", "install", RELEASE, str(CHART),
                    "--namespace", RELEASE_NAMESPACE, "--create-namespace", "-f", str(values), "--wait",
                    "--timeout", "180s"], check=True)


def _engine_mounts() -> tuple[Path, ...]:
    from .images import engine

    return engine.host_env().mounts


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


def run(keep: bool = False, engines: bool = True, local: bool = False) -> None:
    """The control plane (a CR becoming Ready), then real engines serving through the router in push and pull
    mode: as pods on the real node, or with `local` as processes after the cluster stops (they need the cores)."""
    from . import demo_engines

    try:
        _demo(keep, real_node=engines and not local)
        if engines and local:
            demo_engines.run()
    except KeyboardInterrupt:
        print("\nCtrl-C: everything the demo started is stopped", flush=True)
    except demo_engines.DemoFailed as e:
        raise SystemExit(f"\ndemo failed: {e}") from None


def _demo(keep: bool, real_node: bool) -> None:
    from disagg.operator import crdgen

    from . import demo_engines, demo_node

    t_start = time.monotonic()
    _say("building the control plane and the node's parts from Go modules (cached after the first run)")
    build.ensure_built()
    _say("starting etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok"
         + (", then a real node: containerd, the kubelet, kube-proxy and CoreDNS, with the images built here"
            if real_node else ""))
    c = LocalCluster(ClusterConfig(name="demo", real_node=real_node))
    c.start(progress=lambda m: print(f"    {m}", flush=True))
    operator: subprocess.Popen[bytes] | None = None
    try:
        _kubectl(c, "version")
        _say("nodes: kwok's simulated P5en and Trainium fleet (GPUs, Neuron and EFA devices as allocatable)"
             + (" and the real node" if real_node else ""))
        _kubectl(c, "get", "nodes", "-o", NODE_COLUMNS)

        if real_node:
            assert c.node is not None
            images = c.node.images
            _say("helm install of charts/disagg-operator: the operator runs as a pod under the chart's "
                 "ServiceAccount, from the image BuildKit built from the Dockerfile")
            _helm_install(c, images["disagg"])
            _kubectl(c, "get", "pods", "-n", RELEASE_NAMESPACE, "-o", "wide")
        else:
            _say("installing the DisaggregatedInference CRD (generated from the typed API models)")
            _kubectl(c, "apply", "--server-side", "-f", "-", stdin=crdgen.render())
            _kubectl(c, "wait", "--for=condition=Established", "crd/disaggregatedinferences.serving.disagg.io")
            _say("starting the operator (disagg operator) as a local process: no real node to run its pod")
            log = c.dir / "logs" / "operator.log"
            health = free_port()
            operator = subprocess.Popen(
                [str(Path(sys.executable).parent / "disagg"), "operator", "--metrics-port", str(free_port()),
                 "--liveness", f"http://127.0.0.1:{health}/healthz"],
                env={**os.environ, "KUBECONFIG": str(c.kubeconfig)}, stdout=log.open("ab"),
                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent)
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
        print("    (kwok runs no containers: this deployment's rendezvous never answers, so TransportVerified stays "
              "Unknown here; on the real node below it is verified)", flush=True)
        if real_node:
            assert c.node is not None
            _say("serving on the real node: the operator's own pods, real vLLM CPU engines (a tiny random Llama)")
            demo_node.prepare(c, c.node.spec.name)
            mounts = _engine_mounts()
            results = [demo_node.serve(c, c.node.images, mounts, mode) for mode in ("push", "pull")]
            _say("push vs pull (two requests each on a shared 2-core machine: a demo, not a benchmark; see bench/)")
            print(f"    {demo_engines.comparison(results)}", flush=True)
            demo_node.cleanup(c)
        print(f"\n    the demo took {time.monotonic() - t_start:.0f}s", flush=True)
        if keep:
            print(f"\nexport KUBECONFIG={c.kubeconfig}\nThe cluster stays up; Ctrl-C stops it.", flush=True)
            c.wait()
    finally:
        if operator is not None and operator.poll() is None:
            os.killpg(operator.pid, signal.SIGTERM)
            operator.wait(20)
        _say("stopping the cluster")
        c.stop()
