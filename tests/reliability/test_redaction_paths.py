"""core.redact, the one redaction, and each nightly path out that uses it (issue 27 item 4): the rules, the
printed argv, the cell log written while pytest runs, junit XML rewritten well-formed, the history database.

The whole harness end to end (nightly + eval + gate session, every file and stream): test_secret_canary.py.
"""

from __future__ import annotations

import base64
import sqlite3
import sys
import xml.etree.ElementTree as ET

import pytest

from core import redact as R
from core.results import GateOutcome
from nightly import history as H
from nightly import runner as N

KEY = "sk-paths-0f1e2d3c4b5a"
PW = "pathspw-9a8b7c"


@pytest.fixture(autouse=True)
def _clean_registry(monkeypatch):
    monkeypatch.setattr(R, "_registered", set())
    monkeypatch.setenv("DS41_ENGINE_API_KEY", KEY)


@pytest.mark.parametrize("text,want", [
    (f"Authorization: Bearer {'x' * 20}", "Authorization: Bearer <redacted>"),
    ("{'authorization': 'Basic dXNlcjpwdw=='}", "{'authorization': 'Basic <redacted>'}"),
    ('"Authorization": "token abcdef123"', '"Authorization": "token <redacted>"'),
    ("sent Bearer eyJhbGciOi.payload.sig", "sent Bearer <redacted>"),
    ("GET /v1/models?api_key=abcdef&x=1", "GET /v1/models?api_key=<redacted>&x=1"),
    ("http://admin:hunter2@host:8000/v1", "http://<redacted>@host:8000/v1"),
    (f"key {KEY} in a message", "key <redacted> in a message"),
    ("the key sk-paths-0f1e2d3c4b5a again, JSON-escaped too", "the key <redacted> again, JSON-escaped too"),
])
def test_redaction_rules(text, want):
    assert R.redact(text) == want


@pytest.mark.parametrize("text", [
    "Basic checks passed", "bearer of good news", "--tokenizer tok.json", "max_num_batched_tokens=64",
    "http://127.0.0.1:8000/v1", "Authorization header absent", "KL_part 4.5e-09 on 3,968 positions",
])
def test_ordinary_text_is_left_alone(text):
    assert R.redact(text) == text


def test_a_secret_in_its_url_encoded_and_json_escaped_forms():
    R.register_secret('p@ss/"word"+1')
    assert R.redact("u=p%40ss%2F%22word%22%2B1") == "u=<redacted>"
    assert R.redact('{"pw": "p@ss/\\"word\\"+1"}') == '{"pw": "<redacted>"}'


def test_argv_secrets_are_registered_and_redacted():
    argv = ["pytest", "--engine-url=http://u:" + PW + "@h:1", "--api-key", "sk-argv-123456", "--hf_token=hf-argv-654321",
            "--tokenizer", "tok.json"]
    line = R.redact_command(argv)
    assert line == "pytest --engine-url=http://<redacted>@h:1 --api-key <redacted> --hf_token=<redacted> --tokenizer tok.json"
    basic = base64.b64encode(f"u:{PW}".encode()).decode()
    # registered: the same secrets are hidden wherever they turn up later, without their URL or option
    assert R.redact(f"{PW} sk-argv-123456 hf-argv-654321 {basic}") == " ".join(["<redacted>"] * 4)


