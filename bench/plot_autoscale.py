"""Draw bench/results/autoscale.json as a PNG: per arm (its first round), the offered load and each role's engine
pods over the trace, and TTFT against the SLO.

Runs in the bench-only venv (~/.cache/disagg/bench-venv, matplotlib only), as bench/autoscale.py calls it:
`python bench/plot_autoscale.py RESULT.json[.gz] OUT.png`.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

import matplotlib
import result_file

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

BIN_S = 10.0
ROLE_COLORS = {"prefill": "#08519c", "decode": "#d94801"}
ROLE_STYLES = {"prefill": {"linestyle": "--", "linewidth": 2.0}, "decode": {"linestyle": "-", "linewidth": 1.2}}
"""Prefill dashed and wider: the two roles often have the same count, and one line would hide the other."""


def binned(requests: list[dict], end: float) -> tuple[list[float], list[float], list[float | None], list[float | None]]:
    """Per BIN_S seconds of send time: the bin's middle, requests sent per second, TTFT p50 and p90 (ms)."""
    n = int(end // BIN_S) + 1
    sent: list[list[dict]] = [[] for _ in range(n)]
    for r in requests:
        sent[min(n - 1, int(r["at"] // BIN_S))].append(r)
    mids = [(i + 0.5) * BIN_S for i in range(n)]
    rate = [len(b) / BIN_S for b in sent]
    p50: list[float | None] = []
    p90: list[float | None] = []
    for b in sent:
        ttft = sorted(r["ttft"] * 1000 for r in b if r.get("ttft") is not None)
        p50.append(statistics.median(ttft) if ttft else None)
        p90.append(ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))] if ttft else None)
    return mids, rate, p50, p90


def main(src: str, dst: str) -> None:
    result = result_file.load(Path(src))
    firsts: dict[str, dict] = {}
    for arm in result["arms"]:
        firsts.setdefault(arm["arm"], arm)
    slo_ms = result["config"]["slo"]["ttft_ms"]
    phases = result["config"]["phases"]
    fig, axes = plt.subplots(2, len(firsts), figsize=(7 * len(firsts), 8), sharex=True, squeeze=False,
                             layout="constrained")
    for col, (name, arm) in enumerate(firsts.items()):
        samples = arm["samples"]
        end = max([s["s"] for s in samples] + [r["at"] for r in arm["requests"]])
        mids, rate, p50, p90 = binned(arm["requests"], end)
        top, bottom = axes[0][col], axes[1][col]
        top.step(mids, rate, where="mid", color="#969696", label="offered req/s")
        top.set_ylabel("requests/s sent")
        top.set_ylim(0, max(rate + [0.1]) * 1.3)
        pods = top.twinx()
        for role, color in ROLE_COLORS.items():
            pods.step([s["s"] for s in samples], [s[f"{role}_pods"] for s in samples], where="post", color=color,
                      label=f"{role} pods", **ROLE_STYLES[role])
        pods.set_ylabel("engine pods")
        pods.set_ylim(0, max([s[f"{r}_pods"] for s in samples for r in ROLE_COLORS] + [1]) + 1)
        top.set_title(f"{name}: {arm['summary']['replica_seconds']} replica-s, "
                      f"SLO {arm['summary']['slo_attainment']}")
        handles = top.get_legend_handles_labels()[0] + pods.get_legend_handles_labels()[0]
        top.legend(handles, [str(h.get_label()) for h in handles], loc="upper left", fontsize=8)
        bottom.plot(mids, p50, ".-", color="#08519c", label="TTFT p50")
        bottom.plot(mids, p90, ".-", color="#9ecae1", label="TTFT p90")
        bottom.axhline(slo_ms, color="#cb181d", linewidth=0.8, label=f"SLO {slo_ms} ms")
        bottom.set_yscale("log")
        bottom.set_ylabel("TTFT (ms), by send time")
        bottom.set_xlabel("seconds into the trace")
        bottom.legend(loc="upper left", fontsize=8)
        start = 0.0
        for p in phases:
            for ax in (top, bottom):
                ax.axvline(start, color="#d9d9d9", linewidth=0.8)
            top.text(start + 2, 0.01, p["name"], fontsize=8, color="#737373", va="bottom",
                     transform=top.get_xaxis_transform())
            start += p["seconds"]
    fig.savefig(dst, dpi=100)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
