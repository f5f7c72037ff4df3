"""The nightly runner (nightly/runner.py, nightly/history.py, nightly/trends.py, `ds41gate nightly`).

Fast tests use a fake runner or the stand-in gate suite tests/data/nightly/fake_gate.py (real pytest
subprocesses through the real plugin, no engine). The engine test at the end runs the whole flow on vLLM CPU.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from typer.testing import CliRunner

from core.results import GateOutcome
from core.results_folder import PerPrompt, PromptMeans
from nightly import history as H
from nightly import runner as N

REPO = Path(__file__).resolve().parents[2]
FAKE_GATE = "tests/data/nightly/fake_gate.py"


def _cfg(tmp_path: Path, mode: str = "green", extra: str = "") -> Path:
    p = tmp_path / f"nightly-{mode}.toml"
    p.write_text(f"""
[nightly]
name = "unit"
gates = ["{FAKE_GATE}"]
cell_timeout_s = 300
[[cells]]
name = "fake"
profile = "vllm-cpu-fp32"
env = {{ DS41_FAKE_GATE_MODE = "{mode}" }}
{extra}
""")
    return p


# ------------------------------------------------------------------------------------------ config

def test_config_matrix_and_cells(tmp_path):
    (tmp_path / "inj.toml").write_text("")
    cfg = N.parse_config({
        "nightly": {"name": "n", "registry": ["nightly/flags-vllm-cpu.toml"], "regression": {"alpha": 0.01}},
        "matrix": {"profiles": ["vllm-cpu-fp32", "vllm-cpu-bf16"], "flag_sets": [[], ["no_prefix_cache"]]},
        "cells": [{"name": "inj", "profile": "inj.toml", "flags": ["a"], "gates": ["gates/test_kl_panel.py"]}],
    }, "n.toml", tmp_path)
    assert [c.name for c in cfg.cells] == ["vllm-cpu-fp32", "vllm-cpu-fp32+no_prefix_cache", "vllm-cpu-bf16",
                                           "vllm-cpu-bf16+no_prefix_cache", "inj"]
    assert cfg.cells[-1].profile == str((tmp_path / "inj.toml").resolve()) and cfg.rule.alpha == 0.01
    argv = N.cell_argv(cfg, cfg.cells[1], tmp_path / "c")
    assert argv[argv.index("--engine-profile") + 1] == "vllm-cpu-fp32"
    assert argv[argv.index("--flag") + 1] == "no_prefix_cache" and "--per-prompt-metrics" in argv
    assert argv[argv.index("--flag-registry") + 1] == str(REPO / "nightly/flags-vllm-cpu.toml")
    assert argv[3:5] == list(N.DEFAULT_GATES)
    assert N.cell_argv(cfg, cfg.cells[-1], tmp_path)[3] == "gates/test_kl_panel.py"


@pytest.mark.parametrize("data,match", [
    ({}, "no cells"),
    ({"matrix": {"profiles": ["a"]}, "cells": [{"name": "a", "profile": "a"}]}, "duplicate"),
    ({"cells": [{"name": "x"}]}, "'profile'"),
    ({"nightly": {"gates": "gates/x.py"}, "matrix": {"profiles": ["a"]}}, "list of strings"),
    ({"nightly": {"regression": {"alpha": 3}}, "matrix": {"profiles": ["a"]}}, "alpha"),
    ({"matrix": {"profiles": ["a"]}, "extra": 1}, "unknown top-level"),
])
def test_config_errors(data, match):
    with pytest.raises(N.NightlyConfigError, match=match):
        N.parse_config(data, "bad.toml", Path("."))


# ------------------------------------------------------------------------------------------ comparison

def _cell(gates, metrics=(), exit_=None):
    outs = [GateOutcome(g, g, o, "call") for g, o in gates.items()]
    code = exit_ if exit_ is not None else (1 if any(H.failed(g) for g in outs) else 0)
    return H.CellRecord("c", "p", (), code, 1.0, "/tmp", outs, list(metrics))


def test_compare_cell_gate_flips_and_metrics():
    base = _cell({"g1": "passed", "g2": "passed", "g3": "failed", "g4": "passed"},
                 [H.Metric("kl", 0.1, tuple([0.1] * 12))])
    cur = _cell({"g1": "failed", "g2": "passed", "g3": "passed", "g5": "error"},
                [H.Metric("kl", 0.5, tuple(0.5 + 0.01 * i for i in range(12)))])
    kinds = {(f.kind, f.name) for f in N.compare_cell(base, cur, N.RegressionRule(), 4)}
    # g4 passed in the baseline and did not run now: a regression like any other way of not passing (issue 35)
    assert kinds == {("regression", "g1"), ("fixed", "g3"), ("new-failure", "g5"), ("regression", "g4"),
                     ("regression", "kl")}
    assert N.exit_code(N.compare_cell(base, cur, N.RegressionRule())) == N.EXIT_REGRESSION
    # noise-level metric changes and improvements are not regressions
    noisy = _cell({"g1": "passed"}, [H.Metric("kl", 0.1, tuple(0.1 + (0.001 if i % 2 else -0.001) for i in range(12)))])
    assert N.compare_cell(base, noisy, N.RegressionRule()) == [
        N.Finding("regression", "c", g, "passed in baseline, not run now") for g in ("g2", "g4")]
    better = _cell({"g1": "passed", "g2": "passed", "g4": "passed"}, [H.Metric("kl", 0.01, tuple([0.01] * 12))])
    assert N.compare_cell(base, better, N.RegressionRule()) == []
    # no baseline: failures are new failures (exit 2), never regressions
    assert N.exit_code(N.compare_cell(None, cur, N.RegressionRule())) == N.EXIT_FAILURES
    with_none = _cell({}, [H.Metric("kl", 0.1, (None,) + tuple([0.1] * 11))])
    assert N.compare_cell(base, with_none, N.RegressionRule()) == [
        N.Finding("regression", "c", g, "passed in baseline, not run now") for g in ("g1", "g2", "g4")]
    short = _cell({}, [H.Metric("kl", 0.1, (0.1,))])
    assert [f.kind for f in N.compare_cell(base, short, N.RegressionRule()) if f.name == "kl"] == ["error"]


def test_cell_metrics_from_results():
    from core.results import FlagGateVerdict, GateEntry, GateResults, headline

    results = (GateResults()
               .with_gate(GateEntry("kl_panel", True, metrics=headline({"kl_part_mean": 1e-6, "ppl_ratio": None})))
               .with_flag_verdict("f", "numerics", "", "p", FlagGateVerdict("speed", True, "ok", ratio=0.9))
               .with_flag_verdict("f", "numerics", "", "p", FlagGateVerdict("paired_not_worse", True, "ok",
                                                                            mean_diff=1e-9, max_abs_diff=0.5)))
    ms = N.cell_metrics(results, PerPrompt(("a", "b", "c"), ("d",) * 3, {"p": PromptMeans((1e-6, None, 3e-6), 0)}))
    by = {m.name: m for m in ms}
    assert by["kl_panel.kl_part_mean"].value == 1e-6 and "kl_panel.ppl_ratio" not in by   # not measured: no number
    assert by["flag_ab.f.speed.ratio"].value == 0.9 and "flag_ab.f.speed.mean_diff" not in by
    assert by["flag_ab.f.paired_not_worse.mean_diff"].value == 1e-9
    assert by["flag_ab.f.paired_not_worse.max_abs_diff"].value == 0.5
    assert N.cell_metrics(None, None) == []          # a cell whose pytest wrote no results.json
    assert by["kl_part_prompt_mean[p]"].value == pytest.approx(2e-6) and by["kl_part_prompt_mean[p]"].per_prompt[1] is None


# results.json of `pytest -m gate --results DIR` on the embedded default (SmolLM2 on vllm-cpu-fp32: 35 passed,
# 2 xfailed, 8 flag A/B items deselected), kept as written: the contract's sample from the writing side
REAL_RESULTS = REPO / "tests" / "data" / "nightly" / "results-vllm-cpu-fp32.json"


def test_the_nightly_reads_the_results_a_real_gate_run_wrote(tmp_path):
    from core.results import GateResults

    results = GateResults.load(REAL_RESULTS)
    by = {m.name: m.value for m in N.cell_metrics(results, None)}
    assert by["kl_panel.positions"] == 3968 and 0 <= by["kl_panel.kl_part_mean"] < 1e-6
    assert by["kl_panel.top1"] == 1.0
    assert H.flag_verdicts_from_results(results, "cpu") == []          # no --flag in that run
    assert len(results.outcomes) == 37 and not results.errored()
    assert {o.outcome for o in results.outcomes} == {"passed", "xfailed"}
    # through the cell collector, as the nightly reads a cell's folder: the outcomes are results.json's, every one,
    # with their wall times; no junit.xml is there and none is needed
    (tmp_path / "results.json").write_bytes(REAL_RESULTS.read_bytes())
    cell = N.collect_cell(N.Cell("cpu", "vllm-cpu-fp32"), tmp_path, 0, 1.0)
    assert {m.name for m in cell.metrics} >= {"kl_panel.kl_part_mean", "kl_panel.ppl_ratio"}
    assert cell.gates == list(results.outcomes) and cell.green
    assert cell.durations == dict(results.timings.per_test_s) and len(cell.durations) == 37
    # a junit.xml that says otherwise is not read: it cannot tell an xfail from a skip
    (tmp_path / "junit.xml").write_text('<testsuites><testsuite><testcase classname="gates.test_kl_panel" '
                                        'name="test_kl_panel_per_domain"><failure message="no"/></testcase>'
                                        '</testsuite></testsuites>')
    assert N.collect_cell(N.Cell("cpu", "vllm-cpu-fp32"), tmp_path, 0, 1.0).gates == list(results.outcomes)
    # a results.json of the untyped era is an error naming the file, not an empty cell, and not the end of the night
    (tmp_path / "results.json").write_text(json.dumps({"kl_panel": {"passed": True, "summary": {}}}))
    old = N.collect_cell(N.Cell("cpu", "vllm-cpu-fp32"), tmp_path, 0, 1.0)
    assert not old.green and [(g.nodeid, g.outcome) for g in old.gates] == [(N.CELL_RAN, "error")]
    assert "results.json: not a ds41-results/1 results file: no format tag" in old.gates[0].detail
    [finding] = N.compare_cell(None, old, N.RegressionRule())
    assert finding.kind == "error" and "no format tag" in finding.detail


@pytest.mark.parametrize("exit_code", [0, 1, 2])
def test_a_cell_without_results_or_with_unreadable_per_prompt_is_an_error(tmp_path, exit_code):
    """pytest wrote no results.json (it crashed before any gate, or never started): ERROR, never green, whatever
    its exit code; an unreadable per_prompt.json likewise (its metrics would silently be missing)."""
    bare = N.collect_cell(N.Cell("cpu", "vllm-cpu-fp32"), tmp_path, exit_code, 3.0)
    [gate] = bare.gates
    assert (gate.nodeid, gate.outcome) == (N.CELL_RAN, "error") and not bare.green
    assert str(tmp_path / "results.json") in gate.detail and "no such results file" in gate.detail
    assert ("pytest exited 2" in gate.detail) == (exit_code == 2) and bare.durations[N.CELL_RAN] == 3.0
    (tmp_path / "results.json").write_bytes(REAL_RESULTS.read_bytes())
    (tmp_path / "per_prompt.json").write_text(json.dumps({"format": "ds41-per-prompt/1", "seq_ids": ["a"]}))
    broken = N.collect_cell(N.Cell("cpu", "vllm-cpu-fp32"), tmp_path, 0, 1.0)
    assert not broken.green and broken.gates[-1].nodeid == N.CELL_RAN
    assert "per_prompt.json: not a ds41-per-prompt/1 file" in broken.gates[-1].detail


def test_floors_below_nightly_never_import_it():
    import ast

    offenders = []
    for floor in ("core", "panels", "oracle", "engine", "reports"):
        for path in sorted((REPO / floor).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                offenders += [f"{path.relative_to(REPO)}: {n}" for n in names if n.split(".")[0] in ("nightly", "gates")]
    assert not offenders


# ------------------------------------------------------------------------------------------ history

def test_history_roundtrip_and_baseline(tmp_path):
    db = tmp_path / "h.sqlite"
    green = _cell({"g": "passed"}, [H.Metric("kl", 0.1, (0.1, 0.2))])
    green.flag_verdicts = [H.FlagVerdict("f", "exact", "bitwise_panel", True, "same")]
    red = _cell({"g": "failed"})
    red.flag_verdicts = [H.FlagVerdict("f", "exact", "bitwise_panel", False, "differ")]
    kw = dict(started="s", finished="f", config_name="n", config_path="p", config_hash="h", git_commit="c",
              host="h", exit_code=0, out_dir="o")
    r1 = H.insert_run(db, status="green", cells=[green], **kw)
    r2 = H.insert_run(db, status="red", cells=[red], **kw)
    assert H.last_green_cell(db, "c")[0] == r1 and H.last_green_cell(db, "c", before_run=r1) is None
    back = H.load_cell(db, r1, "c")
    assert back.gates == green.gates and back.metrics == green.metrics and back.green
    assert [r.status for r in H.runs(db)] == ["red", "green"]
    assert H.latest_flag_verdicts(db)["f"]["run_id"] == r2 and not H.latest_flag_verdicts(db)["f"]["passed"]
    assert H.gate_series(db) == [(r1, "green", 1, 0), (r2, "red", 0, 1)]
    with sqlite3.connect(db) as conn:  # schema constraints hold
        with pytest.raises(sqlite3.IntegrityError):
            conn.execute("INSERT INTO gate_results VALUES(1, 'c', 'x', 'maybe', 0, '', 'x', 'call')")
        with pytest.raises(sqlite3.IntegrityError):
            conn.execute("INSERT INTO gate_results VALUES(1, 'c', 'x', 'passed', 0, '', 'x', 'later')")
        conn.execute("UPDATE meta SET value='99' WHERE key='schema_version'")
    with pytest.raises(H.HistoryError, match="schema version 99"):
        H.connect(db)


def test_a_version_2_history_gains_the_outcomes_node_id_and_phase(tmp_path):
    """A history written before rows kept the typed outcome's node id and phase (schema 2) opens as schema 3: its
    rows read back keyed as before (the baseline still compares), the new rows hold the node id and the phase."""
    db = tmp_path / "v2.sqlite"
    v2 = H.SCHEMA.replace(",\n    nodeid TEXT, phase TEXT CHECK(phase IN ('setup', 'call', 'teardown')), PRIMARY KEY",
                          ", PRIMARY KEY")
    assert "nodeid" not in v2
    with sqlite3.connect(db) as conn:
        conn.executescript(v2)
        conn.execute("INSERT INTO meta VALUES('schema_version', '2')")
        conn.execute("INSERT INTO runs VALUES(1, 's', 'f', 'n', 'p', 'h', 'c', 'host', 'green', 0, 'o')")
        conn.execute("INSERT INTO cells VALUES(1, 'c', 'p', '[]', 0, 1.0, 'green', 'r')")
        conn.execute("INSERT INTO gate_results VALUES(1, 'c', 'gates.test_kl_panel::test_kl_panel_per_domain', "
                     "'passed', 2.5, '')")
    conn.close()
    (gate,) = H.load_cell(db, 1, "c").gates
    assert H.history_id(gate.nodeid) == "gates.test_kl_panel::test_kl_panel_per_domain" and gate.outcome == "passed"
    now = H.CellRecord("c", "p", (), 1, 1.0, "r", [GateOutcome("gates/test_kl_panel.py::test_kl_panel_per_domain",
                                                               "test_kl_panel_per_domain", "failed", "call", "worse")],
                       durations={"gates/test_kl_panel.py::test_kl_panel_per_domain": 3.0})
    kw = dict(started="s", finished="f", config_name="n", config_path="p", config_hash="h", git_commit="c",
              host="h", exit_code=1, out_dir="o", status="red")
    run = H.insert_run(db, cells=[now], **kw)
    back = H.load_cell(db, run, "c")
    assert back.gates == now.gates and back.durations == now.durations
    [finding] = N.compare_cell(H.load_cell(db, 1, "c"), now, N.RegressionRule(), 1)
    assert (finding.kind, finding.name) == ("regression", "gates.test_kl_panel::test_kl_panel_per_domain")
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() == ("3",)
    conn.close()


# ------------------------------------------------------------------------------------------ whole runs

def test_nightly_fake_runner_infra_error(tmp_path):
    cfg = N.load_config(_cfg(tmp_path))
    res = N.run_nightly(cfg, tmp_path / "h.sqlite", tmp_path / "runs", runner=lambda *a: 4, echo=lambda s: None)
    assert res.exit_code == N.EXIT_FAILURES and res.status == "red"
    assert [f.kind for f in res.findings] == ["error"] and "pytest exited 4" in res.findings[0].detail
    assert json.loads((res.out_dir / "nightly.json").read_text())["status"] == "red"


def test_nightly_end_to_end_fake_gates(tmp_path):
    """Real pytest subprocesses through the real plugin: green baseline, then an injected regression."""
    db, out = tmp_path / "h.sqlite", tmp_path / "runs"
    runner = CliRunner()
    from ds41gates.cli import app

    first = runner.invoke(app, ["nightly", str(_cfg(tmp_path, "green")), "--db", str(db), "--out", str(out)])
    assert first.exit_code == 0, first.output
    run1 = H.runs(db)[0]
    cell_dir = Path(run1.out_dir) / "fake"
    for name in ("junit.xml", "results.json", "per_prompt.json", "report.html", "pytest.log"):
        assert (cell_dir / name).exists(), name
    pp = json.loads((cell_dir / "per_prompt.json").read_text())
    assert len(pp["engines"]["vllm-cpu-fp32"]["kl_part"]) == 12

    second = runner.invoke(app, ["nightly", str(_cfg(tmp_path, "regress")), "--db", str(db), "--out", str(out)])
    assert second.exit_code == N.EXIT_REGRESSION, second.output
    assert "[regression] fake :: tests.data.nightly.fake_gate::test_fake_exact" in second.output
    assert "[regression] fake :: kl_part_prompt_mean[vllm-cpu-fp32]" in second.output
    run2 = H.runs(db)[0]
    assert run2.status == "regression" and run2.exit_code == 1
    md = (Path(run2.out_dir) / "nightly.md").read_text()
    assert "## Regressions" in md and "test_fake_exact" in md
    pngs = sorted(p.name for p in (Path(run2.out_dir) / "trends").glob("*.png"))
    assert "gates.png" in pngs and any(p.startswith("metric-kl_part_prompt_mean") for p in pngs)
    # the baseline stays the green run: a third regressed run is still compared with run 1
    third = N.run_nightly(N.load_config(_cfg(tmp_path, "regress")), db, out, echo=lambda s: None)
    assert third.baselines["fake"] == run1.id and third.exit_code == N.EXIT_REGRESSION


def test_nightly_cli_dry_run_and_bad_config(tmp_path):
    from ds41gates.cli import app

    runner = CliRunner()
    dry = runner.invoke(app, ["nightly", str(_cfg(tmp_path)), "--dry-run"])
    assert dry.exit_code == 0 and "fake: " in dry.output and FAKE_GATE in dry.output
    bad = tmp_path / "bad.toml"
    bad.write_text("[nightly]\nname = 1\nbogus = 2\n")
    res = runner.invoke(app, ["nightly", str(bad)])
    assert res.exit_code == 2 and "bogus" in res.output


@pytest.mark.parametrize("regression,match", [
    ("margin_rel = inf", "margin_rel must be a number >= 0, got inf"),
    ("margin_rel = nan", "margin_rel must be a number >= 0, got nan"),
    ("floor_abs = -1.0", "floor_abs must be a number >= 0"),
    ("alpha = 1.0", r"alpha must be a number in \(0, 1\)"),
    ("alpha = true", "alpha must be a number"),
    ("n_boot = 2000.5", "n_boot must be an integer >= 100"),
    ("n_boot = 10", "n_boot must be an integer >= 100"),
    ("margins = 0.1", r"unknown \[nightly.regression\] key\(s\) \['margins'\]"),
])
def test_nightly_regression_rule_ranges(tmp_path, regression, match):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[nightly.regression]\n{regression}\n[[cells]]\nprofile = "vllm-cpu-fp32"\n')
    with pytest.raises(N.NightlyConfigError, match=match):
        N.load_config(cfg)


@pytest.mark.parametrize("top,match", [
    ("cell_timeout_s = inf", "cell_timeout_s must be a number > 0"),
    ("cell_timeout_s = 0", "cell_timeout_s must be a number > 0"),
    ('name = ""', "nightly.name must be a non-empty string"),
])
def test_nightly_top_level_ranges(tmp_path, top, match):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[nightly]\n{top}\n[[cells]]\nprofile = "vllm-cpu-fp32"\n')
    with pytest.raises(N.NightlyConfigError, match=match):
        N.load_config(cfg)


def test_shipped_nightly_configs_parse():
    configs = sorted((REPO / "nightly" / "configs").glob("*.toml"))
    assert {p.name for p in configs} >= {"cpu-smoke.toml", "full.toml"}
    for p in configs:
        cfg = N.load_config(p)
        for c in cfg.cells:
            if c.profile.endswith(".toml"):
                assert Path(c.profile).exists(), c.profile


# ------------------------------------------------------------------------------------------ real engine

@pytest.mark.engine
@pytest.mark.long  # 4 vLLM launches (575 s of a 42-min CI run): the nightly job runs it
def test_nightly_on_vllm_cpu_detects_injected_regression(tmp_path):
    """The whole flow on vLLM CPU (4 launches): nightly/configs/cpu-smoke.toml is green (KL panel + the exact flag
    no_prefix_cache bit-identical); then tonight's build (the flag now also switches to bf16) is a
    regression against that green baseline, named, exit 1; `ds41gate flags` shows the flag's new FAIL."""
    from ds41gates.cli import app

    db, out = tmp_path / "history.sqlite", tmp_path / "runs"
    runner = CliRunner()
    green = runner.invoke(app, ["nightly", str(REPO / "nightly/configs/cpu-smoke.toml"), "--db", str(db), "--out", str(out)])
    run1 = H.runs(db)[0]
    cell1 = H.load_cell(db, run1.id, "cpu-fp32")
    assert green.exit_code == 0, green.output + (Path(cell1.results_dir) / "pytest.log").read_text()[-4000:]
    gates1 = {g.gate.split("::")[-1]: g.outcome for g in cell1.gates}
    assert gates1 == {"test_kl_panel_per_domain": "passed", "test_flag_registered[no_prefix_cache]": "passed",
                      "test_bitwise_panel[no_prefix_cache]": "passed",
                      "test_bitwise_greedy[no_prefix_cache]": "passed"}
    metrics1 = {m.name: m for m in cell1.metrics}
    assert metrics1["kl_part_prompt_mean[vllm-cpu-fp32]"].value < 1e-4
    # exact flag: the on-record is bit-identical, hence the same per-prompt KL
    assert (metrics1["kl_part_prompt_mean[vllm-cpu-fp32+no_prefix_cache]"].per_prompt
            == metrics1["kl_part_prompt_mean[vllm-cpu-fp32]"].per_prompt)

    injected = runner.invoke(app, ["nightly", str(REPO / "tests/data/nightly/cpu-injected.toml"), "--db", str(db),
                                   "--out", str(out)])
    assert injected.exit_code == N.EXIT_REGRESSION, injected.output
    assert "[regression] cpu-fp32 :: gates.test_flag_ab::test_bitwise_panel[no_prefix_cache]" in injected.output
    assert "[regression] cpu-fp32 :: gates.test_flag_ab::test_bitwise_greedy[no_prefix_cache]" in injected.output
    assert "[regression] cpu-fp32 :: kl_part_prompt_mean[vllm-cpu-fp32+no_prefix_cache]" in injected.output
    assert "test_kl_panel_per_domain" not in injected.output      # the flag-off engine did not change
    run2 = H.runs(db)[0]
    assert run2.status == "regression" and (Path(run2.out_dir) / "trends" / "gates.png").exists()

    listed = runner.invoke(app, ["flags", "-r", str(REPO / "nightly/flags-vllm-cpu.toml"), "--db", str(db), "--json"])
    verdict = {r["name"]: r["last_verdict"] for r in json.loads(listed.output)}["no_prefix_cache"]
    assert verdict["run_id"] == run2.id and verdict["passed"] is False


