"""The operator's settings: one typed object, made from the command line and nothing else.

Invariants (checked by `from_args`, which raises ValueError naming the flag):
- every interval and timeout is positive; the autoscaling window is at least one autoscaling tick;
- the rendezvous URL template formats with {name} and {namespace} into an http(s) URL;
- at least one reconcile pass may run at a time.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from ..meta import OperatorImages
from ..names import DEFAULT_RENDEZVOUS_TEMPLATE as DEFAULT_TEMPLATE

DEFAULT_AUTOSCALE_WINDOW_SECONDS = 15.0
"""What a planner decision reads by default: at a few requests a second, enough of them for a rate; short enough
that a step in load is seen in seconds, since decisions come every --autoscale-seconds (5), not every window."""


@dataclass(frozen=True)
class Settings:
    namespaces: tuple[str, ...] = ()
    """The namespaces watched; empty: all of them."""
    peering: str | None = None
    priority: int | None = None
    images: OperatorImages = OperatorImages()
    metrics_port: int = 8080
    liveness: str | None = "http://0.0.0.0:8081/healthz"
    resync_seconds: float = 300.0
    rendezvous_url_template: str = DEFAULT_TEMPLATE
    rendezvous_timeout: float = 2.0
    transport_poll_seconds: float = 30.0
    autoscale_seconds: float = 5.0
    autoscale_window_seconds: float = DEFAULT_AUTOSCALE_WINDOW_SECONDS
    max_concurrent_passes: int = 16
    verbose: bool = False


def add_arguments(p: argparse.ArgumentParser) -> None:
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[],
                       help="watch only this namespace (repeatable); default: all namespaces")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace (default)")
    p.add_argument("--peering", default=None,
                   help="kopf peering name: replicas sharing it elect one active operator "
                        "(needs the kopf.dev peering CRDs); default: standalone")
    p.add_argument("--priority", type=int, default=None,
                   help="kopf peering priority; default: random, so the replica with the highest acts and the "
                        "others stand by")
    p.add_argument("--operator-image", default=None,
                   help="image for the router, rendezvous and plugin init container (of new engine revisions: a "
                        "running revision keeps the plugin it was made with)")
    p.add_argument("--metrics-port", type=int, default=Settings.metrics_port,
                   help="Prometheus metrics port (0 disables)")
    p.add_argument("--liveness", default=Settings.liveness, help="kopf liveness endpoint URL")
    p.add_argument("--resync-seconds", type=float, default=Settings.resync_seconds,
                   help="periodic drift-correction interval (default 300): a thorough pass of every CR, one at a "
                        "time, each after the passes queued for a slot (waiting at most this long per round)")
    p.add_argument("--rendezvous-url-template", default=DEFAULT_TEMPLATE,
                   help="where the operator reads each deployment's rendezvous (for the engines' reported transport, "
                        "condition TransportVerified); {name} and {namespace} are the CR's. Default: the in-cluster "
                        f"Service, {DEFAULT_TEMPLATE}")
    p.add_argument("--autoscale-seconds", type=float, default=Settings.autoscale_seconds,
                   help="how often the autoscaling planner observes and decides, for each CR with spec.autoscaling "
                        "(default 5)")
    p.add_argument("--autoscale-window-seconds", type=float, default=None,
                   help=f"how far back each decision reads arrivals, tokens and latencies (default: "
                        f"{DEFAULT_AUTOSCALE_WINDOW_SECONDS:g} s or --autoscale-seconds, whichever is longer); longer "
                        "than --autoscale-seconds, frequent decisions see a step in load (and the queues it builds) "
                        "sooner without reading rates off a few requests")
    p.add_argument("--transport-poll-seconds", type=float, default=Settings.transport_poll_seconds,
                   help="how often every deployment's rendezvous is read (in the background; default 30)")
    p.add_argument("--rendezvous-timeout", type=float, default=Settings.rendezvous_timeout,
                   help="bound of one rendezvous read (default 2 s); an unreachable rendezvous makes "
                        "TransportVerified Unknown, never a failed or slow reconcile")
    p.add_argument("--max-concurrent-passes", type=int, default=Settings.max_concurrent_passes,
                   help="reconcile passes run at once over all CRs (default 16); the others queue (a pass that may "
                        "turn its CR Ready first), so a burst of CRs converges without flooding the apiserver")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="log at DEBUG, and log every handler kopf runs (a line per watch event of every managed "
                        "object)")


def from_args(args: argparse.Namespace) -> Settings:
    """The settings `add_arguments`' flags give. Raises ValueError naming the flag that is out of range."""
    from ..transport import check_template  # not at import: `disagg --help` must not pay for aiohttp

    check_template(args.rendezvous_url_template)
    if args.max_concurrent_passes < 1:
        raise ValueError("--max-concurrent-passes must be at least 1")
    if args.autoscale_seconds <= 0:
        raise ValueError("--autoscale-seconds must be positive")
    window = args.autoscale_window_seconds
    if window is None:
        window = max(DEFAULT_AUTOSCALE_WINDOW_SECONDS, float(args.autoscale_seconds))
    elif window < args.autoscale_seconds:
        raise ValueError("--autoscale-window-seconds must be at least --autoscale-seconds")
    if args.transport_poll_seconds <= 0 or args.rendezvous_timeout <= 0:
        raise ValueError("--transport-poll-seconds and --rendezvous-timeout must be positive")
    if args.resync_seconds <= 0:
        raise ValueError("--resync-seconds must be positive")
    return Settings(
        namespaces=tuple(args.namespace), peering=args.peering, priority=args.priority,
        images=OperatorImages(operator=args.operator_image) if args.operator_image else OperatorImages(),
        metrics_port=args.metrics_port, liveness=args.liveness or None, resync_seconds=float(args.resync_seconds),
        rendezvous_url_template=args.rendezvous_url_template, rendezvous_timeout=float(args.rendezvous_timeout),
        transport_poll_seconds=float(args.transport_poll_seconds), autoscale_seconds=float(args.autoscale_seconds),
        autoscale_window_seconds=float(window), max_concurrent_passes=int(args.max_concurrent_passes),
        verbose=bool(args.verbose))
