"""Verdict integrity (issue 27, part 3): results folders, names that become paths, and the listed tracebacks
and weak messages.

* a results folder holds one run: a reused ``--results`` (plugin) / ``--out`` (demo, pipeline) is refused, or
  cleared first when asked, so an earlier run's PASS report never lies beside this run's ERROR results.json;
* a report set (report.json / .md / .html) is written as one unit: a full disk on the 2nd or 3rd file leaves
  the old complete set and a one-line error, never a mix;
* names that become file names (profile, nightly run and cell, panel, engine label) are checked once;
* ``flags --results`` on a JSON list, ``oracle run`` on a 1-token sequence, ``--out /dev/full``, a profile
  name with ``../``, ``LD_PRELOAD`` / ``PATH`` in a profile's env: a one-line named error (or, for the
  1-token sequence, a record that scores no position of it).
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from core.records import Record
from core.results import GateResults
from core.results_folder import ResultsFolder
from ds41gates import pipeline
from ds41gates.cli import main
from engine.profiles import PROFILES_DIR, ProfileError, load_profile
from tests.core.recordkit import pair_of_records
from tests.reliability.helpers import (
    REPO, Canned, CannedServer, exact_reference, gate_session_env, plain_sequences, serve_vllm,
)

MODEL = "fake-smollm2"
KL_GATE = ("import pytest\npytestmark = [pytest.mark.gate, pytest.mark.engine]\n"
           "from gates.test_kl_panel import test_kl_panel_per_domain  # the real gate\n")
REPORT_FILES = ("report.json", "report.md", "report.html")


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line_error(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


# =========================================================================================== results folders

def _earlier_pass_run(folder: Path) -> dict[str, bytes]:
    """A results folder as an earlier PASS run left it: claimed (its run marker), results.json, an engine record,
    a PASS report set."""
    ref, eng, _ = pair_of_records(np.random.default_rng(0), n_seq=4, length=12, noise=0.0)
    ResultsFolder.claim(folder).release()
    eng.save(folder / "engine-vllm-cpu-fp32.safetensors")
    (folder / "results.json").write_text(json.dumps({"kl_panel": {"passed": True}}))
    pipeline.write_report(ref, [("vllm-cpu-fp32", eng)], folder)
    assert (folder / "report.html").exists()
    return snapshot(folder)


def test_a_results_folder_that_holds_another_run_is_refused(tmp_path):
    folder = tmp_path / "today"
    before = _earlier_pass_run(folder)
    with pytest.raises(Exception) as exc:
        ResultsFolder.claim(folder)
    assert type(exc.value).__name__ == "ResultsDirError"
    assert "not empty" in str(exc.value) and "--replace-results" in str(exc.value)
    assert snapshot(folder) == before          # refused before anything was touched


def test_replace_clears_the_earlier_run_first(tmp_path):
    folder = tmp_path / "today"
    _earlier_pass_run(folder)
    (folder / "evals").mkdir()
    (folder / "evals" / "x.eval.json").write_text("{}")
    out = ResultsFolder.claim(folder, replace=True)
    out.release()
    assert out.path == folder
    left = sorted(p.name for p in folder.iterdir())
    assert left == [".ds41-results", ".ds41-results.lock"], left   # this run's marker and lock: nothing else


def test_replace_never_clears_a_folder_that_is_not_a_results_folder(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("precious")
    with pytest.raises(Exception, match="carries no ds41-gates run marker"):
        ResultsFolder.claim(home, replace=True)
    assert (home / "thesis.tex").read_text() == "precious"


def test_default_results_folders_are_fresh_per_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first, second = ResultsFolder.claim_or_fresh(None), ResultsFolder.claim_or_fresh(None)
    assert first != second and first.path.parent == second.path.parent == Path("results")


def test_demo_refuses_a_reused_out_before_any_work(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "demo"
    before = _earlier_pass_run(folder)

    def no_work(*a, **k):
        raise AssertionError("the demo started work in a folder that holds another run")

    monkeypatch.setattr(pipeline, "default_model_dir", no_work)
    code, _, err = run_cli(capsys, "demo", "--out", str(folder))
    line = one_line_error(err)
    assert code == 2 and "not empty" in line and "--replace-results" in line
    assert snapshot(folder) == before


# ------------------------------------------------------------------------------ the plugin's --results

STUB_GATES = '''
import pytest
from core.results import GateEntry
pytestmark = [pytest.mark.gate]

def test_one(gate_run):
    gate_run.add(GateEntry("first", True, metrics={"value": 1}))

def test_two(gate_run):
    gate_run.add(GateEntry("second", True, metrics={"value": 2}))
'''


def _plugin_session(tmp_path: Path, results: Path, *extra: str, source: str = STUB_GATES):
    test_file = tmp_path / "test_stub_gates.py"
    test_file.write_text(source)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "ds41gates.pytest_plugin", "-p",
                           "no:cacheprovider", str(test_file), "--results", str(results), *extra],
                          cwd=tmp_path, env=gate_session_env(), capture_output=True, text=True, timeout=300)


def test_plugin_refuses_a_reused_results_folder(tmp_path):
    folder = tmp_path / "res"
    before = _earlier_pass_run(folder)
    proc = _plugin_session(tmp_path, folder)
    assert proc.returncode == 4, proc.stdout + proc.stderr          # a usage error, before any gate ran
    assert "folder is not empty" in proc.stderr and "--replace-results" in proc.stderr, proc.stderr
    assert snapshot(folder) == before


def test_plugin_replace_results_keeps_one_run_and_rewrites_results_json_within_it(tmp_path):
    folder = tmp_path / "res"
    _earlier_pass_run(folder)
    proc = _plugin_session(tmp_path, folder, "--replace-results")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in folder.iterdir()) == [".ds41-results", ".ds41-results.lock", "results.json"]
    results = GateResults.load(folder)
    assert [(g.gate, g.metrics) for g in results.gates] == [("first", {"value": 1}), ("second", {"value": 2})]
    assert results.gate("kl_panel") is None                                           # nothing of the earlier run


def _real_session(work: Path, results: Path, reference: Path, url: str, *extra: str, profile: str = "vllm-cpu-fp32"):
    work.mkdir(parents=True, exist_ok=True)
    test_file = work / "test_gate_session.py"
    test_file.write_text(KL_GATE)
    cmd = [sys.executable, "-m", "pytest", "-p", "ds41gates.pytest_plugin", "-p", "no:cacheprovider", "-q", "-rA",
           str(test_file), "--engine-url", url, "--engine-profile", profile, "--reference", str(reference),
           "--results", str(results), *extra]
    return subprocess.run(cmd, cwd=str(REPO), env=gate_session_env(), capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ref") / "reference.safetensors"
    exact_reference(plain_sequences()).save(path)
    return path


def test_reused_results_of_a_real_gate_session_never_show_the_earlier_pass_report(tmp_path, reference):
    """The issue's case: a PASS session, then an ERROR session (HTTP 503) on the same --results."""
    results = tmp_path / "results"
    with CannedServer() as srv:
        serve_vllm(srv, MODEL)
        first = _real_session(tmp_path / "w1", results, reference, srv.url)
        assert first.returncode == 0, first.stdout[-3000:]
        assert (results / "report.html").exists() and (results / "engine-vllm-cpu-fp32.safetensors").exists()
        srv.routes["/v1/completions"] = lambda r: Canned(503, {"error": {"message": "overloaded"}})
        refused = _real_session(tmp_path / "w2", results, reference, srv.url)
        assert refused.returncode == 4 and "folder is not empty" in refused.stderr, refused.stdout[-3000:]
        second = _real_session(tmp_path / "w3", results, reference, srv.url, "--replace-results")
    assert second.returncode == 1, second.stdout[-3000:]
    assert [o.outcome for o in GateResults.load(results).outcomes] == ["error"]
    # nothing of the PASS run is left: no report (this run has no engine record to report), no record
    assert not any((results / name).exists() for name in REPORT_FILES), sorted(os.listdir(results))
    assert not list(results.glob("engine-*.safetensors"))


