"""Draw bench/results/pd_serving.json as a PNG: TTFT p50/p99, handoff p50 and throughput per cell and arm.

Runs in the bench-only venv that `bench/pd_serving.py` makes (~/.cache/disagg/bench-venv, matplotlib only):
`python bench/plot_pd_serving.py RESULT.json[.gz] OUT.png`.
"""
from __future__ import annotations

import sys
from pathlib import Path

import matplotlib
import result_file

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"stub-direct-push": "#9ecae1", "stub-router-push": "#08519c", "stub-direct-pull": "#fdae6b",
          "stub-router-pull": "#d94801", "stub-vllm-router-pull": "#74c476",
          "direct-push": "#9ecae1", "router-push-concurrent": "#08519c", "router-push-sequential": "#6baed6",
          "direct-pull": "#fdae6b", "router-pull": "#d94801", "vllm-router-pull": "#74c476", "mono": "#969696"}


def main(src: str, dst: str) -> None:
    result = result_file.load(Path(src))
    every = {k: v for k, v in result["arms"].items() if v["cells"]}
    real = {k: v for k, v in every.items() if v["phase"] != "stub"}
    stub = {k: v for k, v in every.items() if v["phase"] == "stub"}
    cells, stub_cells = result["config"]["cells"], result["config"].get("stub_cells", [])
    panels = [("ttft", "p50_ms", "TTFT p50 (ms)", real, cells), ("ttft", "p99_ms", "TTFT p99 (ms)", real, cells),
              ("throughput_rps", None, "throughput (completed req/s)", real, cells),
              ("handoff", "p50_ms", "handoff p50 (ms): prefill done -> first token", real, cells),
              ("handoff", "p99_ms", "handoff p99 (ms)", real, cells),
              ("ttft", "p50_ms", "router overhead: TTFT p50 (ms) on stub engines", stub, stub_cells)]
    fig, axes = plt.subplots(2, 3, figsize=(20, 10))
    for ax, (metric, key, title, arms, cells) in zip(axes.flat, panels, strict=True):
        width = 0.8 / max(len(arms), 1)
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
            for bar, f in zip(bars, failed, strict=True):
                if f:
                    ax.annotate(f"{f} fail", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                                va="bottom", fontsize=7, color="red", rotation=90)
        if metric == "throughput_rps":  # what a zero-latency server would reach with these arrivals
            for j, cell in enumerate(cells):
                spans = [c["arrival_span_s"] for a in arms.values() for c in a["cells"]
                         if c["cell"] == cell and c.get("arrival_span_s")]
                if spans:
                    ax.hlines(result["config"]["requests_per_cell"] / spans[0], j - 0.45, j + 0.45, colors="black",
                              linestyles="dashed", linewidth=1, label="zero-latency server" if j == 0 else None)
            handles, labels = ax.get_legend_handles_labels()
            ax.legend([h for h, lab in zip(handles, labels, strict=True) if lab == "zero-latency server"],
                      ["zero-latency server"], fontsize=8, loc="upper right")
        ax.set_xticks(range(len(cells)), cells)
        ax.set_title(title)
        if metric != "throughput_rps" and arms is real:
            ax.set_yscale("log")
        if arms is stub:
            ax.legend(fontsize=8, loc="upper left")
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9)
    cfg = result["config"]
    plugin = (cfg.get("plugin") or {}).get("enabled")
    fig.suptitle(f"P/D serving on 2 CPU cores, vLLM 0.32 tiny model: {cfg['requests_per_cell']} Poisson requests per "
                 f"cell, {cfg['max_tokens']} output tokens, streamed, connector plugin "
                 f"{'on' if plugin else 'off'} ({result['when']})")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
