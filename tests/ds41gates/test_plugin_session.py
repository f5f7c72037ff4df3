"""The plugin's shape (one options function, one configure, one session object in config.stash, registered as a
plugin) and what a real pytest session writes through it: a typed `ds41-results/1` results.json with each gate's
entry, outcome (an errored gate is ERROR, never PASS) and wall time."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from core.results import FORMAT_VERSION, GateResults
from tests.reliability.helpers import gate_session_env

REPO = Path(__file__).resolve().parents[2]
PLUGIN = REPO / "ds41gates" / "pytest_plugin.py"

STUB_GATES = '''
import pytest
from core.results import GateEntry
from ds41gates.pytest_plugin import SESSION, GateSession

pytestmark = [pytest.mark.gate]


def test_a_session_object(request, gate_session, gate_run):
    assert isinstance(gate_session, GateSession) and request.config.stash[SESSION] is gate_session
    assert request.config.pluginmanager.get_plugin("ds41-gates-session") is gate_session
    assert gate_run is gate_session.run
    gate_run.add(GateEntry("kl_panel", True, profile="stub", metrics={"kl_part_mean": 1e-6}))
    gate_run.add_section("Stub", [{"row": 1}], "display only")


def test_b_fails(gate_run):
    gate_run.add(GateEntry("needles", False, failures=["needle missed"]))
    assert False, "needle missed"


def test_c_errors(gate_run):
    raise RuntimeError("engine died")
'''


def test_one_options_function_one_configure_and_no_state_on_config():
    tree = ast.parse(PLUGIN.read_text())
    top = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
    assert top.count("pytest_configure") == 1 and top.count("pytest_addoption") == 1
    assert "noqa: F811" not in PLUGIN.read_text()
    # imports only at the top of the module (a function may import a heavy floor lazily, never the module body)
    first_def = next(i for i, n in enumerate(tree.body) if isinstance(n, (ast.FunctionDef, ast.ClassDef)))
    assert not [n for n in tree.body[first_def:] if isinstance(n, (ast.Import, ast.ImportFrom))]
    state_on_config = "config._" + "ds41"          # spelled apart so this file is not a hit of its own grep
    for folder in ("ds41gates", "gates", "tests"):
        hits = [p for p in (REPO / folder).rglob("*.py") if state_on_config in p.read_text(errors="replace")]
        assert hits == [], hits


def test_a_session_writes_typed_results_with_outcomes_and_timings(tmp_path):
    test_file = tmp_path / "test_stub_gates.py"
    test_file.write_text(STUB_GATES)
    results = tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "ds41gates.pytest_plugin", "-p",
                           "no:cacheprovider", str(test_file), "--results", str(results)],
                          cwd=tmp_path, env=gate_session_env(), capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f'"format": "{FORMAT_VERSION}"' in (results / "results.json").read_text()
    got = GateResults.load(results)
    assert [(g.gate, g.passed) for g in got.gates] == [("kl_panel", True), ("needles", False)]
    assert {o.gate: o.outcome for o in got.outcomes} == {"test_a_session_object": "passed", "test_b_fails": "failed",
                                                         "test_c_errors": "error"}
    assert got.outcome(f"{test_file.name}::test_c_errors").detail == "RuntimeError: engine died"
    assert set(got.timings.per_test_s) == {o.nodeid for o in got.outcomes}
    assert [s.title for s in got.sections] == ["Stub"]
    assert "ERRORED gate (neither passed nor failed)" in proc.stdout and "test_c_errors" in proc.stdout