def test_engine_url_with_a_profile_path_labels_the_record_by_the_profile_name(tmp_path, reference):
    """A profile given as ../…/x.toml: the engine record is named after the profile's checked name, inside
    --results, never after the path."""
    far = tmp_path / "elsewhere" / "deep"
    far.mkdir(parents=True)
    text = (PROFILES_DIR / "vllm-cpu-fp32.toml").read_text().replace('name = "vllm-cpu-fp32"', 'name = "my-copy"')
    (far / "x.toml").write_text(text)
    rel = os.path.relpath(far / "x.toml", REPO)
    assert rel.startswith("..")
    results = tmp_path / "results"
    with CannedServer() as srv:
        serve_vllm(srv, MODEL)
        proc = _real_session(tmp_path / "w", results, reference, srv.url, profile=rel)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert (results / "engine-my-copy.safetensors").exists(), sorted(os.listdir(results))
    assert sorted(p.name for p in far.iterdir()) == ["x.toml"]


# ================================================================================ a report set is one unit

@pytest.fixture
def records(tmp_path) -> tuple[Path, Path, Path]:
    ref, eng_a, _ = pair_of_records(np.random.default_rng(0), n_seq=4, length=12, noise=0.1)
    _, eng_b, _ = pair_of_records(np.random.default_rng(0), n_seq=4, length=12, noise=2.0)
    paths = tmp_path / "ref.safetensors", tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    for rec, p in zip((ref, eng_a, eng_b), paths):
        rec.save(p)
    return paths


