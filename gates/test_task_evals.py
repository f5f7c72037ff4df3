"""Gate: task evals beside KL (docs/EVALS.md) — HumanEval and IFEval subsets generated greedily through
the engine under test, generated code run in the sandbox, IFEval's official checkers.

With ``--eval-baseline DIR`` (the results folder of a known-good run of the same suites and sizes) a suite
whose headline score is lower with exact McNemar p < alpha fails the gate; without it the scores are
measured and reported but not judged: the verdict is None ("no baseline: not judged") and the test xfails with
that reason, never a PASS (a suite scoring 0 is not a pass). Records (with provenance) and the resumable
generations go to <results>/evals/.
"""

import pytest

from core.results import GateEntry, headline
from gates.lib.evals import eval_gate

pytestmark = [pytest.mark.gate, pytest.mark.engine]


def test_task_evals(engine_endpoint, gate_config, gate_run, request):
    from pathlib import Path

    from core.results_folder import eval_record_name
    from evals.compare import compare_records
    from evals.records import EvalRecord
    from evals.run import Settings, run_suites

    cfg = gate_config.evals
    limits = {"humaneval": cfg.humaneval_limit, "ifeval": cfg.ifeval_limit}
    out = gate_run.folder.evals_dir
    recs = {}
    for suite in cfg.suites:
        settings = Settings(max_tokens=cfg.max_tokens, concurrency=cfg.concurrency,
                            limit=limits.get(suite) or None)
        recs.update(run_suites(engine_endpoint, [suite], out, settings, progress=False))
    baseline = request.config.getoption("--eval-baseline")
    comparisons = []
    if baseline:
        for suite, rec in recs.items():
            path = Path(baseline) / eval_record_name(suite)
            if not path.is_file():
                pytest.fail(f"--eval-baseline {baseline}: no {path.name} (run the same suites there first)")
            comparisons.append(compare_records(EvalRecord.load(path), rec, "baseline", engine_endpoint.profile))
    gate = eval_gate(comparisons, cfg.alpha)
    gate_run.add(GateEntry("task_evals", gate.passed, profile=engine_endpoint.profile, failures=gate.failures,
                           metrics={f"{s}.{k}": v for s, r in recs.items() for k, v in headline(r.scores()).items()},
                           evidence={"baseline": baseline, "comparisons": [c.as_dict() for c in comparisons]}))
    gate_run.add_section("Task evals", [{"suite": s, "problems": len(r.problems),
                                         **{k: f"{100 * v:.1f}" for k, v in r.scores().items()}}
                                        for s, r in recs.items()],
                         note="greedy replies through the engine; exact McNemar against --eval-baseline")
    for suite, rec in recs.items():
        assert all(r.n_tokens > 0 for r in rec.problems) or suite == "ifeval", f"{suite}: empty generations"
    if gate.passed is None:
        pytest.xfail("; ".join(gate.failures))
    assert gate.passed, "task evals gate failed:\n" + "\n".join(gate.failures)
