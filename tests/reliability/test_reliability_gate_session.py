"""Reliability: whole gate sessions (pytest + the ds41-gates plugin, in a subprocess, as CI runs them) against
a canned-body server: 5xx, malformed bytes, hostile text, a secret API key.

An engine fault must make a gate *error* (neither pass nor fail), keep what was measured before it in
results.json, and be marked in the session report. Text from the engine or the panel must be inert in the
report; the API key must reach the engine and nothing else.
"""

from __future__ import annotations

import html.parser
import json
import re

import pytest

from tests.reliability.helpers import (
    Canned, CannedServer, exact_reference, files_containing, gate_session_env, plain_sequences, run_gate_session,
    serve_vllm,
)
from tests.engine.test_client_malformed import vllm_generation_response, vllm_prompt_response

MODEL = "fake-smollm2"
KL_GATE = "from gates.test_kl_panel import test_kl_panel_per_domain  # the real gate\n"
HEAD = "import pytest\npytestmark = [pytest.mark.gate, pytest.mark.engine]\n"
SCRIPT = "<script>alert(1)</script>"
ATTR = '" onmouseover="alert(2)" x="'


def _reference(tmp_path, seqs=None, **kw):
    path = tmp_path / "reference.safetensors"
    exact_reference(seqs or plain_sequences(), **kw).save(path)
    return path


# ----------------------------------------------------------------------------------------------- 5xx
def test_5xx_retried_with_backoff_then_the_gate_errors(tmp_path):
    with CannedServer() as srv:
        serve_vllm(srv, MODEL)
        srv.routes["/v1/completions"] = lambda r: Canned(503, {"error": {"message": "engine overloaded"}})
        s = run_gate_session(tmp_path, HEAD + KL_GATE, reference=_reference(tmp_path), engine_url=srv.url)
        calls = srv.requests_to("/v1/completions")
    assert s.returncode == 1, s.output[-2000:]
    out = s.outcome("test_kl_panel_per_domain")
    assert out["outcome"] == "error" and out["phase"] == "setup", out      # neither passed nor failed
    assert "EngineTransportError" in out["detail"] and "HTTP 503" in out["detail"]
    assert "after 4 attempt(s)" in out["detail"] and "engine overloaded" in out["detail"]
    # bounded retries, measured on the server: 4 attempts for the first sequence, backoff 0.25, 0.5, 1.0 s
    assert len(calls) == 4
    gaps = [b.t - a.t for a, b in zip(calls, calls[1:])]
    assert all(g >= d - 0.01 for g, d in zip(gaps, (0.25, 0.5, 1.0))), gaps
    assert all(g < d + 2.0 for g, d in zip(gaps, (0.25, 0.5, 1.0))), gaps
    assert s.results.gate("kl_panel") is None                                  # no number from a dead engine
    assert "ERRORED gate (neither passed nor failed)" in s.output and "report:  not written" in s.output
    assert not (s.results_dir / "report.html").exists()


# ----------------------------------------------------------------------------------------------- malformed
@pytest.mark.parametrize("body,kind", [
    (lambda ids: json.dumps(vllm_prompt_response(ids, 20, model=MODEL))[:-60], "invalid_json"),
    (lambda ids: json.dumps(vllm_prompt_response(ids, 20, model="other-model")), "wrong_model"),
    (lambda ids: json.dumps(vllm_prompt_response(ids, 20, model=MODEL)).replace("-0.", "NaN, \"x\": -0.", 1),
     "non_standard_number"),
], ids=["truncated JSON", "wrong model", "NaN literal"])
def test_malformed_answer_makes_the_gate_error_not_pass(tmp_path, body, kind):
    with CannedServer() as srv:
        serve_vllm(srv, MODEL)
        srv.routes["/v1/completions"] = lambda r: Canned(200, body(r.body["prompt"]))
        s = run_gate_session(tmp_path, HEAD + KL_GATE, reference=_reference(tmp_path), engine_url=srv.url)
        calls = srv.requests_to("/v1/completions")
    out = s.outcome("test_kl_panel_per_domain")
    assert s.returncode == 1 and out["outcome"] == "error", out
    assert f"EngineResponseError: malformed engine response [{kind}]" in out["detail"], out["detail"]
    assert len(calls) == 1                                    # malformed answers are not retried
    assert s.results.gate("kl_panel") is None


# ----------------------------------------------------------------------------------------------- hostile text + key
OUTPUT_GATE = '''
def test_model_output_gate(engine_client, gate_run):
    """Stand-in for a gate that shows model output (needles, decode): the text is the engine's."""
    g = engine_client.generate([1, 2, 3], 3, 2, seq_id="gen")
    gate_run.add_section("Model output", [{"prompt": "p", "output": g.text}], note="as generated")
'''

SECOND_GATE = '''
def test_zz_tokenizer_gate(engine_client, gate_run):
    """Stand-in for a later gate: its engine call is refused with an error text the engine chose."""
    from core.results import GateEntry

    gate_run.add(GateEntry("zz_partial", None, metrics={"measured": 1}))
    engine_client.tokenize("hello")
'''


