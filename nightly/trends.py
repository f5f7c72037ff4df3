"""Trend plots of the nightly history (matplotlib PNG): per-metric lines per cell, gate pass/fail per run."""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from core.atomic import atomic_path  # noqa: E402
from nightly import history as H  # noqa: E402

# Metrics plotted (prefixes); a KL is plotted on a log axis.
PLOTTED = ("kl_part_prompt_mean[", "kl_panel.kl_part_mean", "kl_panel.top1", "flag_ab.")
STATUS_COLOURS = {"green": "#2e7d32", "red": "#c62828", "regression": "#6a1b9a"}


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", name).strip("_")[:120]


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_path(path, ".partial.png") as tmp:  # the suffix tells savefig the format
            fig.savefig(tmp, dpi=100, bbox_inches="tight")
    finally:
        plt.close(fig)
    return path


def plot_trends(db: str | Path, out_dir: Path) -> list[Path]:
    """One PNG per plotted metric (a line per cell) plus gates.png; returns the paths written."""
    series = H.metric_series(db)
    by_metric: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for (cell, name), pts in series.items():
        if name.startswith(PLOTTED):
            by_metric.setdefault(name, {})[cell] = pts
    out: list[Path] = []
    for name, cells in sorted(by_metric.items()):
        fig, ax = plt.subplots(figsize=(7, 3.2))
        for cell, pts in sorted(cells.items()):
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=cell)
        if "kl_part" in name and all(v > 0 for pts in cells.values() for _, v in pts):
            ax.set_yscale("log")
        ax.set_xlabel("nightly run id")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(name, fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        out.append(_save(fig, out_dir / f"metric-{_safe(name)}.png"))
    gates = H.gate_series(db)
    if gates:
        fig, ax = plt.subplots(figsize=(7, 3.2))
        ids = [g[0] for g in gates]
        ax.bar(ids, [g[2] for g in gates], color=[STATUS_COLOURS.get(g[1], "grey") for g in gates], label="passed")
        ax.bar(ids, [g[3] for g in gates], bottom=[g[2] for g in gates], color="#ef9a9a", label="failed")
        ax.set_xlabel("nightly run id (bar colour = run status)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("gates")
        ax.set_title("gate results per nightly run", fontsize=9)
        ax.legend(fontsize=7)
        out.append(_save(fig, out_dir / "gates.png"))
    return out
