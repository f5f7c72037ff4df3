"""Verdict integrity, aggregation side (issue 35): a verdict aggregates only over what ran.

* a flag's verdict is PASS only when every gate its class expects (nightly/flags.toml) ran and passed: a flag
  A/B whose ``bitwise_greedy`` ERRORED (the flag-on engine answered HTTP 500, no verdict recorded) printed
  ``pass`` in ``ds41gate flags --results R`` and ``--db``, and nightly.md's flag table listed only the gate that
  passed;
* the nightly compares tonight's outcome set with the baseline's: a gate that passed last night and is skipped,
  xfailed, errored or missing tonight is a named finding (it was GREEN for skips and xfails); with
  DS41_REQUIRE_ENGINES=1 a skip is a named finding too; outcomes come from the typed results.json (junit
  writes an xfail as a skip);
* "not applicable" is the profile's word, not the engine's: the prefix-cache gate xfailed whenever the engine
  reported prefix caching off;
* the task-eval gate without a baseline is not a PASS; the nightly preflight resolves the ``[gate]`` panel and
  tokenizer names; the report names the bands file its KL verdict used.

The nightly flows here drive the real runner (nightly.runner.run_nightly) with a stand-in cell runner that writes
what a cell's pytest writes (junit.xml, results.json), so no engine is launched.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from core.results import FlagGateVerdict, GateOutcome, GateResults
from nightly import history as H
from nightly import runner as N

REPO = Path(__file__).resolve().parents[2]
CPU_REGISTRY = REPO / "nightly" / "flags-vllm-cpu.toml"
FLAG = "no_prefix_cache"          # class exact in the CPU registry: bitwise_panel + bitwise_greedy
AB = "gates/test_flag_ab.py"


def _flag_run_with_an_errored_gate() -> GateResults:
    """What a flag A/B writes when the flag-on engine answers decode with HTTP 500: bitwise_panel recorded a
    passing verdict, bitwise_greedy's fixture raised (outcome error, no verdict)."""
    return (GateResults()
            .with_flag_verdict(FLAG, "exact", "", "vllm-cpu-fp32",
                               FlagGateVerdict("bitwise_panel", True, "panel: 3968 positions bit-identical"))
            .with_outcome(GateOutcome(f"{AB}::test_flag_registered[{FLAG}]", f"test_flag_registered[{FLAG}]",
                                      "passed", "call"))
            .with_outcome(GateOutcome(f"{AB}::test_bitwise_panel[{FLAG}]", f"test_bitwise_panel[{FLAG}]",
                                      "passed", "call"))
            .with_outcome(GateOutcome(f"{AB}::test_bitwise_greedy[{FLAG}]", f"test_bitwise_greedy[{FLAG}]",
                                      "error", "setup", "EngineError: HTTP 500 from /v1/completions")))


# ============================================================================================ the rule
@pytest.mark.parametrize("states,verdict", [
    ({"a": "passed", "b": "passed"}, "PASS"),
    ({"a": "passed", "b": "failed"}, "FAIL"),
    ({"a": "error", "b": "failed"}, "FAIL"),          # a measured failure stands beside an error
    ({"a": "passed", "b": "error"}, "ERROR"),
    ({"a": "passed", "b": "skipped"}, "ERROR"),
    ({"a": "passed", "b": "xfailed"}, "ERROR"),
    ({"a": "passed", "b": "missing"}, "ERROR"),
    ({"a": "skipped", "b": "missing"}, "NOT EXERCISED"),
    ({"a": "xfailed"}, "NOT EXERCISED"),
    ({}, "NOT EXERCISED"),                             # nothing expected is nothing judged
])
def test_aggregate_is_pass_only_when_every_expected_gate_ran_and_passed(states, verdict):
    from core.results import GateTally, aggregate

    agg = aggregate([GateTally(g, s) for g, s in states.items()])
    assert agg.verdict == verdict and agg.passed == (verdict == "PASS")
    if verdict != "PASS" and states:
        not_passed = {t.gate for t in agg.not_passed()}
        assert not_passed == {g for g, s in states.items() if s != "passed"}
        assert all(g in agg.label() for g in not_passed)     # the label names each gate that did not pass


