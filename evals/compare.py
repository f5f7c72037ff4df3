"""Paired comparison of two eval records of one suite: same data, same problems, per-metric exact McNemar."""

from __future__ import annotations

from dataclasses import dataclass

from evals.records import CODE_SUITES, EvalRecord, EvalRecordError
from evals.stats import McNemar, mcnemar_exact

# the metrics a card shows per suite and a gate judges (the others are in the JSON)
HEADLINE = {"humaneval": ("pass@1 base",), "humaneval+": ("pass@1 base", "pass@1 plus"),
            "mbpp+": ("pass@1 base", "pass@1 plus"), "ifeval": ("prompt strict", "instruction strict")}
SUITE_TITLES = {"humaneval": "HumanEval", "humaneval+": "HumanEval+", "mbpp+": "MBPP+", "ifeval": "IFEval"}


@dataclass(frozen=True)
class MetricComparison:
    metric: str
    test: McNemar


@dataclass(frozen=True)
class SuiteComparison:
    suite: str
    n_problems: int
    label_a: str
    label_b: str
    metrics: tuple[MetricComparison, ...]

    @property
    def title(self) -> str:
        return f"{SUITE_TITLES[self.suite]} ({self.n_problems})"

    def smallest_p(self) -> MetricComparison:
        return min(self.metrics, key=lambda m: m.test.p_value)

    def as_dict(self) -> dict:
        return {"suite": self.suite, "n_problems": self.n_problems, "a": self.label_a, "b": self.label_b,
                "metrics": {m.metric: m.test.as_dict() for m in self.metrics}}


def outcomes(rec: EvalRecord, metric: str) -> tuple[list[str], list[bool]]:
    """Item keys and binary outcomes of one metric: problems, or (prompt, instruction index) pairs."""
    keys, vals = [], []
    for r in rec.problems:
        if metric in ("pass@1 base", "pass@1 plus"):
            keys.append(r.id)
            vals.append(bool(r.base if metric == "pass@1 base" else r.plus))
        elif metric.startswith("prompt "):
            keys.append(r.id)
            vals.append(all(r.strict if metric.endswith("strict") else r.loose))
        else:
            xs = r.strict if metric.endswith("strict") else r.loose
            keys += [f"{r.id}#{i}" for i in range(len(xs))]
            vals += [bool(x) for x in xs]
    return keys, vals


def common_problems(a: EvalRecord, b: EvalRecord) -> tuple[EvalRecord, EvalRecord]:
    """Both records restricted to the problems both hold, in A's order (for runs that did not finish;
    the caller says how many were paired)."""
    both = {r.id for r in a.problems} & {r.id for r in b.problems}
    keep_b = {r.id: r for r in b.problems}
    return (EvalRecord(a.suite, a.provenance, [r for r in a.problems if r.id in both]),
            EvalRecord(b.suite, b.provenance, [keep_b[r.id] for r in a.problems if r.id in both]))


def compare_records(a: EvalRecord, b: EvalRecord, label_a: str = "A", label_b: str = "B") -> SuiteComparison:
    if a.suite != b.suite:
        raise EvalRecordError(f"cannot pair suite {a.suite!r} ({label_a}) with {b.suite!r} ({label_b})")
    if a.provenance.panel_hash != b.provenance.panel_hash:
        raise EvalRecordError(f"{a.suite}: {label_a} and {label_b} ran on different data "
                              f"({a.provenance.panel_hash} vs {b.provenance.panel_hash})")
    ids_a, ids_b = [r.id for r in a.problems], [r.id for r in b.problems]
    if ids_a != ids_b:
        only_a = sorted(set(ids_a) - set(ids_b))[:3]
        only_b = sorted(set(ids_b) - set(ids_a))[:3]
        raise EvalRecordError(f"{a.suite}: {label_a} and {label_b} answered different problems (only {label_a}: "
                              f"{only_a}, only {label_b}: {only_b}); pair runs of the same problems")
    names = ["pass@1 base"] + (["pass@1 plus"] if a.suite != "humaneval" else []) if a.suite in CODE_SUITES else \
        ["prompt strict", "instruction strict", "prompt loose", "instruction loose"]
    metrics = []
    for m in names:
        ka, va = outcomes(a, m)
        kb, vb = outcomes(b, m)
        if ka != kb:
            raise EvalRecordError(f"{a.suite}: {m}: the two records hold different instruction lists")
        metrics.append(MetricComparison(m, mcnemar_exact(va, vb)))
    return SuiteComparison(a.suite, len(ids_a), label_a, label_b, tuple(metrics))
