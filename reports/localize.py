"""The divergence localizer's renderings: the per-layer plot (distance and floor vs layer), the report section
(table rows + note) and a short Markdown summary of a ``core.localize.LocalizeRecord``."""

from __future__ import annotations

import base64
import io
from pathlib import Path

from core.localize import SITE_ORDER, LocalizeRecord, summary_rows

COLOURS = {"attn": "#1f77b4", "mlp": "#2ca02c", "resid": "#d62728", "attn_stream": "#9467bd",
           "attn_in": "#8c564b", "ffn_in": "#e377c2", "compressor": "#7f7f7f", "indexer": "#bcbd22",
           "router": "#17becf"}
OUTER_X = {"embed": -1}        # the embedding is drawn at layer -1, the final norm and logits after the last


def _x(s, last: int) -> float:
    if s.layer is not None:
        return s.layer
    return OUTER_X.get(s.module, last + 1 if s.module == "final_norm" else last + 1.3)


def plot_png(rec: LocalizeRecord, phase: str = "prefill") -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sites = [s for s in rec.sites if s.phase == phase]
    last = max((s.layer for s in sites if s.layer is not None), default=0)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8.5, 6.2), sharex=True)
    for module in [m for m in SITE_ORDER if m not in ("indexer", "router")]:
        pts = sorted((s.layer, s) for s in sites if s.module == module)
        if not pts:
            continue
        xs = [L for L, _ in pts]
        ax1.plot(xs, [max(s.mean, 1e-12) for _, s in pts], "-o", ms=3, color=COLOURS[module],
                 label=f"{module}: test")
        ax1.plot(xs, [max(s.floor_mean, 1e-12) for _, s in pts], "--", color=COLOURS[module], alpha=0.6,
                 label=f"{module}: floor")
        ax2.plot(xs, [max(min(s.ratio, 1e6), 1e-3) for _, s in pts], "-o", ms=3, color=COLOURS[module],
                 label=module)
    for s in sites:
        if s.layer is None or s.module in ("indexer", "router"):
            ax2.plot([_x(s, last)], [max(min(s.ratio, 1e6), 1e-3)], "s", ms=5, color="k")
            ax2.annotate(s.name, (_x(s, last), max(min(s.ratio, 1e6), 1e-3)), fontsize=6)
    ax1.set_yscale("log")
    ax1.set_ylabel("distance to the reference (mean)")
    ax2.set_yscale("log")
    ax2.axhline(1.0, color="k", lw=1, ls=":", label=f"threshold (false alarms {rec.calibration.false_alarm_rate:g})")
    ax2.set_ylabel("worst distance / threshold")
    ax2.set_xlabel("decoder layer (embed at -1; final norm and logits after the last)")
    v = rec.verdict
    if v.named and v.phase == phase and v.first_divergent_layer is not None:
        for ax in (ax1, ax2):
            ax.axvline(v.first_divergent_layer, color="#ff7f0e", lw=1.5, alpha=0.8)
    ax1.set_title(f"{rec.engine.get('profile', '?')} ({rec.mode}) — {phase}: {headline(rec)[:110]}", fontsize=8)
    ax1.legend(fontsize=6, ncol=3)
    ax2.legend(fontsize=6, ncol=4)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def plot_b64(rec: LocalizeRecord, phase: str = "prefill") -> str:
    return base64.b64encode(plot_png(rec, phase)).decode()


def write_plot(rec: LocalizeRecord, path: str | Path, phase: str = "prefill") -> Path:
    from core.atomic import atomic_write_bytes

    path = Path(path)
    atomic_write_bytes(path, plot_png(rec, phase))
    return path


def _reference(rec: LocalizeRecord) -> str:
    return "the base arm" if rec.mode == "ab" else f"the oracle ({rec.oracle.get('oracle')})"


def headline(rec: LocalizeRecord) -> str:
    v = rec.verdict
    rate = rec.calibration.false_alarm_rate
    if v.status == "clean":
        return (f"no site diverged and the outputs agree: every site stays inside its {rec.floor.get('precision')} "
                f"floor at false-alarm rate {rate:g} (worst distance/threshold {v.max_ratio:.3g} at "
                f"{v.max_ratio_site})")
    if v.status == "floor_too_wide":
        return f"the floor is too wide to place it: {v.explanation}"
    before = "n/a" if v.ratio_before is None else f"{v.ratio_before:.3g}"
    onset = []
    if v.onset_position is not None:
        onset.append(f"from prompt position {v.onset_position}")
    if v.onset_step is not None:
        onset.append(f"at decode step {v.onset_step}")
    pos = ", ".join(f"{p.position} ({p.token_id} {p.text!r})" for p in v.positions[:4])
    exact = "the engine is bit-exact against itself" if rec.mode == "ab" else "the floor run equals the oracle there"
    there = (f"distance {s.worst:.3g} there against a zero floor ({exact})"
             if (s := _named_site(rec)) is not None and s.threshold == 0.0
             else f"distance/threshold {v.ratio_at_first:.3g} there")
    growth = "" if v.growth_factor is None else f"; growth to the last layer x{v.growth_factor:.3g}"
    return (f"first divergent: {v.site} ({v.phase}; {' and '.join(onset) or 'onset n/a'}); {there}, "
            f"{before} at the stage before{growth}; worst positions {pos}")


def _named_site(rec: LocalizeRecord):
    v = rec.verdict
    return next((s for s in rec.sites if s.phase == v.phase and s.name == v.site), None)


def section(rec: LocalizeRecord, label: str = "") -> dict:
    """A report section ({"rows", "note"}) for reports.render's ``extra``."""
    rows = []
    for r in summary_rows(rec, rec.verdict.phase or "prefill"):
        rows.append({k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in r.items()})
    note = (f"{label + ': ' if label else ''}{headline(rec)}. Distances: per position, relative L2 (logits: KL) "
            f"against {_reference(rec)}; floor: {rec.floor.get('precision')} (its per-position distribution); "
            f"diverged = a position beyond the threshold set for a false-alarm rate of "
            f"{rec.calibration.false_alarm_rate:g} per run over {rec.calibration.tests} tests.")
    return {"rows": rows, "note": note}


def markdown(rec: LocalizeRecord) -> str:
    phase = rec.verdict.phase or "prefill"
    modules = [m for m in (*SITE_ORDER, "embed", "final_norm", "logits")
               if any(s.module == m and s.phase == phase for s in rec.sites)]
    lines = [f"# Divergence localizer: {rec.engine.get('profile')} ({rec.mode} mode)", "", headline(rec), "",
             "| stage | " + " | ".join(f"{m} dist | {m} /thr" for m in modules) + " | diverged |",
             "|---|" + "---|" * (2 * len(modules) + 1)]
    for r in summary_rows(rec, phase):
        cells = [f"{r.get(f'{m} dist', float('nan')):.3g} | {r.get(f'{m} /thr', float('nan')):.3g}"
                 for m in modules]
        lines.append(f"| {r['layer']} | " + " | ".join(cells) + f" | {r['diverged']} |")
    return "\n".join(lines) + "\n"