def test_flag_aggregate_counts_the_registry_gates_and_the_node_outcomes():
    run = _flag_run_with_an_errored_gate()
    agg = run.flag_aggregate(FLAG, ("bitwise_panel", "bitwise_greedy"))
    assert agg.verdict == "ERROR" and not agg.passed
    assert {t.gate: t.state for t in agg.gates} == {"bitwise_panel": "passed", "bitwise_greedy": "error"}
    assert "HTTP 500" in {t.gate: t.why for t in agg.gates}["bitwise_greedy"]
    # the record alone (what the old FlagABResult.passed counted) is not a pass either: a gate is missing
    assert not run.flag(FLAG).passed_all(("bitwise_panel", "bitwise_greedy"))
    # a gate no node and no verdict speak of is missing
    perf = run.flag_aggregate(FLAG, ("bitwise_panel", "bitwise_greedy", "speed"))
    assert {t.gate: t.state for t in perf.gates}["speed"] == "missing"
    # every gate passed: PASS
    done = run.with_flag_verdict(FLAG, "exact", "", "p", FlagGateVerdict("bitwise_greedy", True, "same")).with_outcome(
        GateOutcome(f"{AB}::test_bitwise_greedy[{FLAG}]", f"test_bitwise_greedy[{FLAG}]", "passed", "call"))
    assert done.flag_aggregate(FLAG, ("bitwise_panel", "bitwise_greedy")).passed
    # a flag the run tried but that recorded no verdict at all is still seen (from its nodes)
    bare = GateResults().with_outcome(GateOutcome(f"{AB}::test_bitwise_panel[x]", "test_bitwise_panel[x]", "error",
                                                  "setup", "launch failed"))
    assert bare.flags_seen() == ("x",) and bare.flag_aggregate("x", ("bitwise_panel",)).verdict == "ERROR"


def test_flag_gate_tests_follow_the_node_name_the_aggregation_reads():
    """core.results finds a flag gate's node as test_<gate>[<flag>]: every registry gate has that test."""
    import gates.test_flag_ab as ab_tests
    from nightly.flags import KNOWN_GATES

    for gate in KNOWN_GATES:
        fn = getattr(ab_tests, f"test_{gate}")
        assert fn.ab_gate == gate


# ============================================================================================ forged PASS #1
def test_flags_results_names_an_errored_gate_instead_of_pass(tmp_path):
    from ds41gates.cli import app

    _flag_run_with_an_errored_gate().save(tmp_path / "results.json")
    runner = CliRunner()
    out = runner.invoke(app, ["flags", "-r", str(CPU_REGISTRY), "--results", str(tmp_path), "--json"])
    assert out.exit_code == 0, out.output
    verdict = {r["name"]: r for r in json.loads(out.output)}[FLAG]["last_verdict"]
    assert verdict["passed"] is False and verdict["verdict"] == "ERROR"
    assert verdict["gates"]["bitwise_greedy"]["outcome"] == "error"
    assert verdict["gates"]["bitwise_panel"]["outcome"] == "passed"
    table = runner.invoke(app, ["flags", "-r", str(CPU_REGISTRY), "--results", str(tmp_path), "--class", "exact"])
    row = next(line for line in table.output.splitlines() if FLAG in line)
    assert "ERROR" in row and "bitwise_greedy" in row and "pass" not in row


def _junit(cases: dict[str, str]) -> str:
    """junit XML as pytest writes it for ``cases`` (nodeid -> outcome; an xfail is written as a skip)."""
    body = []
    for nodeid, outcome in cases.items():
        path, name = nodeid.rsplit("::", 1)
        classname = path.removesuffix(".py").replace("/", ".")
        inner = {"passed": "", "failed": '<failure message="assert False"/>', "error": '<error message="boom"/>',
                 "skipped": '<skipped message="skip"/>',
                 "xfailed": '<skipped type="pytest.xfail" message="not applicable"/>'}[outcome]
        body.append(f'<testcase classname="{classname}" name="{name}" time="0.1">{inner}</testcase>')
    return f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{"".join(body)}</testsuite></testsuites>'


def _stand_in(results: GateResults, exit_code: int):
    """A cell runner that writes what the cell's pytest would: junit.xml from the typed outcomes, results.json."""
    def run(argv, env, log, timeout):
        cell_dir = Path(argv[argv.index("--results") + 1])
        results.save(cell_dir / "results.json")
        (cell_dir / "junit.xml").write_text(_junit({o.nodeid: o.outcome for o in results.outcomes}))
        log.write_text("stand-in\n")
        return exit_code
    return run


