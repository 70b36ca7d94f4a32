"""`disagg operator`: run the operator. The command line makes the settings (controller/settings.py); everything
else is the controller package's."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random

from .controller.settings import Settings, add_arguments, from_args
from .peering import own_identity

__all__ = ["add_arguments", "configure_logging", "main"]


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
    try:
        settings = from_args(args)
    except ValueError as e:
        raise SystemExit(f"disagg operator: {e}") from None
    run(settings)


def run(settings: Settings) -> None:
    # Heavy imports stay here so `disagg --help` and the other subcommands never pay for kopf.
    import kopf
    from prometheus_client import start_http_server

    from .controller import handlers

    configure_logging(settings.verbose)
    if settings.metrics_port:
        start_http_server(settings.metrics_port)
    registry = kopf.OperatorRegistry()
    handlers.register(registry, settings)
    priority = settings.priority
    if settings.peering:
        priority = priority if priority is not None else random.randint(1, 1_000_000)
        ensure_peering_objects(settings.peering, list(settings.namespaces))
        logging.getLogger("disagg.operator").info("peering %r with priority %d", settings.peering, priority)
    namespaces = list(settings.namespaces)
    asyncio.run(kopf.operator(
        registry=registry, clusterwide=not namespaces, namespaces=namespaces,
        standalone=settings.peering is None, peering_name=settings.peering, priority=priority,
        liveness_endpoint=settings.liveness, identity=own_identity(os.environ),  # type: ignore[arg-type]  # kopf's Identity: a NewType of str it does not export
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
