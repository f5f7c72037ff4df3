"""Verdict integrity II (issue 35, part C): the results folder is the run's own, and only the run's own.

* ``--replace-results`` clears only a folder that carries the harness's run marker (written when a run claimed
  it), never one that merely holds a file named ``results.json`` or ``report.json`` (a checkout, ``.git/``);
* it clears nothing before the run's inputs (``--reference``) are checked: a bad input stops the run with the
  earlier run's folder intact;
* a results folder is locked for the run that claimed it: a second session on the same folder — with or
  without ``--replace-results`` — is refused naming the folder and the run that holds it, and the first run's
  files stay exactly its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from core.errors import ResultsDirError
from core.results_folder import RUN_LOCK, RUN_MARKER
from core.results import GateResults
from core.results_folder import ResultsFolder
from tests.core.recordkit import pair_of_records
from tests.reliability.helpers import gate_session_env


def tree(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (relative path → bytes): what must survive a refused claim unchanged."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _claimed_earlier_run(folder: Path) -> dict[str, bytes]:
    """A results folder as an earlier, finished run left it: claimed (its marker), results.json, a report."""
    ResultsFolder.claim(folder).release()
    (folder / "results.json").write_text(json.dumps({"kl_panel": {"passed": True}}))
    (folder / "report.json").write_text("{}")
    return tree(folder)


# ================================================================================ only a marked folder is cleared

@pytest.mark.parametrize("sign", ["results.json", "report.json"])
def test_replace_refuses_a_folder_that_only_holds_a_results_named_file(tmp_path, sign):
    """The issue's case: a checkout (``src/``, ``.git/``) that happens to hold a results.json was emptied."""
    repo = tmp_path / "checkout"
    (repo / "src").mkdir(parents=True)
    (repo / "src" / "model.py").write_text("weights = 'precious'\n")
    (repo / ".git").mkdir()
    (repo / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (repo / sign).write_text("{}")
    before = tree(repo)
    with pytest.raises(ResultsDirError) as exc:
        ResultsFolder.claim(repo, replace=True)
    msg = str(exc.value)
    assert str(repo) in msg and "run marker" in msg and "--replace-results" in msg, msg
    assert tree(repo) == before and sorted(os.listdir(repo)) == sorted([".git", "src", sign])


@pytest.mark.parametrize("marker", ["not json", json.dumps({"format": "something-else/1", "run_id": "x"}),
                                    json.dumps({"format": "ds41-results-dir/1"}), "symlink"])
def test_a_file_merely_named_like_the_marker_marks_nothing(tmp_path, marker):
    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "thesis.tex").write_text("precious")
    if marker == "symlink":
        real = tmp_path / "elsewhere.json"
        real.write_text(json.dumps({"format": "ds41-results-dir/1", "run_id": "abc"}))
        (folder / RUN_MARKER).symlink_to(real)
    else:
        (folder / RUN_MARKER).write_text(marker)
    before = tree(folder)
    with pytest.raises(ResultsDirError, match="no ds41-gates run marker"):
        ResultsFolder.claim(folder, replace=True)
    assert tree(folder) == before


def test_replace_clears_a_folder_an_earlier_run_claimed_and_marks_it_anew(tmp_path):
    folder = tmp_path / "today"
    _claimed_earlier_run(folder)
    old_id = ResultsFolder.of(folder).marker().run_id
    (folder / "evals").mkdir()
    (folder / "evals" / "x.eval.json").write_text("{}")
    try:
        assert ResultsFolder.claim(folder, replace=True).path == folder
        assert sorted(os.listdir(folder)) == [RUN_MARKER, RUN_LOCK]
        marker = ResultsFolder.of(folder).marker()
        assert marker.run_id != old_id and marker.pid == os.getpid() and marker.created
    finally:
        ResultsFolder.of(folder).release()


# ================================================================================ locked for the run

def test_a_claimed_folder_is_locked_until_released(tmp_path):
    folder = tmp_path / "today"
    claimed = ResultsFolder.claim(folder)
    try:
        holder = claimed.marker().run_id
        (folder / "results.json").write_text("{}")
        before = tree(folder)
        for replace in (False, True):     # another run of this process (the plugin's in-process tests)
            with pytest.raises(ResultsDirError) as exc:
                ResultsFolder.claim(folder, replace=replace)
            assert str(folder) in str(exc.value)
        assert tree(folder) == before
        ResultsFolder.of(tmp_path / "nothing-held-here").release()     # a no-op: nothing held there
    finally:
        claimed.release()
    # released: the next run may replace it
    again = ResultsFolder.claim(folder, replace=True)
    again.release()
    assert again.path == folder and holder != again.marker().run_id


