"""The task-eval gate's verdict and the model-card table, from eval records built here."""

from __future__ import annotations

from core.records import Provenance
from evals.compare import compare_records
from evals.records import EvalRecord, ProblemResult
from gates.lib.evals import eval_gate
from reports.evals import render_markdown


def _he(outcomes):
    prov = Provenance(side="engine", panel_name="humaneval", panel_version="x", panel_hash="sha256:ab",
                      tokenizer_hash="t")
    return EvalRecord("humaneval", prov, [ProblemResult(f"HumanEval/{i}", 5, "stop", base=o)
                                          for i, o in enumerate(outcomes)])


def _if(strict):
    prov = Provenance(side="engine", panel_name="ifeval", panel_version="x", panel_hash="sha256:cd",
                      tokenizer_hash="t")
    return EvalRecord("ifeval", prov, [ProblemResult(f"ifeval/{i}", 5, "stop", strict=s, loose=s)
                                       for i, s in enumerate(strict)])


def test_significantly_worse_fails_and_not_significant_passes():
    base = _he([True] * 8 + [False] * 12)
    worse = _he([False] * 8 + [False] * 12)          # 8 lost: p = 2/256
    slightly = _he([False] * 2 + [True] * 6 + [False] * 12)   # 2 lost: p = 0.5
    g = eval_gate([compare_records(base, worse, "a", "b")], 0.05)
    assert not g.passed and "8 problems lost" in g.failures[0] and "HumanEval (20)" in g.failures[0]
    assert eval_gate([compare_records(base, slightly, "a", "b")], 0.05).passed
    # significantly better is not a failure
    assert eval_gate([compare_records(worse, base, "a", "b")], 0.05).passed


def test_the_table_has_the_card_layout():
    he = compare_records(_he([True] * 8 + [False] * 12), _he([False] * 20), "native", "pack")
    ife = compare_records(_if([(True, True)] * 5 + [(False, True)] * 5), _if([(True, True)] * 5 + [(False, True)] * 5),
                          "native", "pack")
    md = render_markdown([he, ife], "native", "pack")
    lines = md.splitlines()
    assert lines[0] == "| suite | pack | native | paired p (exact McNemar) |"
    assert lines[2] == "| HumanEval (20), base | 0.0 | 40.0 | 0.008 |"
    assert lines[3] == "| IFEval (10), prompt strict / instruction strict | 50.0 / 75.0 | 50.0 / 75.0 | 1.000 / 1.000 |"
    assert "pack differs significantly from native" in md and "HumanEval base (0.0 vs 40.0, p 0.008)" in md
    same = render_markdown([ife], "native", "pack")
    assert "No suite differs significantly between pack and native (smallest paired p: IFEval prompt strict, 1.000)" in same
