"""Task-eval tables in the layout of the KL comparison (and of the model cards): one row per suite,
the candidate beside the baseline, with the paired p-value of each suite, and the one-line verdict
("no suite differs significantly (smallest paired p: …)")."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Sequence

from core.atomic import atomic_write_text, write_json_atomic
from evals.compare import HEADLINE, SuiteComparison
from reports.render import fmt_p, md_escape

ALPHA = 0.05


def _pct(x: float) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}"


def rows(comparisons: Sequence[SuiteComparison], all_metrics: bool = False) -> list[dict]:
    out = []
    for c in comparisons:
        by = {m.metric: m.test for m in c.metrics}
        groups = [HEADLINE[c.suite]]
        if all_metrics and c.suite == "ifeval":
            groups.append(("prompt loose", "instruction loose"))
        for names in groups:
            tests = [by[n] for n in names]
            best = min(tests, key=lambda t: t.p_value)
            out.append({"suite": f"{c.title}, {' / '.join(n.replace('pass@1 ', '') for n in names)}",
                        "a": " / ".join(_pct(t.score_a) for t in tests),
                        "b": " / ".join(_pct(t.score_b) for t in tests),
                        "p": " / ".join(fmt_p(t.p_value) for t in tests),
                        "min_p": best.p_value})
    return out


def verdict(comparisons: Sequence[SuiteComparison], label_b: str, label_a: str, alpha: float = ALPHA) -> str:
    if not comparisons:
        return "no suites compared"
    tests = [(c, m) for c in comparisons for m in c.metrics if m.metric in HEADLINE[c.suite]]
    c, m = min(tests, key=lambda cm: cm[1].test.p_value)
    where = f"{c.title.split(' (')[0]} {m.metric.replace('pass@1 ', '')}, {fmt_p(m.test.p_value)}"
    sig = [(c, m) for c, m in tests if m.test.p_value < alpha]
    if not sig:
        return f"No suite differs significantly between {label_b} and {label_a} (smallest paired p: {where})."
    names = ", ".join(f"{c.title.split(' (')[0]} {m.metric.replace('pass@1 ', '')} "
                      f"({_pct(m.test.score_b)} vs {_pct(m.test.score_a)}, p {fmt_p(m.test.p_value)})" for c, m in sig)
    return f"{label_b} differs significantly from {label_a} (exact McNemar, p < {alpha}): {names}."


def render_markdown(comparisons: Sequence[SuiteComparison], label_a: str, label_b: str,
                    all_metrics: bool = True) -> str:
    lines = [f"| suite | {md_escape(label_b)} | {md_escape(label_a)} | paired p (exact McNemar) |",
             "|---|---|---|---|"]
    for r in rows(comparisons, all_metrics):
        lines.append(f"| {r['suite']} | {r['b']} | {r['a']} | {r['p']} |")
    lines += ["", verdict(comparisons, label_b, label_a)]
    return "\n".join(lines) + "\n"


def write_eval_report(comparisons: Sequence[SuiteComparison], label_a: str, label_b: str,
                      out_dir: str | os.PathLike) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "evals-compare.json", {"a": label_a, "b": label_b, "alpha": ALPHA,
                                                   "suites": [c.as_dict() for c in comparisons],
                                                   "verdict": verdict(comparisons, label_b, label_a)})
    md = out / "evals-compare.md"
    atomic_write_text(md, render_markdown(comparisons, label_a, label_b))
    return md