# the first session's gate waits (holding the folder) until the test lets it finish
WAITING_GATES = '''
import os, time
from pathlib import Path
import pytest
from core.results import GateEntry
pytestmark = [pytest.mark.gate]

def test_first(gate_run):
    gate_run.add(GateEntry("first", True, metrics={"value": 1}))
    Path(os.environ["STARTED"]).write_text("x")
    deadline = time.monotonic() + 120
    while not Path(os.environ["GO_ON"]).exists() and time.monotonic() < deadline:
        time.sleep(0.05)

def test_second(gate_run):
    gate_run.add(GateEntry("second", True, metrics={"value": 2}))
'''

ERROR_GATES = '''
import pytest
pytestmark = [pytest.mark.gate]

def test_broken(gate_run):
    raise RuntimeError("engine answered HTTP 500")
'''


def _session(work: Path, results: Path, source: str, *extra: str, env: dict[str, str] | None = None,
             background: bool = False):
    work.mkdir(parents=True, exist_ok=True)
    (work / "test_stub_gates.py").write_text(source)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "ds41gates.pytest_plugin", "-p", "no:cacheprovider",
           str(work / "test_stub_gates.py"), "--results", str(results), *extra]
    kw = {"cwd": work, "env": gate_session_env(env), "text": True}
    if background:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kw)
    return subprocess.run(cmd, capture_output=True, timeout=300, **kw)


def test_two_sessions_on_one_folder_the_second_is_refused_and_the_first_keeps_its_run(tmp_path):
    """The issue's case: a second session with --replace-results on the folder of a session still running used
    to clear it and leave its ERROR results.json beside the first session's complete PASS set."""
    results = tmp_path / "results"
    started, go_on = tmp_path / "started", tmp_path / "go-on"
    first = _session(tmp_path / "w1", results, WAITING_GATES, env={"STARTED": str(started), "GO_ON": str(go_on)},
                     background=True)
    try:
        deadline = time.monotonic() + 120
        while not started.exists():
            assert first.poll() is None and time.monotonic() < deadline, first.stdout.read() if first.stdout else ""
            time.sleep(0.05)
        marker = ResultsFolder.of(results).marker()
        holder = marker.run_id
        for extra in ((), ("--replace-results",)):
            second = _session(tmp_path / "w2", results, ERROR_GATES, *extra)
            err = second.stdout + second.stderr
            assert second.returncode == 4, err                  # a usage error: no gate of the second ran
            assert str(results) in err and holder in err and "in use by" in err, err
        assert ResultsFolder.of(results).marker() == marker      # the first run's marker, untouched
    finally:
        go_on.write_text("x")
        out, _ = first.communicate(timeout=120)
    assert first.returncode == 0, out
    got = GateResults.load(results)
    assert [(g.gate, g.metrics) for g in got.gates] == [("first", {"value": 1}), ("second", {"value": 2})]
    assert [o.outcome for o in got.outcomes if o.outcome != "passed"] == []
    # the first session has ended: its lock is gone and the folder can be replaced by the next run
    third = _session(tmp_path / "w3", results, ERROR_GATES, "--replace-results")
    assert third.returncode == 1, third.stdout + third.stderr
    assert [o.outcome for o in GateResults.load(results).outcomes] == ["error"]
    assert not GateResults.load(results).gates


def test_a_bad_reference_stops_the_session_before_replace_clears_anything(tmp_path):
    """The issue's case: the session cleared the folder at configure time, then exited 2 on --reference."""
    results = tmp_path / "results"
    before = _claimed_earlier_run(results)
    proc = _session(tmp_path / "w", results, ERROR_GATES, "--replace-results", "--reference",
                    str(tmp_path / "no-such-reference.safetensors"))
    err = proc.stdout + proc.stderr
    assert proc.returncode == 4 and "--reference" in err and "no-such-reference" in err, err
    assert tree(results) == before

    engine_side = tmp_path / "engine.safetensors"       # readable, but not an oracle record
    _, engine_record, _ = pair_of_records(np.random.default_rng(0), n_seq=2, length=8, noise=0.0)
    engine_record.save(engine_side)
    proc = _session(tmp_path / "w", results, ERROR_GATES, "--replace-results", "--reference", str(engine_side))
    err = proc.stdout + proc.stderr
    assert proc.returncode == 4 and "is an engine record" in err, err
    assert tree(results) == before


def test_the_demo_resolves_its_inputs_before_replace_clears_anything(tmp_path, capsys):
    from ds41gates.cli import main

    folder = tmp_path / "demo"
    before = _claimed_earlier_run(folder)
    code = main(["demo", "--out", str(folder), "--replace-results", "--panel", "no-such-panel"])
    err = capsys.readouterr().err
    assert code == 2 and "no-such-panel" in err, err
    assert tree(folder) == before
