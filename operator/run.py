"""`disagg operator`: run the kopf operator."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
from typing import Any

from .names import rendezvous_url
from .peering import own_identity

# The in-cluster Service of each deployment's rendezvous, with placeholders. (names.py imports nothing heavy.)
DEFAULT_RENDEZVOUS_TEMPLATE = rendezvous_url("{name}", "{namespace}")
DEFAULT_AUTOSCALE_WINDOW_SECONDS = 15.0
"""What a planner decision reads by default: at a few requests a second, enough of them for a rate; short enough
that a step in load is seen in seconds, since decisions come every --autoscale-seconds (5), not every window."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[],
                       help="watch only this namespace (repeatable); default: all namespaces")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace (default)")
    p.add_argument("--peering", default=os.environ.get("DISAGG_PEERING"),
                      help="kopf peering name: replicas sharing it elect one active operator "
                           "(needs the kopf.dev peering CRDs); default: standalone")
    p.add_argument("--priority", type=int, default=None,
                   help="kopf peering priority; default: random, so the replica with the highest acts and the "
                        "others stand by")
    p.add_argument("--operator-image", default=os.environ.get("DISAGG_OPERATOR_IMAGE"),
                   help="image for the router, rendezvous and plugin init container (of new engine revisions: a "
                        "running revision keeps the plugin it was made with)")
    p.add_argument("--metrics-port", type=int, default=int(os.environ.get("DISAGG_METRICS_PORT", "8080")),
                   help="Prometheus metrics port (0 disables)")
    p.add_argument("--liveness", default="http://0.0.0.0:8081/healthz", help="kopf liveness endpoint URL")
    p.add_argument("--resync-seconds", type=float, default=300.0,
                   help="periodic drift-correction interval (default 300): a thorough pass of every CR, one at a "
                        "time, each after the passes queued for a slot (waiting at most this long per round)")
    p.add_argument("--rendezvous-url-template",
                   default=os.environ.get("DISAGG_RENDEZVOUS_URL_TEMPLATE", DEFAULT_RENDEZVOUS_TEMPLATE),
                   help="where the operator reads each deployment's rendezvous (for the engines' reported transport, "
                        "condition TransportVerified); {name} and {namespace} are the CR's. Default: the in-cluster "
                        f"Service, {DEFAULT_RENDEZVOUS_TEMPLATE}")
    p.add_argument("--autoscale-seconds", type=float, default=5.0,
                   help="how often the autoscaling planner observes and decides, for each CR with spec.autoscaling "
                        "(default 5)")
    p.add_argument("--autoscale-window-seconds", type=float, default=None,
                   help=f"how far back each decision reads arrivals, tokens and latencies (default: "
                        f"{DEFAULT_AUTOSCALE_WINDOW_SECONDS:g} s or --autoscale-seconds, whichever is longer); longer "
                        "than --autoscale-seconds, frequent decisions see a step in load (and the queues it builds) "
                        "sooner without reading rates off a few requests")
    p.add_argument("--transport-poll-seconds", type=float, default=30.0,
                   help="how often every deployment's rendezvous is read (in the background; default 30)")
    p.add_argument("--rendezvous-timeout", type=float, default=2.0,
                   help="bound of one rendezvous read (default 2 s); an unreachable rendezvous makes "
                        "TransportVerified Unknown, never a failed or slow reconcile")
    p.add_argument("--max-concurrent-passes", type=int, default=16,
                   help="reconcile passes run at once over all CRs (default 16); the others queue (a pass that may "
                        "turn its CR Ready first), so a burst of CRs converges without flooding the apiserver")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="log at DEBUG, and log every handler kopf runs (a line per watch event of every managed "
                        "object)")


def autoscale_window(args: argparse.Namespace) -> float:
    """The seconds each planner decision reads: the flag, or the default window, or one tick if that is longer."""
    if args.autoscale_window_seconds is not None:
        return float(args.autoscale_window_seconds)
    return max(DEFAULT_AUTOSCALE_WINDOW_SECONDS, float(args.autoscale_seconds))