class _Tags(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


@pytest.fixture(scope="module")
def hostile_session(tmp_path_factory):
    """A full session: hostile panel text and model name, a secret key, a pass and then an errored gate."""
    tmp = tmp_path_factory.mktemp("hostile")
    secret = "sk-ds41-" + "7f3a9c" * 6
    model = "m" + SCRIPT + ATTR
    seqs = [(f"s{i}{SCRIPT}{ATTR}", dom, ids) for i, (_, dom, ids) in enumerate(plain_sequences())]
    seqs = [(sid, (SCRIPT + "|x_", ATTR)[i % 2], ids) for i, (sid, _, ids) in enumerate(seqs)]
    ref = _reference(tmp, seqs, panel_name="p" + SCRIPT)
    with CannedServer(require_key=secret) as srv:
        serve_vllm(srv, model)
        prompt_route = srv.routes["/v1/completions"]

        def completions(r):
            if "prompt_logprobs" in r.body:
                return prompt_route(r)
            resp = vllm_generation_response(r.body["prompt"], r.body["max_tokens"], r.body["logprobs"])
            resp["model"] = model
            resp["choices"][0]["text"] = "out " + SCRIPT + ATTR + "<img src=x onerror=alert(3)>"
            return Canned(200, resp)
        srv.routes["/v1/completions"] = completions
        srv.routes["/tokenize"] = lambda r: Canned(400, {"error": {"message": "refused " + SCRIPT + ATTR}})
        s = run_gate_session(tmp, HEAD + KL_GATE + OUTPUT_GATE + SECOND_GATE, reference=ref, engine_url=srv.url,
                             env=gate_session_env({"DS41_ENGINE_API_KEY": secret}))
        seen = list(srv.seen)
    return s, secret, seen


def test_errored_gate_is_marked_and_earlier_results_kept(hostile_session):
    s, _, _ = hostile_session
    assert s.returncode == 1, s.output[-3000:]
    assert s.outcome("test_kl_panel_per_domain")["outcome"] == "passed"
    err = s.outcome("test_zz_tokenizer_gate")
    assert err["outcome"] == "error" and err["phase"] == "call" and "EngineRequestRejected" in err["detail"]
    assert s.results.gate("kl_panel").passed is True and s.results.gate("zz_partial").metrics == {"measured": 1}
    # the verdict names the origin it rests on (the canned server's), never a credential
    answered = s.results.gate("kl_panel").evidence["answered_by"]
    assert answered and len(answered) == 1 and answered[0].startswith("http://127.0.0.1:"), answered
    report = json.loads((s.results_dir / "report.json").read_text())
    section = report["extra"]["Gate outcomes"]
    assert "1 gate(s) ERRORED" in section["note"]
    assert [(r["gate"], r["outcome"]) for r in section["rows"]] == [
        ("test_kl_panel_per_domain", "passed"), ("test_model_output_gate", "passed"), ("test_zz_tokenizer_gate", "ERROR")]
    assert "Gate outcomes" in (s.results_dir / "report.md").read_text()
    html_text = (s.results_dir / "report.html").read_text()
    assert "1 gate(s) ERRORED" in html_text and "ERROR" in html_text


def test_report_escapes_engine_and_panel_text(hostile_session):
    s, _, _ = hostile_session
    page = (s.results_dir / "report.html").read_text(encoding="utf-8")
    assert "<script" not in page.lower()
    assert ATTR not in page
    p = _Tags()
    p.feed(page)
    assert not [a for _, a in p.tags if any(k.startswith("on") for k in a)]
    # the hostile text is shown, escaped: the model name, the panel name, a domain, the engine's error text
    assert page.count("&lt;script&gt;alert(1)&lt;/script&gt;") >= 4
    assert "refused &lt;script&gt;" in page
    assert "out &lt;script&gt;" in page and "&lt;img src=x onerror=alert(3)&gt;" in page   # model output
    assert sum(1 for t, a in p.tags if t == "img" and not a.get("src", "").startswith("data:image/png")) == 0
    md = (s.results_dir / "report.md").read_text(encoding="utf-8")
    assert "<script" not in md.lower() and "<img" not in md.lower() and "refused &lt;script&gt;" in md


def test_api_key_reaches_the_engine_and_nothing_else(hostile_session, tmp_path):
    s, secret, seen = hostile_session
    (tmp_path / "control.json").write_text(json.dumps({"k": secret}))
    assert files_containing([tmp_path], secret)                     # the grep does find a written key
    # the key was sent on every request (the canned server answers 401 otherwise, and the KL gate passed)
    assert seen and all(r.headers.get("authorization") == f"Bearer {secret}" for r in seen)
    assert s.files and not files_containing([s.results_dir.parent], secret)   # results, records, report, logs
    assert secret not in s.output
    assert re.search(r"\d+ passed", s.output)