def test_scrub_file_keeps_junit_well_formed(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text('<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">'
                     '<testcase classname="g" name="t"><failure message="at http://u:pw2345@h: bad">'
                     f"Authorization: Bearer {KEY}</failure></testcase></testsuite></testsuites>")
    assert R.scrub_file(junit)
    text = junit.read_text()
    assert KEY not in text and "pw2345" not in text
    failure = ET.parse(junit).getroot().find(".//failure")   # still junit CI's test viewers can read
    assert failure.get("message") == "at http://<redacted>@h: bad"
    assert ET.parse(junit).getroot().find(".//failure").text == "Authorization: Bearer <redacted>"
    assert not R.scrub_file(junit)                      # nothing left: not rewritten
    html = tmp_path / "report.html"
    html.write_text(f"<p>{KEY}</p>")
    assert R.scrub_file(html) and html.read_text() == "<p>&lt;redacted&gt;</p>"
    binary = tmp_path / "engine.safetensors"
    binary.write_bytes(KEY.encode())
    assert not R.scrub_file(binary)                     # records carry their own redacted provenance


def test_cell_log_is_redacted_while_it_is_written(tmp_path):
    """The child prints the key of its env, the URL credentials and a Bearer header; the log never holds them."""
    code = ("import os, sys\n"
            "print('key', os.environ['DS41_ENGINE_API_KEY'], flush=True)\n"
            f"print('url http://u:{PW}@h', 'Authorization: Bearer ' + os.environ['CELL_TOKEN'], flush=True)\n"
            "sys.stdout.buffer.write(b'bytes \\xff kept\\n')\n"
            "sys.exit(3)\n")
    log = tmp_path / "pytest.log"
    env = {"PATH": "/usr/bin:/bin", "DS41_ENGINE_API_KEY": KEY, "CELL_TOKEN": "cell-token-value-77"}
    assert N.subprocess_runner([sys.executable, "-c", code], env, log, 60) == 3
    data = log.read_bytes()
    assert KEY.encode() not in data and PW.encode() not in data and b"cell-token-value-77" not in data
    assert data.splitlines() == [b"key <redacted>", b"url http://<redacted>@h Authorization: Bearer <redacted>",
                                 b"bytes \xff kept"]


def test_history_rows_are_redacted(tmp_path):
    db = tmp_path / "h.sqlite"
    cell = H.CellRecord("c", "p", (), 1, 1.0, "/tmp/c", [
        GateOutcome("g::t", "t", "failed", "call", f"engine at http://u:{PW}@h said Bearer {KEY}")])
    cell.flag_verdicts = [H.FlagVerdict("f", "exact", "bitwise_panel", False, f"differ at {KEY}")]
    H.insert_run(db, started="s", finished="f", config_name="n", config_path="p", config_hash="h", git_commit="c",
                 host="h", status="red", exit_code=3, out_dir="o", cells=[cell])
    assert KEY.encode() not in db.read_bytes() and PW.encode() not in db.read_bytes()
    with sqlite3.connect(db) as conn:
        (msg,) = conn.execute("SELECT message FROM gate_results").fetchone()
        (why,) = conn.execute("SELECT why FROM flag_verdicts").fetchone()
    assert msg == "engine at http://<redacted>@h said Bearer <redacted>" and why == "differ at <redacted>"


def test_nightly_echo_and_summary_are_redacted(tmp_path):
    """A config whose pytest_args carry URL credentials and a cell env with a token: the printed command, the
    summary files and the history hold neither (a fake runner: no pytest)."""
    cfg_path = tmp_path / "n.toml"
    cfg_path.write_text('[nightly]\nname = "r"\ngates = ["tests/data/nightly/fake_gate.py"]\n'
                        f'pytest_args = ["--engine-url", "http://u:{PW}@127.0.0.1:9"]\n'
                        '[[cells]]\nname = "c"\nprofile = "vllm-cpu-fp32"\n'
                        'env = { DS41_SERVICE_TOKEN = "cell-env-token-42" }\n')
    cfg = N.load_config(cfg_path)
    lines: list[str] = []

    def runner(argv, env, log, timeout):
        assert f"http://u:{PW}@127.0.0.1:9" in argv             # the cell itself gets the real URL
        log.write_text(f"crashed on cell-env-token-42 at {argv[-1]}\n")
        return 4

    res = N.run_nightly(cfg, tmp_path / "h.sqlite", tmp_path / "runs", runner=runner, echo=lines.append)
    assert any("--engine-url http://<redacted>@127.0.0.1:9" in ln for ln in lines), lines
    written = [p for p in tmp_path.rglob("*") if p.is_file() and p != cfg_path]
    assert {p.name for p in written} >= {"nightly.json", "nightly.md", "pytest.log", "h.sqlite"}
    for p in written:
        data = p.read_bytes()
        assert PW.encode() not in data and b"cell-env-token-42" not in data, p
    assert res.exit_code == N.EXIT_FAILURES
