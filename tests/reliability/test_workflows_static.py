"""The GitHub workflows stay safe (issue 27 item 5): zizmor (offline, the dev extra's pinned release) finds nothing
in .github/, and the nightly's dispatch inputs are data, never shell — shown by running the step's real script
with hostile inputs the way the runner would.

Before the fix zizmor reported 4 high (template-injection, 3× unpinned-uses) and 3 medium (artipacked,
excessive-permissions ×2, pedantic persona) findings; a crafted ``cells`` input ran a command on the runner.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
GITHUB = REPO / ".github"
WORKFLOWS = sorted((GITHUB / "workflows").glob("*.y*ml"))
NIGHTLY = GITHUB / "workflows" / "nightly.yml"
SHA = re.compile(r"^[^@\s]+@[0-9a-f]{40}$")


def _zizmor() -> str:
    exe = shutil.which("zizmor", path=str(Path(sys.executable).parent)) or shutil.which("zizmor")
    assert exe, "zizmor is not installed: it is in the dev extra (pip install -e '.[dev]', scripts/setup-harness.sh)"
    return exe


def _audit(*extra: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("GH_TOKEN", "GITHUB_TOKEN", "ZIZMOR_GITHUB_TOKEN")}
    proc = subprocess.run([_zizmor(), "--offline", "--no-progress", "--format", "json", *extra, str(GITHUB)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    # exit 0: no findings; 10-14: findings of the highest severity 1..4; anything else: zizmor itself failed
    assert proc.returncode == 0 or 10 <= proc.returncode <= 14, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def _summary(findings: list[dict]) -> list[str]:
    out = []
    for f in findings:
        loc = f["locations"][0]["symbolic"] if f.get("locations") else {}
        out.append(f"{f['determinations']['severity']} {f['ident']}: {f.get('desc', '')} "
                   f"({loc.get('key', {}).get('Local', {}).get('given_path', '')})")
    return out


def test_workflows_exist():
    assert NIGHTLY in WORKFLOWS


def test_zizmor_finds_nothing_in_github_dir():
    findings = _audit()
    assert findings == [], "\n".join(_summary(findings))


def test_zizmor_pedantic_finds_nothing_high_or_medium():
    findings = [f for f in _audit("--persona", "pedantic")
                if f["determinations"]["severity"] in ("High", "Medium")]
    assert findings == [], "\n".join(_summary(findings))


def test_zizmor_does_find_an_injection_it_is_shown(tmp_path):
    """Control: the check is live — the pre-fix shape of the nightly step is reported, high."""
    bad = tmp_path / ".github" / "workflows"
    bad.mkdir(parents=True)
    (bad / "bad.yml").write_text(
        "on:\n  workflow_dispatch:\n    inputs:\n      cells:\n        default: ''\n"
        "jobs:\n  j:\n    runs-on: ubuntu-latest\n    steps:\n      - uses: actions/checkout@v4\n"
        "      - run: for c in ${{ github.event.inputs.cells }}; do echo $c; done\n")
    proc = subprocess.run([_zizmor(), "--offline", "--no-progress", "--format", "json", str(tmp_path / ".github")],
                          capture_output=True, text=True, timeout=120)
    idents = {(f["ident"], f["determinations"]["severity"]) for f in json.loads(proc.stdout)}
    assert {("template-injection", "High"), ("unpinned-uses", "High")} <= idents, idents


def _load(path: Path) -> dict:
    data = yaml.safe_load(path.read_text())
    if True in data:          # YAML 1.1 reads the key `on` as a boolean
        data["on"] = data.pop(True)
    return data


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_pinned_read_only_no_expression_in_scripts(path):
    wf = _load(path)
    assert wf.get("permissions") == {"contents": "read"}, wf.get("permissions")
    for name, job in wf["jobs"].items():
        assert set((job.get("permissions") or {"contents": "read"}).values()) <= {"read", "none"}, name
        for step in job["steps"]:
            if "uses" in step:
                assert SHA.match(step["uses"]), f"{name}: {step['uses']} is not pinned to a commit"
                if step["uses"].startswith("actions/checkout@"):
                    assert step.get("with", {}).get("persist-credentials") is False
            if "run" in step:
                assert "${{" not in step["run"], f"{name}: an expression inside run: {step.get('name')}"


# ------------------------------------------------------------------------------------- the nightly step, run
def _nightly_step() -> dict:
    (step,) = [s for s in _load(NIGHTLY)["jobs"]["nightly"]["steps"] if s.get("id") == "nightly"]
    return step


def _run_step(tmp_path: Path, cells: str, config: str = "") -> tuple[int, str, list[str]]:
    """The step's script as the runner runs it (`shell: bash`: bash --noprofile --norc -eo pipefail) in a scratch
    tree whose ds41gate records its argv."""
    work = tmp_path / "tree"
    (work / ".venv" / "bin").mkdir(parents=True, exist_ok=True)
    calls = work / "calls.jsonl"
    stub = work / ".venv" / "bin" / "ds41gate"
    stub.write_text(f"#!{sys.executable}\nimport json, sys\n"
                    f"open({str(calls)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n")
    stub.chmod(0o755)
    step = _nightly_step()
    # the step's env as the runner sets it: the expressions' values, never re-read by the shell
    values = {"github.event.inputs.config": config, "vars.DS41_NIGHTLY_CONFIG": "", "github.event.inputs.cells": cells}
    env = {"PATH": os.environ["PATH"], "HOME": str(work), "GITHUB_OUTPUT": str(work / "out.txt"),
           "DS41_HISTORY": str(work / "h.sqlite")}
    for k, v in step["env"].items():
        m = re.fullmatch(r"\$\{\{\s*([\w.]+)\s*\}\}", v)
        assert m, f"step env {k} is not one plain expression: {v}"
        env[k] = values[m.group(1)]
    script = work / "step.sh"
    script.write_text(step["run"])
    assert _load(NIGHTLY)["jobs"]["nightly"]["defaults"]["run"]["shell"] == "bash"
    proc = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", str(script)], cwd=work, env=env, capture_output=True, text=True, timeout=60)
    argv = [json.loads(x) for x in calls.read_text().splitlines()] if calls.exists() else []
    return proc.returncode, proc.stdout + proc.stderr, argv


@pytest.mark.parametrize("cells", [
    "x; touch PWNED", "$(touch PWNED)", "`touch PWNED`", "a\ntouch PWNED", "a && touch PWNED #",
    "--db=/tmp/PWNED", "* ", "a|touch PWNED", "../../PWNED",
])
def test_a_crafted_cells_input_runs_nothing(tmp_path, cells):
    code, out, calls = _run_step(tmp_path, cells)
    assert code == 2 and "cell names are" in out, out
    assert calls == [] and not list(tmp_path.rglob("PWNED")), out


@pytest.mark.parametrize("config", ["x.toml; touch PWNED", "$(touch PWNED).toml", "../etc/x.toml", "/etc/x.toml",
                                    "--help.toml", "nightly/configs/full.toml\ntouch PWNED"])
def test_a_crafted_config_input_runs_nothing(tmp_path, config):
    code, out, calls = _run_step(tmp_path, "", config)
    assert code == 2 and "config input" in out, out
    assert calls == [] and not list(tmp_path.rglob("PWNED")), out


def test_ordinary_inputs_reach_the_nightly_as_arguments(tmp_path):
    code, out, calls = _run_step(tmp_path, " cpu-fp32  vllm-cpu-fp32+no_prefix_cache ", "nightly/configs/cpu-smoke.toml")
    assert code == 0, out
    db = str(tmp_path / "tree" / "h.sqlite")
    assert calls == [["nightly", "nightly/configs/cpu-smoke.toml", "--db", db, "--out", "nightly/runs",
                      "--cell", "cpu-fp32", "--cell", "vllm-cpu-fp32+no_prefix_cache"]]
    assert (tmp_path / "tree" / "out.txt").read_text() == "exit_code=0\n"
    code, out, calls = _run_step(tmp_path / "default", "")
    assert code == 0 and calls == [["nightly", "nightly/configs/full.toml", "--db", str(tmp_path / "default" / "tree" / "h.sqlite"),
                                    "--out", "nightly/runs"]], out
