"""Draw bench/results/pd_serving.json as a PNG: TTFT p50/p99, handoff p50 and throughput per cell and arm.

Runs in the bench-only venv that `bench/pd_serving.py` makes (~/.cache/disagg/bench-venv, matplotlib only):
`python bench/plot_pd_serving.py RESULT.json OUT.png`.
"""
from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"direct-push": "#9ecae1", "router-push-concurrent": "#08519c", "router-push-sequential": "#6baed6",
          "direct-pull": "#fdae6b", "router-pull": "#d94801", "vllm-router-pull": "#74c476", "mono": "#969696"}


def main(src: str, dst: str) -> None:
    result = json.load(open(src))
    arms = {k: v for k, v in result["arms"].items() if v["cells"]}
    cells = result["config"]["cells"]
    panels = [("ttft", "p50_ms", "TTFT p50 (ms)"), ("ttft", "p99_ms", "TTFT p99 (ms)"),
              ("handoff", "p50_ms", "handoff p50 (ms): prefill done -> first token"),
              ("throughput_rps", None, "throughput (completed req/s)")]
    fig, axes = plt.subplots(2, 2, figsize=(15, 9))
    width = 0.8 / max(len(arms), 1)
    for ax, (metric, key, title) in zip(axes.flat, panels):
        for i, (arm, data) in enumerate(arms.items()):
            by_cell = {c["cell"]: c for c in data["cells"]}
            xs, ys, failed = [], [], []
            for j, cell in enumerate(cells):
                c = by_cell.get(cell)
                if c is None:
                    continue
                v = c.get(metric) if key is None else (c.get(metric) or {}).get(key)
                if v is None:
                    continue
                xs.append(j + (i - (len(arms) - 1) / 2) * width)
                ys.append(v)
                failed.append(c["failed"])
            bars = ax.bar(xs, ys, width, label=arm, color=COLORS.get(arm))
            for bar, f in zip(bars, failed):
                if f:
                    ax.annotate(f"{f} fail", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                                va="bottom", fontsize=7, color="red", rotation=90)
        if metric == "throughput_rps":  # the offered rate, for reference
            for j, cell in enumerate(cells):
                rate = float(cell.split("@")[1].rstrip("/s"))
                ax.hlines(rate, j - 0.45, j + 0.45, colors="black", linestyles="dashed", linewidth=1,
                          label="offered rate" if j == 0 else None)
            ax.legend(fontsize=8)
        ax.set_xticks(range(len(cells)), cells)
        ax.set_title(title)
        if metric != "throughput_rps":
            ax.set_yscale("log")
        ax.grid(axis="y", alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    cfg = result["config"]
    fig.suptitle(f"P/D serving on 2 CPU cores, vLLM 0.32 tiny model: {cfg['requests_per_cell']} Poisson requests per "
                 f"cell, {cfg['max_tokens']} output tokens, streamed ({result['when']})")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
