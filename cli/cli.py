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
    c = cluster.LocalCluster(cluster.ClusterConfig(name=args.name, fleet=spec, real_node=args.real_node))
    c.start(progress=lambda m: print(m, flush=True))
    print(f"export KUBECONFIG={c.kubeconfig}\nCtrl-C stops the cluster.", flush=True)
    try:
        c.wait()
    except KeyboardInterrupt:
        pass
    finally:
        c.stop()


def _demo(args: argparse.Namespace) -> None:
    from disagg.devcluster import demo

    demo.run(keep=args.keep, engines=args.engines, local=args.local)


def _render(args: argparse.Namespace) -> None:
    from disagg.operator import render

    sys.exit(render.main(args.file, operator_image=args.operator_image))


def _operator(args: argparse.Namespace) -> None:
    from disagg.operator import run

    run.main(args)


def _rendezvous(args: argparse.Namespace) -> None:
    from disagg.connector.rendezvous import server as rendezvous

    rendezvous.main(args)


def _install_plugin(args: argparse.Namespace) -> None:
    from disagg.connector import install_plugin

    sys.exit(install_plugin.main(args.dir))


def _rendezvous_arguments(p: argparse.ArgumentParser) -> None:
    # Defined here, not in connector/rendezvous/server.py, so building the parser never imports aiohttp.
    p.add_argument("--host", default="0.0.0.0", help="listen address (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=8080, help="listen port (default 8080)")
    p.add_argument("--heartbeat-seconds", type=float, default=5.0,
                   help="engines renew this often; watch streams send a BOOKMARK at least this often (default 5)")
    p.add_argument("--auth", choices=("kubernetes", "token", "none"), default="kubernetes",
                   help="what writes need: a pod-bound ServiceAccount token checked with a TokenReview (default), "
                        "a shared token, or nothing (explicit opt-in, for benchmarks)")
    p.add_argument("--token", default=None, help="shared token for --auth token (default $DISAGG_RENDEZVOUS_TOKEN)")
    p.add_argument("--deployment", default=None,
                   help="the DisaggregatedInference served (default $DISAGG_DEPLOYMENT); only its engines may write")
    p.add_argument("--namespace", default=None,
                   help="namespace of the engine pods (default $POD_NAMESPACE, else the in-cluster namespace)")
    p.add_argument("--audience", default=None,
                   help="audience the engines' tokens must carry in --auth kubernetes (default "
                        "$DISAGG_RENDEZVOUS_AUDIENCE or disagg-rendezvous; '' accepts the API server's audience)")
    p.add_argument("--kubeconfig", default=None, help="for TokenReviews (default: in-cluster, else $KUBECONFIG)")
    p.add_argument("--log-level", default="INFO")


def _router(args: argparse.Namespace) -> None:
    from disagg.connector.router import app as router

    router.main(args)


def _emulator(args: argparse.Namespace) -> None:
    from disagg.connector.emulator import main as emulator

    emulator.main(args)


def _compare(args: argparse.Namespace) -> None:
    from disagg.compare import command

    command.main(args)


def _compare_run(args: argparse.Namespace) -> None:
    from disagg.compare import runner

    runner.main(args)


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
    u.add_argument("--no-real-node", dest="real_node", action="store_false",
                   help="only kwok's simulated nodes: no kubelet, containerd, CNI, kube-proxy or CoreDNS on this "
                        "host (which needs root), so no pod runs")
    c.set_defaults(func=_cluster)

    d = sub.add_parser("demo", help="bring up the local cluster and real engines and show the product working")
    d.add_argument("--keep", action="store_true", help="leave the cluster running until Ctrl-C")
    d.add_argument("--no-engines", dest="engines", action="store_false",
                   help="skip the real vLLM engines (push and pull through the router): the control plane only")
    d.add_argument("--local", action="store_true",
                   help="run the engines as local processes after the cluster stops, not as pods on the real node")
    d.set_defaults(func=_demo)

    from disagg.operator import run as operator_run

    o = sub.add_parser("operator", help="run the operator (kopf) against the current kubeconfig or in-cluster")
    operator_run.add_arguments(o)
    o.set_defaults(func=_operator)

    z = sub.add_parser("rendezvous", help="the registry where engines advertise themselves and routers watch them")
    _rendezvous_arguments(z)
    z.set_defaults(func=_rendezvous)

    from disagg.connector.router import flags as router_args

    g = sub.add_parser("router", help="the OpenAI-compatible push/pull-aware router in front of the engines")
    router_args.add_arguments(g)
    g.set_defaults(func=_router)

    from disagg.connector.emulator import flags as emulator_args

    e = sub.add_parser("emulator", help="an ENGINE EMULATOR (not vLLM): a prefill or decode engine's protocols, "
                                        "time and capacity, for tests at fleet size")
    emulator_args.add_arguments(e)
    e.set_defaults(func=_emulator)

    i = sub.add_parser("install-plugin", help="copy the vLLM connector plugin (disagg.connector) into DIR, for "
                                             "engines run with PYTHONPATH=DIR (the engine pods' init container)")
    i.add_argument("dir", metavar="DIR", help="target directory; the package lands in DIR/disagg/connector/")
    i.set_defaults(func=_install_plugin)

    from disagg.compare import arguments as compare  # argparse only: no client library until a command runs

    m = sub.add_parser("compare", help="push against pull on your own deployment and load: ABBA rounds, run as a "
                       "Job beside the router, with a report and a recommendation")
    compare.add_compare_arguments(m)
    m.set_defaults(func=_compare)
    q = sub.add_parser("compare-run", help="the Job's side of `disagg compare` (run by it, not by hand)")
    compare.add_run_arguments(q)
    q.set_defaults(func=_compare_run)

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