def _config(tmp_path: Path, flags: tuple[str, ...] = ()) -> N.NightlyConfig:
    p = tmp_path / "n.toml"
    p.write_text(f"""
[nightly]
name = "agg"
gates = ["gates/test_kl_panel.py", "gates/test_flag_ab.py", "gates/test_prefix_cache.py"]
registry = ["{CPU_REGISTRY}"]
[[cells]]
name = "cpu"
profile = "vllm-cpu-fp32"
flags = {json.dumps(list(flags))}
""")
    return N.load_config(p)


def test_flags_db_and_nightly_md_name_an_errored_flag_gate(tmp_path):
    from ds41gates.cli import app

    db = tmp_path / "h.sqlite"
    res = N.run_nightly(_config(tmp_path, (FLAG,)), db, tmp_path / "runs",
                        runner=_stand_in(_flag_run_with_an_errored_gate(), 1), echo=lambda s: None)
    assert res.exit_code != N.EXIT_GREEN
    out = CliRunner().invoke(app, ["flags", "-r", str(CPU_REGISTRY), "--db", str(db), "--json"])
    assert out.exit_code == 0, out.output
    verdict = {r["name"]: r for r in json.loads(out.output)}[FLAG]["last_verdict"]
    assert verdict["passed"] is False and verdict["verdict"] == "ERROR"
    assert verdict["gates"]["bitwise_greedy"]["outcome"] == "error"
    # the history keeps a row per expected gate, with its outcome
    back = H.load_cell(db, res.run_id, "cpu")
    assert {(v.gate, v.outcome) for v in back.flag_verdicts} == {("bitwise_panel", "passed"),
                                                                 ("bitwise_greedy", "error")}
    md = (res.out_dir / "nightly.md").read_text()
    table = md.split("## Flag verdicts", 1)[1]
    assert "bitwise_greedy" in table and "error" in table.lower()
    assert f"| cpu | {FLAG} | exact | **ERROR** |" in table      # the flag's own verdict row
    # the stored flag verdict never reads pass while a gate errored, whatever reads it
    assert H.latest_flag_verdicts(db)[FLAG]["verdict"] == "ERROR"


# ============================================================================================ forged PASS #2
PREFIX = "gates/test_prefix_cache.py::test_prefix_cache"
KL = "gates/test_kl_panel.py::test_kl_panel_per_domain"


def _night(prefix_outcome: str | None) -> GateResults:
    run = GateResults().with_outcome(GateOutcome(KL, "test_kl_panel_per_domain", "passed", "call"))
    if prefix_outcome is not None:
        run = run.with_outcome(GateOutcome(PREFIX, "test_prefix_cache", prefix_outcome, "call",
                                           "Failed: prefix cache gate not applicable on vllm-cpu-fp32"))
    return run


@pytest.mark.parametrize("tonight", ["xfailed", "skipped", "error", None])
def test_a_gate_that_passed_last_night_and_did_not_pass_tonight_is_a_named_red_finding(tmp_path, tonight):
    db, out = tmp_path / "h.sqlite", tmp_path / "runs"
    cfg = _config(tmp_path)
    first = N.run_nightly(cfg, db, out, runner=_stand_in(_night("passed"), 0), echo=lambda s: None)
    assert first.exit_code == N.EXIT_GREEN and first.status == "green"
    second = N.run_nightly(cfg, db, out, runner=_stand_in(_night(tonight), 0), echo=lambda s: None)
    assert second.exit_code != N.EXIT_GREEN and second.status != "green"
    named = [f for f in second.findings if f.name.endswith("test_prefix_cache")]
    assert named and named[0].kind == "regression", second.findings
    assert (tonight or "not run") in named[0].detail and f"run {first.run_id}" in named[0].detail
    assert "test_prefix_cache" in (second.out_dir / "nightly.md").read_text()
    # the red night is no baseline: the next night with the same outcome is compared with the green one
    third = N.run_nightly(cfg, db, out, runner=_stand_in(_night(tonight), 0), echo=lambda s: None)
    assert third.baselines["cpu"] == first.run_id and third.exit_code != N.EXIT_GREEN


