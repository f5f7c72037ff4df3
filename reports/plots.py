"""Report figures as base64 PNG strings (matplotlib, Agg canvas, no pyplot global state).

Every function takes the report dict of `reports.render.report_data` (and, for the CDF, the per-position
metrics) and returns one base64-encoded PNG. Text from records is passed through `mpl_text` so that `$`
cannot start mathtext and a leading `_` cannot hide a legend entry.
"""

from __future__ import annotations

import base64
import io
import math
from typing import Any, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

CDF_POINTS = 400
KL_DISPLAY_FLOOR = 1e-9


def mpl_text(value: Any) -> str:
    text = str(value).replace("\\", "\\\\").replace("$", r"\$")
    return " " + text if text.startswith("_") else text


def _png(fig: Figure) -> str:
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=96, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _num(x: Any) -> float:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else math.nan


def _offsets(n_series: int, width: float = 0.7) -> np.ndarray:
    if n_series == 1:
        return np.zeros(1)
    return np.linspace(-width / 2, width / 2, n_series)


def domain_kl(data: dict) -> str:
    """Per-domain mean KL_part with its prompt-bootstrap 95% interval, one series per engine record."""
    domains = data["domains"]
    fig = Figure(figsize=(max(6.0, 0.9 * len(domains) + 2), 3.8))
    ax = fig.add_subplot()
    x = np.arange(len(domains))
    offs = _offsets(len(data["engines"]), 0.5)
    positive, any_finite = True, False   # a log axis needs one finite positive value to place itself
    for off, eng in zip(offs, data["engines"]):
        s = [eng["metrics"]["domains"][d]["kl_part"] for d in domains]
        mean = np.array([_num(v["mean"]) for v in s])
        lo = np.array([_num(v["ci_low"]) for v in s])
        hi = np.array([_num(v["ci_high"]) for v in s])
        err = np.vstack([np.nan_to_num(mean - lo), np.nan_to_num(hi - mean)]).clip(min=0)
        positive &= bool(np.all((mean[np.isfinite(mean)] > 0)) and np.all(lo[np.isfinite(lo)] > 0))
        any_finite |= bool(np.isfinite(mean).any())
        ax.errorbar(x + off, mean, yerr=err, fmt="o", capsize=3, label=mpl_text(eng["label"]))
    ax.set_xticks(x, [mpl_text(d) for d in domains], rotation=30, ha="right")
    ax.set_ylabel("KL_part (nats), mean ± 95% CI")
    if positive and any_finite:
        ax.set_yscale("log")
    if not any_finite:
        ax.text(0.5, 0.5, "no finite KL_part (every position a hard fail)", transform=ax.transAxes, ha="center")
    ax.set_title("Per-domain KL_part")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _png(fig)


def kl_cdf(results: Sequence[Any]) -> str:
    """Empirical CDF of per-position KL_part (finite, unambiguous positions), log x."""
    fig = Figure(figsize=(6.5, 3.8))
    ax = fig.add_subplot()
    probs = np.linspace(0.0, 1.0, CDF_POINTS)
    drawn = False
    for res in results:
        pm = res.panel.positions
        v = pm.kl_part[np.isfinite(pm.kl_part) & ~pm.ambiguous]
        if v.size == 0:
            continue
        q = np.quantile(v, probs)
        ax.plot(np.maximum(q, KL_DISPLAY_FLOOR), probs, label=mpl_text(res.label))
        drawn = True
    if drawn:
        ax.set_xscale("log")
    else:
        ax.text(0.5, 0.5, "no finite KL_part (every position a hard fail)", transform=ax.transAxes, ha="center")
    ax.set_xlabel(f"KL_part (nats; values below {KL_DISPLAY_FLOOR:g} drawn at it)")
    ax.set_ylabel("fraction of positions ≤ x")
    ax.set_title("KL_part CDF")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _png(fig)


def buckets(data: dict) -> str:
    """Mean and median KL_part, and top-1 agreement, per reference-confidence bucket (overall)."""
    labels = data["settings"]["confidence_buckets"]
    fig = Figure(figsize=(10, 3.8))
    ax_kl, ax_t1 = fig.subplots(1, 2)
    x = np.arange(len(labels))
    offs = _offsets(len(data["engines"]), 0.3)
    any_positive = False
    for i, (off, eng) in enumerate(zip(offs, data["engines"])):
        b = eng["metrics"]["overall"]["buckets"]
        mean = np.array([_num(r["kl_mean"]) for r in b])
        median = np.array([_num(r["kl_median"]) for r in b])
        top1 = np.array([_num(r["top1"]) for r in b])
        color = f"C{i % 10}"
        ax_kl.plot(x + off, mean, "o-", color=color, label=mpl_text(eng["label"]) + " mean")
        ax_kl.plot(x + off, median, "s--", color=color, mfc="none", label=mpl_text(eng["label"]) + " median")
        ax_t1.plot(x + off, top1, "o-", color=color, label=mpl_text(eng["label"]))
        any_positive |= bool(np.any(np.isfinite(mean) & (mean > 0)))
    for ax in (ax_kl, ax_t1):
        ax.set_xticks(x, labels)
        ax.set_xlabel("reference top-1 probability")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    if any_positive:
        ax_kl.set_yscale("log")
    ax_kl.set_ylabel("KL_part (nats)")
    ax_kl.set_title("KL_part by confidence bucket")
    ax_t1.set_ylabel("top-1 agreement")
    ax_t1.set_title("Top-1 agreement by confidence bucket")
    return _png(fig)


def top1_domain(data: dict) -> str:
    """Top-1 agreement per domain (all positions), grouped bars per engine record."""
    domains = data["domains"]
    fig = Figure(figsize=(max(6.0, 0.9 * len(domains) + 2), 3.8))
    ax = fig.add_subplot()
    x = np.arange(len(domains))
    n = len(data["engines"])
    width = 0.8 / n
    lows = []
    for i, eng in enumerate(data["engines"]):
        t1 = np.array([_num(eng["metrics"]["domains"][d]["top1"]) for d in domains])
        lows.append(np.nanmin(t1) if np.isfinite(t1).any() else 0.0)
        ax.bar(x - 0.4 + width * (i + 0.5), np.nan_to_num(t1), width, label=mpl_text(eng["label"]))
    ax.set_xticks(x, [mpl_text(d) for d in domains], rotation=30, ha="right")
    ax.set_ylim(max(0.0, min(lows) - 0.05), 1.0)
    ax.set_ylabel("top-1 agreement")
    ax.set_title("Top-1 agreement per domain")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _png(fig)


def render_all(data: dict, results: Sequence[Any]) -> dict[str, str]:
    """{figure title: base64 PNG} in the order the report shows them."""
    return {
        "Per-domain KL_part (95% prompt-bootstrap CI)": domain_kl(data),
        "KL_part CDF": kl_cdf(results),
        "Confidence buckets": buckets(data),
        "Top-1 agreement per domain": top1_domain(data),
    }
