"""Task evals end to end on the real engine (SmolLM2-135M on vLLM CPU fp32, the session's engine_endpoint):
HumanEval and IFEval subsets and the EvalPlus path (tests/data/evals/tinyplus.jsonl), then the can-fail
check: the same engine with generations truncated by a request option (max_tokens) scores measurably
lower and the paired test (exact McNemar) says so; the gate's verdict fails it. Reruns resume.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest


from evals.compare import compare_records
from evals.run import Settings, run_suites
from gates.lib.evals import eval_gate

pytestmark = pytest.mark.engine

TINY = Path(__file__).resolve().parent.parent / "data" / "evals" / "tinyplus.jsonl"
SUITES = ["humaneval+", "humaneval", "ifeval"]
LIMITS = {"humaneval+": None, "humaneval": 2, "ifeval": 8}
FULL = 128          # tokens: the tiny solutions (45-88 tokens measured) end well before this
TRUNCATED = 12      # the defect: replies cut after 12 tokens


def _run(endpoint, out: Path, max_tokens: int):
    recs = {}
    for suite in SUITES:
        settings = Settings(max_tokens=max_tokens, concurrency=8, limit=LIMITS[suite])
        recs.update(run_suites(endpoint, [suite], out, settings, data={"humaneval+": TINY}, progress=False,
                               expect_count=8 if suite == "humaneval+" else None))
    return recs


@pytest.fixture(scope="module")
def runs(engine_endpoint, tmp_path_factory):
    base = tmp_path_factory.mktemp("evals")
    t0 = time.perf_counter()
    full = _run(engine_endpoint, base / "full", FULL)
    t_full = time.perf_counter() - t0
    cut = _run(engine_endpoint, base / "truncated", TRUNCATED)
    return base, full, cut, t_full


def test_subsets_end_to_end_with_provenance(runs, engine_endpoint):
    base, full, _, _ = runs
    assert {s: len(r.problems) for s, r in full.items()} == {"humaneval+": 8, "humaneval": 2, "ifeval": 8}
    for suite, rec in full.items():
        prov = rec.provenance
        assert prov.side == "engine" and prov.source["profile"] == engine_endpoint.profile
        assert prov.panel_hash.startswith("sha256:") and prov.tokenizer_hash.startswith("sha256:")
        assert prov.extra["max_tokens"] == FULL and prov.extra["chat_format"] == "hf-jinja"
        assert (base / "full" / f"{suite.replace('+', 'plus')}.eval.json").is_file()
    # the model writes real replies: most tiny problems are solved, and the plus inputs are exercised
    tiny = full["humaneval+"]
    assert sum(r.base for r in tiny.problems) >= 6, [(r.id, r.detail) for r in tiny.problems]
    assert any(r.n_tokens > 20 for r in full["ifeval"].problems)


def test_truncated_generations_score_lower_and_the_paired_test_says_so(runs):
    _, full, cut, _ = runs
    comps = [compare_records(full[s], cut[s], "full", "truncated") for s in SUITES]
    by = {c.suite: {m.metric: m.test for m in c.metrics} for c in comps}
    code = by["humaneval+"]["pass@1 base"]
    assert code.score_b < code.score_a and code.p_value < 0.05, code
    gate = eval_gate(comps, 0.05)
    assert not gate.passed and any("HumanEval+" in f for f in gate.failures)
    # the control: the full run against itself is no difference at all
    same = eval_gate([compare_records(full[s], full[s], "full", "full") for s in SUITES], 0.05)
    assert same.passed


def test_a_rerun_resumes_instead_of_generating_again(runs, engine_endpoint):
    base, full, _, t_full = runs
    t0 = time.perf_counter()
    again = run_suites(engine_endpoint, ["humaneval"], base / "full",
                       Settings(max_tokens=FULL, concurrency=8, limit=LIMITS["humaneval"]), progress=False)
    assert [r.base for r in again["humaneval"].problems] == [r.base for r in full["humaneval"].problems]
    assert again["humaneval"].provenance.extra["generation_wall_s"] < 2.0
    # a larger limit extends the same run: only the new problems are generated
    lines = (base / "full" / "humaneval.generations.jsonl").read_text().splitlines()
    assert len(lines) == 1 + LIMITS["humaneval"]