def test_the_history_keeps_an_xfail_as_an_xfail(tmp_path):
    """junit writes an xfail as a skip; the outcomes come from the typed results.json."""
    db = tmp_path / "h.sqlite"
    res = N.run_nightly(_config(tmp_path), db, tmp_path / "runs", runner=_stand_in(_night("xfailed"), 0),
                        echo=lambda s: None)
    outcomes = {H.history_id(g.nodeid): g.outcome for g in H.load_cell(db, res.run_id, "cpu").gates}
    assert outcomes["gates.test_prefix_cache::test_prefix_cache"] == "xfailed"


def test_with_require_engines_a_skip_is_a_named_finding(tmp_path, monkeypatch):
    monkeypatch.setenv("DS41_REQUIRE_ENGINES", "1")
    res = N.run_nightly(_config(tmp_path), tmp_path / "h.sqlite", tmp_path / "runs",
                        runner=_stand_in(_night("skipped"), 1), echo=lambda s: None)
    assert res.exit_code != N.EXIT_GREEN
    assert any(f.name.endswith("test_prefix_cache") and f.kind == "skipped" for f in res.findings), res.findings


def test_a_red_cell_always_has_a_named_finding(tmp_path):
    """Every gate passed by its outcomes, yet pytest exited 1 (a hook failed the session): the night is RED and
    a finding says why, never a RED without a name."""
    res = N.run_nightly(_config(tmp_path), tmp_path / "h.sqlite", tmp_path / "runs",
                        runner=_stand_in(_night("passed"), 1), echo=lambda s: None)
    assert res.status == "red" and res.findings and res.findings[0].cell == "cpu"
    assert "pytest exit 1" in res.findings[0].detail


# ============================================================================================ not applicable
def test_prefix_cache_applicability_is_the_profiles_word_not_the_engines():
    from engine.profiles import load_profile
    from gates.lib.prefix import expected_prefix_caching, prefix_cache_applicability

    fp32, dsv4 = load_profile("vllm-cpu-fp32"), load_profile("vllm-cpu-dsv4")
    # the fp32 profile requires caching: an engine that reports it off FAILS, naming the profile (it xfailed)
    mode, why = expected_prefix_caching(fp32, ())
    assert mode == "required"
    verdict = prefix_cache_applicability(mode, why, engine_reports=False)
    assert not verdict.applies and verdict.problem and "vllm-cpu-fp32" in verdict.problem
    assert "enable_prefix_caching=False" in verdict.problem
    assert prefix_cache_applicability(mode, why, engine_reports=True).applies
    # an engine that reports nothing is not taken as "off": it is gated (its cases prove each hit or are INVALID)
    assert prefix_cache_applicability(mode, why, engine_reports=None).applies
    # the profile's own flag that turns caching off: not applicable, said by the profile
    off, why_off = expected_prefix_caching(fp32, ("no_prefix_cache",))
    assert off == "off" and "--no-enable-prefix-caching" in why_off and "no_prefix_cache" in why_off
    na = prefix_cache_applicability(off, why_off, engine_reports=False)
    assert not na.applies and na.problem is None and "no_prefix_cache" in na.reason
    # ... and an engine that caches anyway ignored its launch: a problem, named
    assert prefix_cache_applicability(off, why_off, engine_reports=True).problem
    # DeepSeek-V4 on vLLM CPU: caching is off without AMX, on with it; the profile declares it optional
    ds, why_ds = expected_prefix_caching(dsv4, ())
    assert ds == "optional" and "[gate]" in why_ds
    assert prefix_cache_applicability(ds, why_ds, engine_reports=False).problem is None
    assert not prefix_cache_applicability(ds, why_ds, engine_reports=False).applies
    assert prefix_cache_applicability(ds, why_ds, engine_reports=True).applies    # AMX host: gated


def test_a_profile_declares_prefix_cache_required_or_optional_only(tmp_path):
    from engine.profiles import ProfileError, load_profile

    base = (REPO / "engine" / "profiles" / "vllm-cpu-fp32.toml").read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(base + '\n[gate]\nprefix_cache = "off"\n')
    with pytest.raises(ProfileError, match="prefix_cache 'off'"):
        load_profile(bad)


# ============================================================================================ silent numbers
def test_task_evals_without_a_baseline_are_not_judged_even_at_zero():
    from gates.lib.evals import eval_gate

    gate = eval_gate([], 0.05)
    assert gate.passed is None and "no baseline" in gate.failures[0]


