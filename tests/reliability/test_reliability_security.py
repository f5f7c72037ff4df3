"""Security: no unpickling anywhere, no remote code, and secrets never reach the launcher's logs or errors.

(Untrusted text in reports and the API key through a whole gate session: test_reliability_gate_session.py
and test_reliability_vllm_session.py.)
"""

from __future__ import annotations

import ast
import json
import textwrap
from pathlib import Path

import pytest

from engine.launcher import EngineServer, EngineStartError, redact_argv, redact_env
from engine.profiles import load_profile

REPO = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("ds41gates", "engine", "oracle", "panels", "reports", "gates", "tests", "benchmarks", "scripts")
PICKLING_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}


def _truthy(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and bool(node.value)


def unsafe_loads(source: str, name: str = "<src>") -> list[str]:
    """Every unpickling or code-running load in ``source`` (AST, so strings and comments do not count)."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for m in mods:
                if m.split(".")[0] in PICKLING_MODULES:
                    found.append(f"{name}:{node.lineno}: imports {m}")
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        attr = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
        kw = {k.arg: k.value for k in node.keywords if k.arg}
        where = f"{name}:{node.lineno}"
        if owner == "torch" and attr == "load" and not (
                "weights_only" in kw and isinstance(kw["weights_only"], ast.Constant) and kw["weights_only"].value is True):
            found.append(f"{where}: torch.load without weights_only=True")
        if owner in ("np", "numpy") and attr == "load" and "allow_pickle" in kw and not (
                isinstance(kw["allow_pickle"], ast.Constant) and kw["allow_pickle"].value is False):
            found.append(f"{where}: np.load with allow_pickle")
        if attr in ("read_pickle", "to_pickle"):
            found.append(f"{where}: pandas {attr}")
        if owner == "yaml" and attr in ("load", "unsafe_load", "full_load") and "Loader" not in kw:
            found.append(f"{where}: yaml.{attr} without a safe Loader")
        if "trust_remote_code" in kw and not (isinstance(kw["trust_remote_code"], ast.Constant)
                                              and kw["trust_remote_code"].value is False):
            found.append(f"{where}: trust_remote_code")
    return found


def test_the_scanner_finds_every_planted_unsafe_load():
    planted = textwrap.dedent("""
        import pickle
        from joblib import load
        import numpy as np, torch, yaml
        torch.load("w.pt")
        torch.load("w.pt", weights_only=False)
        np.load("a.npy", allow_pickle=True)
        df.read_pickle("x")
        yaml.load(text)
        AutoModel.from_pretrained(d, trust_remote_code=True)
        torch.load("ok.pt", weights_only=True); np.load("ok.npy"); yaml.safe_load(t)
        s = "import pickle; torch.load(x)"   # a string is not code
    """)
    found = unsafe_loads(planted)
    assert [f.split(": ", 1)[1] for f in found] == [
        "imports pickle", "imports joblib", "torch.load without weights_only=True",
        "torch.load without weights_only=True", "np.load with allow_pickle", "pandas read_pickle",
        "yaml.load without a safe Loader", "trust_remote_code"], found


def test_no_unpickling_or_remote_code_anywhere_in_the_source_tree():
    files = sorted(p for d in SOURCE_DIRS for p in (REPO / d).rglob("*.py") if "__pycache__" not in p.parts)
    files += sorted(REPO.glob("*.py"))
    assert len(files) > 50
    found = [f for p in files for f in unsafe_loads(p.read_text(encoding="utf-8"), str(p.relative_to(REPO)))]
    assert found == [], "\n".join(found)


# ----------------------------------------------------------------------------------------------- launcher logs
SERVER = ("import http.server, sys\n"
          "class H(http.server.BaseHTTPRequestHandler):\n"
          "    def do_GET(self):\n"
          "        self.send_response(200); self.end_headers(); self.wfile.write(b'{}')\n"
          "    def log_message(self, *a): pass\n"
          "print('serving', flush=True)\n"
          "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n")


def _profile(tmp_path: Path, code: str, secret: str) -> Path:
    q = json.dumps   # a JSON string is a TOML basic string
    args = ["{port}", "--api-key", f"{secret}-argv", f"--hf_token={secret}-argv2", "--tokenizer", "tok.json"]
    prof = tmp_path / "secretive.toml"
    prof.write_text("\n".join([
        'name = "secretive"',
        f'command = ["{{python}}", "-c", {q(code)}]',
        f"args = [{', '.join(q(a) for a in args)}]",
        'health_url = "http://{host}:{port}/"',
        "start_timeout_s = 60",
        "stop_grace_s = 5",
        f"log_file = {q(str(tmp_path) + '/logs/{profile}-{stamp}.log')}",
        "[env]",
        f"VLLM_API_KEY = {q(secret + '-env')}",             # secret names a profile may set (allow-listed)
        f"VLLM_DS41_REMOTE_TOKEN = {q(secret + '-env2')}",
        'HF_HUB_OFFLINE = "1"',
    ]) + "\n")
    return prof


def test_launcher_log_header_never_holds_a_secret(tmp_path):
    secret = "sk-ds41-launcher-5e1f"
    prof = load_profile(_profile(tmp_path, SERVER, secret))
    with EngineServer(prof, overrides={"extra_env": {"DS41_ENGINE_API_KEY": secret + "-extra"}}, echo=lambda m: None) as srv:
        log = srv.log_path
    text = log.read_text()
    assert secret not in text, text
    header = text.splitlines()[:3]
    assert "'VLLM_API_KEY': '<redacted>'" in header[1] and "'VLLM_DS41_REMOTE_TOKEN': '<redacted>'" in header[1]
    assert "'DS41_ENGINE_API_KEY': '<redacted>'" in header[1] and "'HF_HUB_OFFLINE': '1'" in header[1]
    assert "'--api-key', '<redacted>'" in header[2] and "'--hf_token=<redacted>'" in header[2]
    assert "'--tokenizer', 'tok.json'" in header[2]                     # not a secret: kept


def test_start_error_message_never_holds_a_secret(tmp_path):
    secret = "sk-ds41-crash-77aa"
    prof = load_profile(_profile(tmp_path, "import sys; sys.exit(3)", secret))
    with pytest.raises(EngineStartError) as ei:
        EngineServer(prof, echo=lambda m: None).start()
    assert "exited with code 3" in str(ei.value) and secret not in str(ei.value)


@pytest.mark.parametrize("name,hidden", [
    ("VLLM_API_KEY", True), ("HF_TOKEN", True), ("AWS_SECRET_ACCESS_KEY", True), ("DB_PASSWORD", True),
    ("DS41_ENGINE_API_KEY", True), ("HF_HUB_OFFLINE", False), ("VLLM_CPU_KVCACHE_SPACE", False),
    ("MAX_NUM_BATCHED_TOKENS", False), ("TOKENIZERS_PARALLELISM", False),
])
def test_redaction_rules(name, hidden):
    assert (redact_env({name: "v"})[name] == "<redacted>") is hidden
    flag = "--" + name.lower().replace("_", "-")
    assert (redact_argv([flag, "v"])[1] == "<redacted>") is hidden
    assert (redact_argv([f"{flag}=v"])[0].endswith("<redacted>")) is hidden
