"""The `disagg` command. Subcommands import their modules lazily so `disagg router` never pays for the
operator's imports and vice versa."""
from __future__ import annotations

import argparse
import sys


def _cluster(args: argparse.Namespace) -> None:
    from disagg.devcluster import build, cluster, fleet

    if args.cluster_cmd == "build":
        build.ensure_built(args.names or None)
        return
    build.ensure_built(quiet=True)
    spec = fleet.FleetSpec.parse(args.fleet) if args.fleet else fleet.FleetSpec()
    c = cluster.LocalCluster(cluster.ClusterConfig(name=args.name, fleet=spec))
    c.start(progress=lambda m: print(m, flush=True))
    print(f"export KUBECONFIG={c.kubeconfig}\nCtrl-C stops the cluster.", flush=True)
    try:
        c.processes[0].popen.wait()  # type: ignore[union-attr]
    except KeyboardInterrupt:
        pass
    finally:
        c.stop()


def _demo(args: argparse.Namespace) -> None:
    from disagg.devcluster import demo

    demo.run(keep=args.keep)


def _render(args: argparse.Namespace) -> None:
    from disagg.operator import render

    sys.exit(render.main(args.file, operator_image=args.operator_image))


def _operator(args: argparse.Namespace) -> None:
    from disagg.operator import run

    run.main(args)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="disagg", description="Disaggregated vLLM serving on Kubernetes.")
    sub = p.add_subparsers(dest="cmd", required=True)

    c = sub.add_parser("cluster", help="the local control plane with simulated P5en and Trainium nodes")
    csub = c.add_subparsers(dest="cluster_cmd", required=True)
    b = csub.add_parser("build", help="build and cache the control-plane binaries from Go modules")
    b.add_argument("names", nargs="*", help="binaries to build (default: all)")
    u = csub.add_parser("up", help="start a local cluster in the foreground")
    u.add_argument("--name", default="disagg")
    u.add_argument("--fleet", help="node counts, e.g. p5en=4,trn2=2,trn1=1,m7i=2 (default) or p5en=200")
    c.set_defaults(func=_cluster)

    d = sub.add_parser("demo", help="bring up the local cluster and show the product working")
    d.add_argument("--keep", action="store_true", help="leave the cluster running until Ctrl-C")
    d.set_defaults(func=_demo)

    from disagg.operator import run as operator_run

    o = sub.add_parser("operator", help="run the operator (kopf) against the current kubeconfig or in-cluster")
    operator_run.add_arguments(o)
    o.set_defaults(func=_operator)

    r = sub.add_parser("render", help="print every object the operator would create for a CR (no cluster)")
    r.add_argument("-f", "--file", required=True, help="DisaggregatedInference YAML file, or - for stdin")
    r.add_argument("--operator-image", help="image for the router, rendezvous and plugin init container")
    r.set_defaults(func=_render)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main(sys.argv[1:])