def test_the_nightly_preflight_resolves_the_gate_panel_and_tokenizer_names(tmp_path):
    base = (REPO / "engine" / "profiles" / "vllm-cpu-fp32.toml").read_text()
    for key, value in (("panel", "no-such-panel"), ("tokenizer", "no-such-tokenizer")):
        prof = tmp_path / f"bad-{key}.toml"
        prof.write_text(base + f'\n[gate]\n{key} = "{value}"\n')
        cfg = tmp_path / f"n-{key}.toml"
        cfg.write_text(f'[nightly]\nname = "x"\n[[cells]]\nname = "c"\nprofile = "{prof}"\n')
        with pytest.raises(N.NightlyConfigError) as err:
            N.load_config(cfg)
        message = str(err.value)
        assert str(prof) in message and key in message and value in message


def test_the_report_names_the_bands_file_of_the_kl_verdict(tmp_path):
    import numpy as np

    from core.verdicts import judge
    from ds41gates.pipeline import write_report
    from tests.core.recordkit import pair_of_records

    ref, eng, _ = pair_of_records(np.random.default_rng(3), n_seq=6, length=8, vocab=30, k_ref=30, k_eng=8,
                                  noise=0.05, domains=("a", "b"))
    bands = tmp_path / "loose-bands.toml"
    bands.write_text((REPO / "gates" / "bands.toml").read_text())
    _, gate = judge(ref, eng, "vllm-cpu-fp32", "vllm-cpu-fp32", bands)
    paths = write_report(ref, [("vllm-cpu-fp32", eng)], tmp_path / "out", [gate])
    for report in (paths.markdown, paths.json, paths.html):     # markdown escapes the underscores
        assert str(bands) in Path(report).read_text().replace("\\_", "_"), report
    assert json.loads(paths.json.read_text())["extra"]["KL panel gate verdicts"]["rows"][0]["bands file"] \
        == str(bands)


def test_a_version_1_history_is_migrated_in_place(tmp_path):
    """A history written before outcomes were typed (schema 1: no 'xfailed', no flag outcome column) opens as
    schema 2 with its rows kept; an old flag row reads by its passed column, and the reader's expected gates
    add the ones it never stored as missing."""
    import sqlite3

    db = tmp_path / "old.sqlite"
    v1 = H.SCHEMA.replace(", 'skipped', 'xfailed')),", ", 'skipped')),").replace(
        "    outcome TEXT CHECK(outcome IN ('passed', 'failed', 'error', 'skipped', 'xfailed', 'missing')),\n", "").replace(
        ",\n    nodeid TEXT, phase TEXT CHECK(phase IN ('setup', 'call', 'teardown')), PRIMARY KEY", ", PRIMARY KEY")
    assert "xfailed" not in v1 and "nodeid" not in v1   # schema 3's columns are not version 1's either
    with sqlite3.connect(db) as conn:
        conn.executescript(v1)
        conn.execute("INSERT INTO meta VALUES('schema_version', '1')")
        conn.execute("INSERT INTO runs VALUES(1, 's', 'f', 'n', 'p', 'h', 'c', 'host', 'green', 0, 'o')")
        conn.execute("INSERT INTO cells VALUES(1, 'c', 'p', '[]', 0, 1.0, 'green', 'r')")
        conn.execute("INSERT INTO gate_results VALUES(1, 'c', 'g', 'passed', 0.1, '')")
        conn.execute("INSERT INTO flag_verdicts VALUES(1, 'c', 'f', 'exact', 'bitwise_panel', 1, 'same')")
    conn.close()
    back = H.load_cell(db, 1, "c")
    assert [g.outcome for g in back.gates] == ["passed"] and back.flag_verdicts[0].state == "passed"
    assert H.latest_flag_verdicts(db)["f"]["verdict"] == "PASS"
    assert H.latest_flag_verdicts(db, {"f": ("bitwise_panel", "bitwise_greedy")})["f"]["verdict"] == "ERROR"
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() == (str(H.SCHEMA_VERSION),)
        conn.execute("INSERT INTO gate_results VALUES(1, 'c', 'x', 'xfailed', 0, '', 'x', 'call')")   # an xfail now
    conn.close()