def _full_disk_on(monkeypatch, nth: int) -> list[str]:
    """Path.write_bytes (the writer under core.atomic) fills the disk on the nth report file: half written,
    then ENOSPC, as a real full disk does."""
    real = pathlib.Path.write_bytes
    seen: list[str] = []

    def write_bytes(self, data):
        if "report." in self.name:
            seen.append(self.name)
            if len(seen) == nth:
                real(self, data[: len(data) // 2])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, data)

    monkeypatch.setattr(pathlib.Path, "write_bytes", write_bytes)
    return seen


@pytest.mark.parametrize("nth", [2, 3])
def test_full_disk_during_report_leaves_the_old_full_set_and_one_line(tmp_path, capsys, monkeypatch, records, nth):
    ref, a, b = records
    out = tmp_path / "rep"
    code, _, err = run_cli(capsys, "report", str(ref), str(a), "--out", str(out), "--n-boot", "100")
    assert code == 0, err
    old = snapshot(out)
    assert set(REPORT_FILES) <= set(old)
    seen = _full_disk_on(monkeypatch, nth)
    code, _, err = run_cli(capsys, "report", str(ref), str(b), "--out", str(out), "--n-boot", "100")
    monkeypatch.undo()
    assert len(seen) >= nth
    line = one_line_error(err)
    assert code == 2 and "No space left on device" in line and str(out) in line
    assert snapshot(out) == old                       # the old set, whole; no temp file left behind
    assert sorted(p.name for p in out.iterdir()) == sorted(old)
    from reports.render import report_set_problems

    assert report_set_problems(out) == []
    # and without the full disk the new set replaces the old one as a whole
    code, _, err = run_cli(capsys, "report", str(ref), str(b), "--out", str(out), "--n-boot", "100")
    assert code == 0, err
    new = snapshot(out)
    assert all(new[n] != old[n] for n in REPORT_FILES) and report_set_problems(out) == []


def test_a_torn_or_mixed_report_set_is_reported_incomplete(tmp_path, monkeypatch):
    from core.atomic import check_file_set, write_file_set
    from core.errors import OutputWriteError

    folder = tmp_path / "set"
    write_file_set(folder, {"report.json": b"{}", "report.md": b"old", "report.html": b"old"}, "report.manifest.json")
    assert check_file_set(folder, "report.manifest.json") == []
    real, calls = os.replace, []

    def crash_on_second_rename(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(errno.EIO, "I/O error")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_second_rename)
    with pytest.raises(OutputWriteError, match="no complete set now"):
        write_file_set(folder, {"report.json": b"[]", "report.md": b"new", "report.html": b"new"},
                       "report.manifest.json")
    monkeypatch.undo()
    problems = check_file_set(folder, "report.manifest.json")
    assert problems and "missing" in problems[0]
    # a file of another set copied in is caught as well
    write_file_set(folder, {"report.json": b"{}", "report.md": b"a", "report.html": b"a"}, "report.manifest.json")
    (folder / "report.html").write_bytes(b"PASS from another run")
    assert any("report.html" in p for p in check_file_set(folder, "report.manifest.json"))


# =================================================================================== names become paths

def _profile_copy(tmp_path: Path, name: str = "vllm-cpu-fp32", **replace: str) -> Path:
    text = (PROFILES_DIR / "vllm-cpu-fp32.toml").read_text()
    for old, new in replace.items():
        assert old in text
        text = text.replace(old, new)
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("bad", ["../../evil", "a/b", "..", ".hidden", "/etc/x", "x..y", "a b"])
def test_a_profile_name_that_is_not_a_plain_name_is_refused(tmp_path, capsys, bad):
    path = _profile_copy(tmp_path, **{'name = "vllm-cpu-fp32"': f'name = "{bad}"'})
    with pytest.raises(ProfileError, match="not a safe name"):
        load_profile(path)
    code, out, err = run_cli(capsys, "flags", "check", str(path))
    line = one_line_error(err)
    assert code == 2 and "profile name" in line and "not a safe name" in line


def test_core_safe_name_accepts_the_shipped_names_and_refuses_separators():
    from core.errors import UnsafeNameError, UserError
    from core.paths import safe_name

    for ok in ("vllm-cpu-fp32", "vllm-cpu-fp32+no_prefix_cache", "default@1", "llama-server-q4_1", "cpu-smoke"):
        assert safe_name(ok, "x") == ok
    for bad in ("../x", "x/..", "/abs", "a/b", "..", "x..", "-rf", ".x", "a b", "a\0b", "é", 3, "x" * 129):
        with pytest.raises(UnsafeNameError):
            safe_name(bad, "name")
    assert issubclass(UnsafeNameError, UserError)


def _nightly_cfg(tmp_path: Path, name: str = "unit", cell: str = "fake", env: str = "") -> Path:
    p = tmp_path / "nightly.toml"
    p.write_text(f'[nightly]\nname = "{name}"\ngates = ["tests/data/nightly/fake_gate.py"]\n'
                 f'[[cells]]\nname = "{cell}"\nprofile = "vllm-cpu-fp32"\n{env}\n')
    return p


@pytest.mark.parametrize("field", ["name", "cell"])
def test_nightly_run_and_cell_names_cannot_leave_out(tmp_path, capsys, field):
    from nightly import runner as N

    cfg_path = _nightly_cfg(tmp_path, **{field: "../../escaped"})
    out = tmp_path / "a" / "b" / "runs"
    with pytest.raises(N.NightlyConfigError, match="not a safe name"):
        cfg = N.load_config(cfg_path)
        N.run_nightly(cfg, tmp_path / "h.sqlite", out, runner=lambda *a: 4, echo=lambda s: None)
    assert not list(tmp_path.rglob("escaped*"))
    code, _, err = run_cli(capsys, "nightly", str(cfg_path), "--out", str(out), "--db", str(tmp_path / "h.sqlite"))
    line = one_line_error(err)
    assert code == 2 and "not a safe name" in line
    assert not list(tmp_path.rglob("escaped*"))


def test_each_nightly_cell_folder_holds_one_run_with_its_log(tmp_path):
    from nightly import runner as N

    cfg = N.load_config(_nightly_cfg(tmp_path))

    def fake(argv, env, log_path, timeout):
        cell_dir = Path(argv[argv.index("--results") + 1])
        assert list(cell_dir.iterdir()) == []          # empty when the cell's pytest claims it
        log_path.write_text("pytest output\n")
        return 4

    res = N.run_nightly(cfg, tmp_path / "h.sqlite", tmp_path / "runs", runner=fake, echo=lambda s: None)
    cell_dir = res.out_dir / "fake"
    assert (cell_dir / "pytest.log").read_text() == "pytest output\n"
    assert not [p for p in res.out_dir.iterdir() if p.name.endswith(".pytest.log")]


def test_a_panel_name_with_a_separator_never_becomes_a_cache_path():
    from types import SimpleNamespace

    enc = SimpleNamespace(panel_name="../../x", panel_version=1, panel_hash="sha256:" + "a" * 64,
                          tokenizer_hash="sha256:" + "b" * 64)
    with pytest.raises(Exception, match="not a safe name"):
        pipeline.reference_path(enc, "sha256:" + "c" * 64)


# ========================================================================= tracebacks and weak messages

def test_flags_results_on_a_json_list_is_one_line(tmp_path, capsys):
    for doc in ([1, 2], {"flag_ab": [1]}, {"flag_ab": {"F": {"gates": {"g": 3}}}}):
        path = tmp_path / "results.json"
        path.write_text(json.dumps(doc))
        code, _, err = run_cli(capsys, "flags", "--results", str(path))
        line = one_line_error(err)
        assert code == 2 and "not a ds41-results/1 results file" in line and str(path) in line


@pytest.mark.parametrize("argv", [
    ("report", "{ref}", "{a}", "--out", "/dev/full"),
    ("demo", "--out", "/dev/full"),
    ("nightly", "{cfg}", "--out", "/dev/full", "--db", "{db}"),
])
def test_out_that_is_not_a_folder_says_so(tmp_path, capsys, records, monkeypatch, argv):
    ref, a, _ = records
    monkeypatch.setattr(pipeline, "default_model_dir", lambda: (_ for _ in ()).throw(AssertionError("work")))
    args = [x.format(ref=ref, a=a, cfg=_nightly_cfg(tmp_path), db=tmp_path / "h.sqlite") for x in argv]
    code, _, err = run_cli(capsys, *args)
    line = one_line_error(err)
    assert code == 2 and "/dev/full" in line and "is not a folder" in line and "File exists" not in line


def test_report_refuses_to_write_into_a_gate_runs_results_folder(tmp_path, capsys, records):
    ref, a, _ = records
    folder = tmp_path / "res"
    before = _earlier_pass_run(folder)
    code, _, err = run_cli(capsys, "report", str(ref), str(a), "--out", str(folder), "--n-boot", "100")
    line = one_line_error(err)
    assert code == 2 and "results folder of a gate run" in line
    assert snapshot(folder) == before


@pytest.mark.parametrize("var", ["LD_PRELOAD", "LD_LIBRARY_PATH", "PATH", "PYTHONPATH", "PYTHONHOME", "DYLD_INSERT_LIBRARIES"])
def test_loader_variables_in_a_profile_env_are_refused(tmp_path, capsys, var):
    path = _profile_copy(tmp_path, **{"[env]\n": f'[env]\n{var} = "/tmp/evil"\n'})
    with pytest.raises(ProfileError, match=f"env {var}="):
        load_profile(path)
    code, _, err = run_cli(capsys, "flags", "check", str(path))
    line = one_line_error(err)
    assert code == 2 and var in line and "/tmp/evil" in line and str(path) in line
    # in a flag's env too
    flagged = _profile_copy(tmp_path, name="flagged",
                            **{"[env]\n": f'[flags.evil]\nenv = {{ {var} = "/tmp/evil" }}\n\n[env]\n'})
    with pytest.raises(ProfileError, match=r"\[flags.evil\]"):
        load_profile(flagged)
    # no way round the allow-list (engine/environment.py) from a profile: allow_env is gone (issue 35)
    allowed = _profile_copy(tmp_path, name="allowed",
                            **{"[env]\n": f'allow_env = ["{var}"]\n\n[env]\n{var} = "/opt/cuda/lib"\n'})
    with pytest.raises(ProfileError, match="allow_env"):
        load_profile(allowed)


def test_shipped_profiles_still_load_including_the_repo_pythonpath_of_dsv4():
    from engine.profiles import available_profiles

    names = available_profiles()
    assert "vllm-cpu-dsv4" in names
    for name in names:
        assert load_profile(name).name == name
    assert load_profile("vllm-cpu-dsv4").env["PYTHONPATH"] == "{repo}/engine/vllm_dsv4"


def test_repo_escape_in_a_pythonpath_is_not_the_repo(tmp_path):
    path = _profile_copy(tmp_path, **{"[env]\n": '[env]\nPYTHONPATH = "{repo}/../../tmp/evil"\n'})
    with pytest.raises(ProfileError, match="PYTHONPATH"):
        load_profile(path)


def test_nightly_cell_env_with_ld_preload_is_refused(tmp_path, capsys):
    from nightly import runner as N

    cfg = _nightly_cfg(tmp_path, env='env = { LD_PRELOAD = "/tmp/evil.so" }')
    with pytest.raises(N.NightlyConfigError, match="LD_PRELOAD"):
        N.load_config(cfg)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint) -> Path:
    return tiny_checkpoint(seed=2)


def test_oracle_run_on_a_one_token_sequence_scores_no_position_of_it(tiny, tmp_path, capsys):
    """A 1-token sequence has nothing to score (position 0 never is); it must not crash the run
    (was KeyError in oracle/dsv41/attention.py) nor change the other sequences' numbers."""
    ids = [[5, 7, 9, 11, 3], [11]]
    (tmp_path / "mix.json").write_text(json.dumps(ids))
    (tmp_path / "alone.json").write_text(json.dumps(ids[:1]))
    (tmp_path / "one.json").write_text(json.dumps(ids[1:]))
    recs = {}
    for stem in ("mix", "alone", "one"):
        out = tmp_path / f"{stem}.safetensors"
        code, o, err = run_cli(capsys, "oracle", "run", "--checkpoint", str(tiny), "--panel",
                               str(tmp_path / f"{stem}.json"), "--out", str(out), "--threads", "1", "--no-progress")
        assert code == 0, err
        recs[stem] = Record.load(out)
    assert recs["one"].n_positions == 0 and len(recs["one"].seq_ids) == 1
    assert recs["mix"].n_positions == recs["alone"].n_positions == 4
    for field in ("topk_ids", "topk_logprobs", "actual_logprob", "actual_rank", "logsumexp"):
        assert np.array_equal(getattr(recs["mix"], field), getattr(recs["alone"], field)), field
