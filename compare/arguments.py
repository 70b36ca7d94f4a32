"""The arguments of `disagg compare` and of the Job's `disagg compare-run`, kept apart from the code that runs
them so that building the `disagg` command line imports no client library."""
from __future__ import annotations

import argparse
from pathlib import Path

from .schedule import MODES

LOAD_FLAGS = ("requests", "prompt_words", "output_tokens", "rate", "rounds", "first", "prefer", "seed", "warmup",
              "request_timeout", "rollout_timeout", "switch")
"""The load arguments `disagg compare` passes on to the Job as they are."""


def add_compare_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="the DisaggregatedInference to compare push and pull on")
    p.add_argument("-n", "--namespace", default="default")
    p.add_argument("--workload", type=Path, help="your own requests: JSONL, one {\"prompt\" or \"messages\", "
                   "\"max_tokens\"} per line (default: a synthetic workload, see --requests)")
    add_load_arguments(p)
    p.add_argument("--image", help="the image the Job runs (default: the router's own)")
    p.add_argument("--out", type=Path, default=Path("."), help="where report.json, report.md and plot.svg go (.)")
    p.add_argument("--keep", action="store_true", help="leave the Job and its objects in the cluster")


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", required=True, help="the DisaggregatedInference to compare on")
    p.add_argument("--namespace", required=True)
    p.add_argument("--report-configmap", required=True, help="ConfigMap to write the report into")
    p.add_argument("--workload", type=Path, help="a JSONL workload (gzipped when its name ends in .gz); "
                   "default: the synthetic one below")
    add_load_arguments(p)


def add_load_arguments(p: argparse.ArgumentParser) -> None:
    """The load and its schedule: shared with `disagg compare`, which passes them on to the Job."""
    p.add_argument("--requests", type=int, default=200, help="synthetic workload: requests per segment (200)")
    p.add_argument("--prompt-words", type=int, default=256, help="synthetic workload: words per prompt (256)")
    p.add_argument("--output-tokens", type=int, default=64, help="synthetic workload: tokens to generate (64)")
    p.add_argument("--rate", type=float, default=2.0, help="requests per second, Poisson (2)")
    p.add_argument("--rounds", type=int, default=2, help="ABBA rounds: each serves the workload once per mode (2)")
    p.add_argument("--first", choices=MODES, default="push", help="the first segment's mode (push)")
    p.add_argument("--prefer", choices=("ttft", "tpot"), default="ttft",
                   help="what decides when TTFT and TPOT favour different modes (ttft)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=4, help="requests sent before each segment, not counted (4)")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds one request may take (300)")
    p.add_argument("--rollout-timeout", type=float, default=1800.0,
                   help="seconds a mode switch may take to be served (1800)")
    p.add_argument("--switch", choices=("surge", "recreate"), default="surge",
                   help="how the mode changes. surge (default): the operator's rollout, new engines Ready before old "
                   "ones go: it serves throughout, and needs room for one more engine per role. recreate: both "
                   "roles to 0 through their /scale, the mode, then back: for nodes with no room for another "
                   "engine; nothing is served during the switch")