def configure_logging(verbose: bool) -> None:
    """INFO (DEBUG with --verbose) and up, except per-request and per-watch-event lines, which only --verbose
    shows: httpx's line per request, and kopf's "Handler '...' succeeded." per watch event on every managed
    object. The operator has only event and index handlers, so that is all kopf logs per object at INFO; their
    failures (WARNING, ERROR) still show."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpx2", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("kopf.objects").setLevel(logging.NOTSET if verbose else logging.WARNING)


def main(args: argparse.Namespace) -> None:
    # Heavy imports stay here so `disagg --help` and the other subcommands never pay for kopf.
    import kopf
    from lightkube import AsyncClient, KubeConfig
    from prometheus_client import start_http_server

    from .builders import OperatorImages

    os.environ["DISAGG_RESYNC_SECONDS"] = str(args.resync_seconds)
    from . import handlers, watch_selectors  # handlers: registers the handlers with kopf's default registry
    from .autoscale_executor import Autoscaler
    from .generations import Generations
    from .metrics import PLANNER_DECISIONS
    from .no_diffbase import NoDiffBase
    from .reconciler import Reconciler
    from .transport import TransportPoller, check_template

    try:
        check_template(args.rendezvous_url_template)
    except ValueError as e:
        raise SystemExit(f"disagg operator: {e}") from None
    if args.max_concurrent_passes < 1:
        raise SystemExit("disagg operator: --max-concurrent-passes must be at least 1")
    if args.autoscale_seconds <= 0:
        raise SystemExit("disagg operator: --autoscale-seconds must be positive")
    if args.autoscale_window_seconds is not None and args.autoscale_window_seconds < args.autoscale_seconds:
        raise SystemExit("disagg operator: --autoscale-window-seconds must be at least --autoscale-seconds")
    if args.transport_poll_seconds <= 0 or args.rendezvous_timeout <= 0:
        raise SystemExit("disagg operator: --transport-poll-seconds and --rendezvous-timeout must be positive")

    configure_logging(args.verbose)
    if args.metrics_port:
        start_http_server(args.metrics_port)
    images = OperatorImages(operator=args.operator_image) if args.operator_image else OperatorImages()

    @kopf.on.startup()
    async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        # kopf's bookkeeping, if a handler ever needs some: annotations under our prefix, never .status (ours).
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="serving.disagg.io")
        settings.persistence.diffbase_storage = NoDiffBase()  # the CR's changes: Generations, not a diff
        settings.posting.level = logging.INFO
        settings.watching.server_timeout = 300
        settings.networking.request_timeout = 30
        # The handlers' label and field filters, asked of the apiserver too: the operator never receives (nor
        # decodes) the cluster's other pods, Events, Services... (watch_selectors.py).
        watch_selectors.configure(settings, watch_selectors.derive(kopf.get_default_registry()))
        memo.shared = {}
        memo.generations = Generations()
        memo.retries = handlers.Retries()
        memo.reconciler = Reconciler(AsyncClient(KubeConfig.from_env()), images, namespaces=args.namespace,
                                     max_concurrent_passes=args.max_concurrent_passes)
        transport_log = logging.getLogger("disagg.transport")
        memo.transports = TransportPoller(
            args.rendezvous_url_template, timeout=args.rendezvous_timeout, interval=args.transport_poll_seconds,
            on_change=lambda key: handlers.transport_changed(memo, key, transport_log))
        memo.resync = asyncio.create_task(handlers.resync_forever(memo, logging.getLogger("disagg.resync")))
        memo.transport_poll = asyncio.create_task(handlers.poll_transports_forever(memo, args.transport_poll_seconds))
        memo.autoscaler = Autoscaler(memo.reconciler.client, PLANNER_DECISIONS,
                                     window_seconds=autoscale_window(args))
        memo.autoscale = asyncio.create_task(handlers.autoscale_forever(memo, args.autoscale_seconds))

    @kopf.on.cleanup()
    async def close(memo: kopf.Memo, **_: Any) -> None:
        memo.resync.cancel()
        memo.transport_poll.cancel()
        memo.autoscale.cancel()
        await memo.autoscaler.close()
        await memo.transports.close()
        await memo.reconciler.client.close()

    priority = args.priority
    if args.peering:
        priority = priority if priority is not None else random.randint(1, 1_000_000)
        ensure_peering_objects(args.peering, args.namespace)
        logging.getLogger("disagg.operator").info("peering %r with priority %d", args.peering, priority)
    asyncio.run(kopf.operator(
        clusterwide=not args.namespace, namespaces=args.namespace,
        standalone=args.peering is None, peering_name=args.peering, priority=priority,
        liveness_endpoint=args.liveness or None, memo=kopf.Memo(), identity=own_identity(os.environ),  # type: ignore[arg-type]  # kopf's Identity: a NewType of str it does not export
    ))


def ensure_peering_objects(name: str, namespaces: list[str]) -> None:
    """kopf needs the peering object to exist before replicas can find each other."""
    from lightkube import Client, KubeConfig, codecs
    from lightkube.core.exceptions import ApiError
    from lightkube.generic_resource import create_global_resource, create_namespaced_resource

    from . import peering

    create_global_resource(peering.GROUP, peering.VERSION, "ClusterKopfPeering", "clusterkopfpeerings")
    create_namespaced_resource(peering.GROUP, peering.VERSION, "KopfPeering", "kopfpeerings")
    client = Client(KubeConfig.from_env())
    targets: list[str | None] = [*namespaces] if namespaces else [None]  # None: the cluster-wide peering
    for ns in targets:
        try:
            client.create(codecs.from_dict(peering.peering_object(name, ns)))
        except ApiError as e:
            if e.status.code != 409:
                raise SystemExit(f"cannot create the kopf peering object {name!r}: {e.status.message} "
                                 "(are the kopf.dev peering CRDs installed? see crds/)") from e