def test_the_session_reports_flag_section_names_every_expected_gate():
    """The gate session's report (section "Flag A/B verdicts", rebuilt at the end of the session) lists each
    flag's verdict and every gate its class expects, the errored one included (it listed only recorded verdicts)."""
    from gates.lib.flag_ab import report_rows

    rows = report_rows(_flag_run_with_an_errored_gate(), {FLAG: ("bitwise_panel", "bitwise_greedy")})
    assert rows[0]["gate"] == "(all expected)" and rows[0]["verdict"] == "ERROR"
    assert {r["gate"]: r["verdict"] for r in rows[1:]} == {"bitwise_panel": "pass", "bitwise_greedy": "error"}
    assert "HTTP 500" in rows[-1]["why"]


REAL_RESULTS = REPO / "tests" / "data" / "nightly" / "results-vllm-cpu-fp32.json"


def test_on_a_real_gate_runs_results_an_xfail_after_a_pass_is_a_named_regression(tmp_path):
    """The results.json a real default gate run wrote (35 passed, 2 xfailed kernels) is a green night; the same
    run with the prefix-cache gate xfailed "not applicable" (what an engine change that turns caching off did) is
    RED, naming the gate."""
    real = GateResults.load(REAL_RESULTS)
    db, out, cfg = tmp_path / "h.sqlite", tmp_path / "runs", _config(tmp_path)
    first = N.run_nightly(cfg, db, out, runner=_stand_in(real, 0), echo=lambda s: None)
    assert first.exit_code == N.EXIT_GREEN, first.findings
    tonight = real.with_outcome(GateOutcome(PREFIX, "test_prefix_cache", "xfailed", "call",
                                            "XFailed: prefix cache gate not applicable on vllm-cpu-fp32"))
    second = N.run_nightly(cfg, db, out, runner=_stand_in(tonight, 0), echo=lambda s: None)
    assert second.exit_code == N.EXIT_REGRESSION and second.status == "regression"
    assert [(f.kind, f.name) for f in second.findings] == [
        ("regression", "gates.test_prefix_cache::test_prefix_cache")]
    assert "xfailed now" in second.findings[0].detail


def test_the_aggregation_reads_the_node_ids_pytest_collects_for_a_flag(tmp_path):
    """What pytest really collects for `--flag no_prefix_cache` (exact: bitwise_panel, bitwise_greedy) is what
    core.results reads a flag gate's outcome from: every such node, errored, makes each expected gate ERROR."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "pytest", "gates/test_flag_ab.py", "-m", "gate", "-p",
                           "no:cacheprovider", "--flag", FLAG, "--flag-registry", str(CPU_REGISTRY), "--collect-only",
                           "-q", "--results", str(tmp_path / "r")], cwd=REPO, capture_output=True, text=True,
                          timeout=300, check=False)
    nodes = [line for line in proc.stdout.splitlines() if line.startswith(AB)]
    assert len(nodes) == 3, proc.stdout + proc.stderr
    run = GateResults()
    for nodeid in nodes:
        run = run.with_outcome(GateOutcome(nodeid, nodeid.split("::")[1], "error", "setup", "engine died"))
    assert run.flags_seen() == (FLAG,)
    agg = run.flag_aggregate(FLAG, ("bitwise_panel", "bitwise_greedy"))
    assert {t.gate: t.state for t in agg.gates} == {"flag_registered": "error", "bitwise_panel": "error",
                                                   "bitwise_greedy": "error"}
    assert agg.verdict == "ERROR"


def test_a_gate_metric_named_like_a_secret_keeps_its_number_in_results_json(tmp_path):
    """Redaction by key (core.redact.redact_data) hides the string under ``HF_TOKEN``, never a gate's count under
    ``PASS``: the prefix-cache and kernel gates' headline numbers stay numbers, and results.json stays readable."""
    from core.redact import REDACTED, redact_data
    from core.results import GateEntry

    run = GateResults().with_gate(GateEntry("prefix_cache", True, metrics={"PASS": 16.0, "FAIL": 0.0},
                                            evidence={"env": {"HF_TOKEN": "hf_abcdefghijklmnop", "PASSES": 2}}))
    run.save(tmp_path / "results.json")
    back = GateResults.load(tmp_path)
    assert back.gate("prefix_cache").metrics == {"PASS": 16.0, "FAIL": 0.0}
    assert back.gate("prefix_cache").evidence["env"]["HF_TOKEN"] == REDACTED
    assert redact_data({"MY_TOKEN": "x-secret-value"}) == {"MY_TOKEN": REDACTED}