# ---------------------------------------------------------------------- cells checked before any engine starts

def _nightly_cli(*args: str) -> tuple["subprocess.CompletedProcess", float]:
    import subprocess
    import sys
    import time

    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "ds41gates.cli", "nightly", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    return proc, time.monotonic() - started


@pytest.mark.parametrize("cell, named", [
    ('profile = "vllm-cpu-no-such-profile"', "vllm-cpu-no-such-profile"),
    ('profile = "vllm-cpu-fp32"\nflags = ["VLLM_DS41_NO_SUCH_FLAG"]', "VLLM_DS41_NO_SUCH_FLAG"),
])
@pytest.mark.parametrize("dry_run", [True, False])
def test_bad_cell_is_a_config_error_before_any_run(tmp_path, cell, named, dry_run):
    from nightly.cli import EXIT_CONFIG

    cfg = tmp_path / "bad.toml"
    cfg.write_text(f'[nightly]\nname = "bad"\ngates = ["{FAKE_GATE}"]\n[[cells]]\nname = "c"\n{cell}\n')
    db, out = tmp_path / "h.sqlite", tmp_path / "runs"
    with pytest.raises(N.NightlyConfigError, match=named):
        N.load_config(cfg)
    proc, elapsed = _nightly_cli(str(cfg), "--db", str(db), "--out", str(out), *(["--dry-run"] if dry_run else []))
    assert proc.returncode == EXIT_CONFIG, proc.stdout + proc.stderr
    assert elapsed < 30
    first = proc.stderr.strip().splitlines()[0]
    assert first.startswith(f"error: {cfg}: cell 'c': ") and named in first
    assert "Traceback" not in proc.stderr
    assert not db.exists() and not out.exists()  # nothing in the history, no run folder


def test_nightly_config_error_is_a_user_error():
    from core.errors import UserError

    assert issubclass(N.NightlyConfigError, UserError)
