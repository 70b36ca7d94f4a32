"""Draw the results table's ratios as a PNG: each ratio with its 90% interval, and its goal where it has one.

Runs in the bench-only venv (see bench/pd_serving.py's bench_python): `python bench/plot_summary.py ROWS.json
OUT.png`, ROWS being bench/results_table.py's rows as JSON (bench/report.py writes them).
"""
from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str) -> None:
    rows = [r for r in json.load(open(src)) if r["value"] is not None]
    fig, ax = plt.subplots(figsize=(11, 0.32 * len(rows) + 1.5))
    for i, r in enumerate(rows):
        color = "#969696" if r["met"] is None else ("#31a354" if r["met"] else "#de2d26")
        if r["ci90"]:
            lo, hi = r["ci90"]
            ax.plot([lo, hi], [i, i], color=color, linewidth=2, alpha=0.6)
        ax.plot([r["value"]], [i], "o", color=color)
        if r["goal"]:
            ax.plot([r["goal"]["threshold"]], [i], "|", color="black", markersize=12)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{r['source'].removesuffix('.json')}: {r['measure']}" for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.axvline(1.0, color="#bdbdbd", linewidth=0.8)
    ax.set_xlabel("ratio (log); dot: estimate, bar: 90% interval, tick: goal; green met, red not, grey no goal")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
