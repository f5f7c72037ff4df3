"""Reliability on the real vLLM CPU server (the suite's one vLLM launch): killed mid-gate, and a secret API key.

One gate session (pytest + the ds41-gates plugin in a subprocess, ``--engine-url`` as a nightly run against a
running engine) on a key-protected vllm-cpu-fp32 server:

1. the real KL panel gate runs on a 4-sequence SmolLM2 subset against its fp32 oracle reference;
2. a second, long gate (a stand-in that re-scores the panel until the engine goes away) is running when the
   test SIGKILLs the server's whole process group at a random moment.

Expected: the second gate *errors* (neither passes nor fails), the first gate's verdict, the engine record
and results.json are kept, and the session report marks the errored gate. The key (``VLLM_API_KEY`` for the
server, ``DS41_ENGINE_API_KEY`` for the harness) is needed by the server and appears in no written file,
not in the session output and not in the launcher log.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time

import pytest

from core.records import Record
from core.results import GateEntry
from engine import launcher
from engine.launcher import EngineServer
from engine.supervise import group_members
from tests.reliability.helpers import (
    RESUME_TOP_K, files_containing, gate_session_env, http_status, run_gate_session, smol_reference,
)

pytestmark = [pytest.mark.engine]

HEAD = "import pytest\npytestmark = [pytest.mark.gate, pytest.mark.engine]\n"
KL_GATE = "from gates.test_kl_panel import test_kl_panel_per_domain  # the real gate\n"
LONG_GATE = '''

def test_zz_long_gate(engine_endpoint, encoded_panel, gate_run):
    """Stand-in for a long gate: re-scores the panel until the engine goes away (the test kills it)."""
    import os
    import time
    from pathlib import Path

    from core.results import GateEntry
    from engine.endpoint import score_engine

    Path(os.environ["DS41_TEST_STARTED"]).write_text("started")
    deadline, rounds = time.monotonic() + 300, 0
    while time.monotonic() < deadline:
        score_engine(engine_endpoint, encoded_panel, 5)
        rounds += 1
        gate_run.add(GateEntry("zz_long_gate", None, metrics={"rounds": rounds}))
'''


@pytest.fixture(scope="module")
def killed_session(tmp_path_factory):
    venv = launcher._cache() / "venvs" / launcher.VLLM_VENV
    if not (venv / ".ds41-ready").exists():
        pytest.skip(f"{venv} not set up (scripts/setup-vllm.sh)")
    tmp = tmp_path_factory.mktemp("vllm-session")
    secret = "sk-ds41-" + os.urandom(16).hex()
    ref_path = smol_reference(RESUME_TOP_K).save(tmp / "reference.safetensors")
    marker = tmp / "started"
    killed: dict = {}
    # enforce_eager: no torch.compile (the compiled start took 390 s on the shared box); numerics are the gate's
    srv = EngineServer("vllm-cpu-fp32", flags=["enforce_eager"],
                       overrides={"extra_env": {"VLLM_API_KEY": secret}, "health_url": "http://{host}:{port}/health"})
    srv.start()
    pgid = srv.pid
    try:
        auth = {"none": http_status(srv.base_url + "/v1/models"), "wrong": http_status(srv.base_url + "/v1/models", "nope"),
                "right": http_status(srv.base_url + "/v1/models", secret)}

        def kill_mid_gate(proc):
            deadline = time.monotonic() + 600
            while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if proc.poll() is None and marker.exists():
                delay = random.uniform(0.2, 1.5)
                time.sleep(delay)
                os.killpg(pgid, signal.SIGKILL)
                killed.update(delay_s=round(delay, 2), members_before=len(group_members(pgid)) or None)

        s = run_gate_session(tmp / "run", HEAD + KL_GATE + LONG_GATE, reference=ref_path, engine_url=srv.base_url,
                             env=gate_session_env({"DS41_ENGINE_API_KEY": secret, "DS41_TEST_STARTED": str(marker)}),
                             popen_hook=kill_mid_gate, timeout=900)
    finally:
        srv.stop()
    return {"session": s, "secret": secret, "server": srv, "pgid": pgid, "auth": auth, "killed": killed, "tmp": tmp}


@pytest.mark.timeout(1200)
def test_killed_mid_gate_errors_keeps_partial_results_and_is_marked(killed_session):
    s, killed = killed_session["session"], killed_session["killed"]
    assert killed, "the long gate never started: " + s.output[-3000:]
    assert s.returncode == 1, s.output[-3000:]
    first = s.outcome("test_kl_panel_per_domain")
    assert first["outcome"] in ("passed", "failed"), first           # a verdict, measured before the kill
    err = s.outcome("test_zz_long_gate")
    assert err["outcome"] == "error" and err["phase"] == "call", err  # neither passed nor failed
    assert "EngineTransportError" in err["detail"] and "connection error" in err["detail"], err["detail"]
    # partial results: the first gate's numbers, the engine record and the outcomes survive the kill
    assert s.results.gate("kl_panel").passed == (first["outcome"] == "passed")
    rec = Record.load(s.results_dir / "engine-vllm-cpu-fp32.safetensors")
    assert rec.provenance.side == "engine" and rec.n_positions == smol_reference(RESUME_TOP_K).n_positions
    report = json.loads((s.results_dir / "report.json").read_text())
    rows = {r["gate"]: r["outcome"] for r in report["extra"]["Gate outcomes"]["rows"]}
    assert rows == {"test_kl_panel_per_domain": first["outcome"], "test_zz_long_gate": "ERROR"}
    assert "1 gate(s) ERRORED" in (s.results_dir / "report.html").read_text()
    assert "ERRORED gate (neither passed nor failed)" in s.output
    print(f"killed {killed}; session {s.wall_s:.0f} s; KL gate {first['outcome']} "
          f"{s.results.gate('kl_panel').metrics}; long gate rounds before the kill: "
          f"{(s.results.gate('zz_long_gate') or GateEntry('', None)).metrics.get('rounds', 0)}; error: {err['detail'][:300]}")


@pytest.mark.timeout(1200)
def test_api_key_is_required_by_the_server_and_never_written(killed_session):
    secret, s, srv = killed_session["secret"], killed_session["session"], killed_session["server"]
    assert killed_session["auth"] == {"none": 401, "wrong": 401, "right": 200}   # the key really matters
    assert s.outcome("test_kl_panel_per_domain")["outcome"] != "error"           # so it was sent
    assert s.files and not files_containing([killed_session["tmp"]], secret)     # results, records, report, logs
    assert secret not in s.output
    log = srv.log_path.read_text(errors="replace")
    assert secret not in log
    assert "'VLLM_API_KEY': '<redacted>'" in log.splitlines()[1]                 # the launcher's env header


@pytest.mark.timeout(1200)
def test_no_server_process_left(killed_session):
    assert group_members(killed_session["pgid"]) == []
    assert not killed_session["server"].running()
