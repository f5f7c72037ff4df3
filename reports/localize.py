"""The divergence localizer's renderings: the per-layer plot (distance and floor vs layer), the report section
(table rows + note) and a short Markdown summary of a ``core.localize.LocalizeRecord``."""

from __future__ import annotations

import base64
import io
from pathlib import Path

from core.localize import SITE_ORDER, LocalizeRecord, summary_rows

COLOURS = {"attn": "#1f77b4", "mlp": "#2ca02c", "resid": "#d62728"}


def plot_png(rec: LocalizeRecord, phase: str = "prefill") -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sites = [s for s in rec.sites if s.phase == phase]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8.5, 6.2), sharex=True)
    for module in SITE_ORDER:
        pts = sorted((s.layer, s) for s in sites if s.module == module)
        if not pts:
            continue
        xs = [L for L, _ in pts]
        ax1.plot(xs, [max(s.rel_mean, 1e-12) for _, s in pts], "-o", ms=3, color=COLOURS[module],
                 label=f"{module}: engine")
        ax1.plot(xs, [max(s.floor_rel_mean, 1e-12) for _, s in pts], "--", color=COLOURS[module], alpha=0.6,
                 label=f"{module}: floor ({rec.floor.get('precision', '?')})")
        ax2.plot(xs, [max(s.ratio, 1e-3) for _, s in pts], "-o", ms=3, color=COLOURS[module], label=module)
    ax1.set_yscale("log")
    ax1.set_ylabel("rel L2 vs oracle (mean over positions)")
    ax2.set_yscale("log")
    ax2.axhline(rec.factor, color="k", lw=1, ls=":", label=f"factor {rec.factor:g}")
    ax2.set_ylabel("distance / floor")
    ax2.set_xlabel("decoder layer")
    v = rec.verdict
    if v.first_divergent_layer is not None and v.phase == phase:
        for ax in (ax1, ax2):
            ax.axvline(v.first_divergent_layer, color="#ff7f0e", lw=1.5, alpha=0.8)
        title = f"first divergent: layer {v.first_divergent_layer} {v.first_divergent_module} ({v.phase})"
    elif v.first_divergent_layer is not None:
        title = f"first divergent: layer {v.first_divergent_layer} {v.first_divergent_module} ({v.phase})"
    else:
        title = f"no layer diverged (worst distance/floor {v.max_ratio:.3g} at {v.max_ratio_site})"
    ax1.set_title(f"{rec.engine.get('profile', '?')} vs {rec.oracle.get('oracle', 'oracle')} — {phase}: {title}",
                  fontsize=9)
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


def headline(rec: LocalizeRecord) -> str:
    v = rec.verdict
    if not v.named:
        return (f"no site diverged: the engine stays within {rec.factor:g}x the {rec.floor.get('precision')} floor "
                f"everywhere (worst distance/floor {v.max_ratio:.3g} at {v.max_ratio_site})")
    before = "n/a" if v.ratio_layer_before is None else f"{v.ratio_layer_before:.3g}"
    pos = ", ".join(f"{p.position} ({p.token_id} {p.text!r})" for p in v.positions[:4])
    return (f"first divergent: layer {v.first_divergent_layer}, module {v.first_divergent_module} ({v.phase}); "
            f"distance/floor {v.ratio_at_first:.3g} there, {before} at the layer before; "
            f"growth to the last layer x{(v.growth_factor or 0):.3g}; positions {pos}")


def section(rec: LocalizeRecord, label: str = "") -> dict:
    """A report section ({"rows", "note"}) for reports.render's ``extra``."""
    rows = []
    for r in summary_rows(rec, rec.verdict.phase or "prefill"):
        rows.append({k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in r.items()})
    note = (f"{label + ': ' if label else ''}{headline(rec)}. Distances: per-position relative L2 against the "
            f"oracle ({rec.oracle.get('oracle')}, {rec.oracle.get('precision')}), mean over positions; floor: the "
            f"oracle's own {rec.floor.get('precision')} run; diverged = distance/floor > {rec.factor:g}.")
    return {"rows": rows, "note": note}


def markdown(rec: LocalizeRecord) -> str:
    lines = [f"# Divergence localizer: {rec.engine.get('profile')}", "", headline(rec), "",
             "| layer | " + " | ".join(f"{m} rel | {m} /floor" for m in SITE_ORDER) + " | diverged |",
             "|---|" + "---|" * (2 * len(SITE_ORDER) + 1)]
    for r in summary_rows(rec, rec.verdict.phase or "prefill"):
        cells = [f"{r.get(f'{m} rel', float('nan')):.3g} | {r.get(f'{m} /floor', float('nan')):.3g}"
                 for m in SITE_ORDER]
        lines.append(f"| {r['layer']} | " + " | ".join(cells) + f" | {r['diverged']} |")
    return "\n".join(lines) + "\n"
