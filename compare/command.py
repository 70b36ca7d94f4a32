"""`disagg compare NAME`: push against pull on the user's own deployment and load. It starts the comparison as a
Job beside the router (job.py; the Job runs runner.py), prints the Job's progress, and writes the report it
leaves (report.json, report.md, plot.svg) into --out. The Job and everything made for it are deleted at the end
unless --keep; a stopped Job gives the CR its mode back."""
from __future__ import annotations

import argparse
import base64
import gzip
import secrets
import string
import sys
import time
from pathlib import Path
from typing import Any

from lightkube import Client, codecs
from lightkube.core.exceptions import ApiError, ConfigError
from lightkube.resources.apps_v1 import Deployment
from lightkube.resources.batch_v1 import Job
from lightkube.resources.core_v1 import ConfigMap, Pod, ServiceAccount
from lightkube.resources.rbac_authorization_v1 import Role, RoleBinding
from lightkube.types import CascadeType

from disagg.operator import api, names
from disagg.operator.bindings import DinfResource

from . import report, schedule, workload
from .arguments import LOAD_FLAGS
from .job import LABEL_RUN, PLACEMENT, REPORT_KEY, CompareJob, objects


def job_args(args: argparse.Namespace) -> tuple[str, ...]:
    return tuple(x for k in LOAD_FLAGS for x in (f"--{k.replace('_', '-')}", str(getattr(args, k))))


def deadline(args: argparse.Namespace, requests: int) -> int:
    """Seconds the Job may run: every switch's rollout, and every segment at its rate plus a request's timeout."""
    segments = 2 * args.rounds
    return int(args.rollout_timeout * (segments + 1) + segments * (requests / args.rate + args.request_timeout))


def router_pod(client: Client, ns: str, name: str) -> tuple[str | None, tuple[tuple[str, Any], ...]]:
    """The router's image and where its pods may run (job.PLACEMENT fields of its pod template)."""
    d: Any = client.get(Deployment, names.router_name(name), namespace=ns)
    pod = d.to_dict()["spec"]["template"]["spec"]
    return pod["containers"][0].get("image"), tuple((k, pod[k]) for k in PLACEMENT if pod.get(k))


def _job_state(client: Client, ns: str, job: str) -> str | None:
    status = client.get(Job, job, namespace=ns).status
    for c in (status.conditions if status else None) or []:
        if c.status == "True" and c.type in ("Complete", "Failed"):
            return c.type if c.type == "Complete" else f"Failed ({c.reason}: {c.message})"
    return None


def follow(client: Client, ns: str, cj: CompareJob) -> str:
    """Print the Job pod's log as it comes; the Job's end state once it has one."""
    said = 0
    while True:
        run: dict[str, Any] = {LABEL_RUN: cj.run}
        pods = list(client.list(Pod, namespace=ns, labels=run))
        phase = pods[0].status.phase if pods and pods[0].status else None
        if pods and phase in ("Running", "Succeeded", "Failed"):
            assert pods[0].metadata is not None and pods[0].metadata.name is not None
            lines = list(client.log(pods[0].metadata.name, namespace=ns))
            for line in lines[said:]:
                print(f"  {line.rstrip()}", flush=True)
            said = len(lines)
        if (state := _job_state(client, ns, cj.base)) is not None:
            return state
        time.sleep(2)  # the Job's progress, read from the apiserver


def write_report(client: Client, cj: CompareJob, out: Path) -> report.CompareReport:
    cm = client.get(ConfigMap, cj.report_configmap, namespace=cj.namespace)
    data, binary = cm.data or {}, cm.binaryData or {}
    result = report.CompareReport.model_validate_json(gzip.decompress(base64.b64decode(binary[REPORT_KEY])))
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(result.model_dump_json(indent=1) + "\n")
    (out / "report.md").write_text(data["report.md"])
    (out / "plot.svg").write_text(data["plot.svg"])
    return result


def cleanup(client: Client, cj: CompareJob) -> None:
    selector: dict[str, Any] = {LABEL_RUN: cj.run}
    kinds: tuple[Any, ...] = (Job, ConfigMap, RoleBinding, Role, ServiceAccount)
    for kind in kinds:
        for obj in client.list(kind, namespace=cj.namespace, labels=selector):
            try:
                # Foreground: the Job's pod goes with it (SIGTERM: the run gives the CR its mode back).
                client.delete(kind, obj.metadata.name, namespace=cj.namespace, cascade=CascadeType.FOREGROUND)
            except ApiError as e:
                if e.status.code != 404:
                    raise
    # The report ConfigMap carries the CR's labels, not the run's: it is written by the Job.
    try:
        client.delete(ConfigMap, cj.report_configmap, namespace=cj.namespace)
    except ApiError as e:
        if e.status.code != 404:
            raise


def main(args: argparse.Namespace) -> None:
    body = None
    if args.workload is not None:
        body = args.workload.read_bytes()
        try:
            count = len(workload.parse_jsonl(body.decode(), args.workload.name))
        except (workload.WorkloadError, UnicodeDecodeError) as e:
            raise SystemExit(f"disagg compare: {e}") from None
    else:
        count = args.requests
    try:
        if body is None:
            workload.synthetic(args.requests, args.prompt_words, args.output_tokens, args.seed)
        schedule.abba(args.rounds)
        workload.arrivals(1, args.rate, args.seed)
    except ValueError as e:
        raise SystemExit(f"disagg compare: {e}") from None
    try:
        client = Client()
    except ConfigError as e:
        raise SystemExit(f"disagg compare: no cluster to talk to: {e}") from None
    try:
        found: Any = client.get(DinfResource, args.name, namespace=args.namespace)
        cr = api.DisaggregatedInference.model_validate(found.to_dict())
    except ApiError as e:
        raise SystemExit(f"disagg compare: {args.namespace}/{args.name}: {e.status.message}") from None
    if cr.status is None or not cr.status.endpoint:
        raise SystemExit(f"disagg compare: {args.namespace}/{args.name} has no endpoint yet: is it Ready?")
    run = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(5))
    found_image, placement = router_pod(client, args.namespace, args.name)
    image = args.image or found_image
    if not image:
        raise SystemExit(f"disagg compare: the router of {args.namespace}/{args.name} names no image; pass --image")
    cj = CompareJob(namespace=args.namespace, name=args.name, run=run, image=image, args=job_args(args),
                    workload_jsonl=body, placement=placement, deadline_seconds=deadline(args, count))
    try:
        made: list[Any] = objects(cj)
    except ValueError as e:
        raise SystemExit(f"disagg compare: {e}") from None
    print(f"disagg compare {run}: {count} requests at {args.rate:g}/s per segment, order "
          f"{', '.join(schedule.abba(args.rounds, args.first))}, on {args.namespace}/{args.name} "
          f"(now {cr.spec.kv_transfer.mode}); each switch rolls the engines", flush=True)
    try:
        for obj in made:
            client.create(codecs.from_dict(obj))
        state = follow(client, args.namespace, cj)
        if state != "Complete":
            raise SystemExit(f"disagg compare: the Job {cj.base} {state}")
        result = write_report(client, cj, args.out)
        print(report.markdown(result))
        print(f"wrote {args.out / 'report.json'}, {args.out / 'report.md'}, {args.out / 'plot.svg'}")
    except KeyboardInterrupt:
        print("stopped: the Job is deleted, and gives the CR its mode back as it stops", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        if not args.keep:
            cleanup(client, cj)
