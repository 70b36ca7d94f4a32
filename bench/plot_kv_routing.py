"""Draw bench/results/kv_routing.json as a PNG: per fleet (rows) and workload (columns), each arm's TTFT p50 (bar, on a
linear axis from 0) and p99 (tick), pooled over every valid segment of every round and run.

Runs in the bench-only venv (~/.cache/disagg/bench-venv, matplotlib only):
`python bench/plot_kv_routing.py RESULT.json[.gz] OUT.png`.
"""
from __future__ import annotations

import sys
from pathlib import Path

import matplotlib
import result_file

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STATUS, TTFT = 1, 2  # bench/kv_routing.py ROW: sent_s, status, ttft_ms, ...
ARM_COLORS = {"least-loaded": "#969696", "prefix-aware": "#08519c", "prefix-aware-decode-only": "#6baed6",
              "vllm-router-cache-aware": "#d94801"}
WORKLOADS = ("shared", "conversation", "unique")


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ttfts(segments: list[dict], arm: str, workload: str) -> list[float]:
    """Answered requests' TTFT (ms) of the arm's valid segments on the workload."""
    return [row[TTFT] for s in segments if s["arm"] == arm and s["workload"] == workload and s.get("valid", True)
            for row in s["requests"] if row[STATUS] == 200 and row[TTFT] is not None]


def main(src: Path, out: Path) -> None:
    result = result_file.load(src)
    fleets = result["fleets"]
    fig, axes = plt.subplots(len(fleets), len(WORKLOADS), figsize=(4.2 * len(WORKLOADS), 3.2 * len(fleets)),
                             squeeze=False)
    for i, (fleet, f) in enumerate(fleets.items()):
        arms = [a for a in ARM_COLORS if any(s["arm"] == a for s in f["segments"])]
        for j, workload in enumerate(WORKLOADS):
            ax = axes[i][j]
            for k, arm in enumerate(arms):
                values = ttfts(f["segments"], arm, workload)
                if not values:
                    continue
                p50, p99 = quantile(values, 0.5), quantile(values, 0.99)
                ax.bar(k, p50, color=ARM_COLORS[arm])
                ax.annotate(f"{p50:.0f}", (k, p50), ha="center", va="bottom", fontsize=8)
                ax.plot([k - 0.3, k + 0.3], [p99, p99], color="black", linewidth=1.2)
            ax.set_ylim(bottom=0)
            ax.set_xticks([])
            ax.set_title(f"{fleet} fleet, {workload}", fontsize=10)
            if j == 0:
                ax.set_ylabel("TTFT ms (bar p50, tick p99)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for a, c in ARM_COLORS.items()]
    fig.legend(handles, list(ARM_COLORS), loc="lower center", ncol=len(ARM_COLORS), fontsize=9, frameon=False)
    engines = next(iter(fleets.values()))["engines"]
    fig.suptitle(f"Prefix-aware routing on {engines['prefill']}+{engines['decode']} engine emulators "
                 f"({len(result.get('runs', [])) or 1} run(s))", fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
