"""Hardening: every bad input is a named error before any work starts — one line, exit code 2 — never a
traceback and never a silent number; secrets are never written.

One test per class of finding, each with several inputs; the CLI is run as a subprocess
(``python -m ds41gates.cli ...``, ``ds41gate serve ...``, ``python -m pytest`` gate sessions) and
the exit code and the first line of the message are asserted.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from core.bands import BandsError, load_bands
from core.errors import UserError
from core.records import Provenance, Record, RecordError
from oracle.dsv41.config import ConfigError, ModelConfig
from oracle.dsv41.spill import SpillError, StageReader
from panels.store import content_hash, parse_jsonl
from tests.core.recordkit import pair_of_records
from tests.reliability.helpers import (
    Canned, CannedServer, exact_reference, files_containing, gate_session_env, plain_sequences, run_gate_session,
    serve_vllm,
)

REPO = Path(__file__).resolve().parents[2]
PANEL_DATA = REPO / "panels" / "data"


def run(*args: str, module: str = "ds41gates.cli", env: dict | None = None, timeout: float = 180):
    """(exit code, first stderr line, full output) of `python -m module args...` in the repo."""
    e = gate_session_env(env)
    r = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=e, capture_output=True, text=True,
                       timeout=timeout)
    lines = [ln for ln in r.stderr.split("\n") if ln.strip()]
    return r.returncode, (lines[0] if lines else ""), r.stdout + r.stderr


def assert_one_line_error(rc: int, first: str, output: str, *needles: str) -> None:
    assert rc == 2, output[-3000:]
    assert first.startswith("error: "), output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    for n in needles:
        assert n in first, (n, first)


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """A valid reference / engine pair on disk and a function writing a mutated copy of either."""
    d = tmp_path_factory.mktemp("records")
    ref, eng, _ = pair_of_records(np.random.default_rng(7), n_seq=3, length=9, vocab=50, k_ref=20, k_eng=5)
    ref.save(d / "ref.safetensors")
    eng.save(d / "eng.safetensors")
    return d, ref, eng


def _save(rec: Record, path: Path, **arrays) -> Path:
    import copy

    r = copy.copy(rec)
    for name, fn in arrays.items():
        setattr(r, name, fn(np.array(getattr(rec, name))))
    r.save(path)
    return path


# ============================================================================= 1. silent numbers
def _set(a, idx, v):
    a[idx] = v
    return a


SILENT = [
    ("positive top-1 logprob", "eng", {"topk_logprobs": lambda a: _set(a, (2, 0), 0.7)},
     "top-1 logprob 0.7 is not a valid logprob"),
    ("positive actual logprob", "eng", {"actual_logprob": lambda a: _set(a, 4, 1.5)},
     "actual-token logprob 1.5 is not a valid logprob"),
    ("duplicate top-k id", "eng", {"topk_ids": lambda a: _set(a, (1, 1), a[1, 0])}, "duplicate id in top-k"),
    ("unordered top-k", "eng", {"topk_logprobs": lambda a: _set(a, (0, slice(None)), a[0, ::-1])},
     "not in rank order"),
    ("id below padding", "eng", {"topk_ids": lambda a: _set(a, (0, 2), -7)}, "id -7 is negative"),
    ("NaN logprob in the reference", "ref", {"topk_logprobs": lambda a: _set(a, (3, 4), np.nan)},
     "top-5 logprob nan"),
]


@pytest.mark.parametrize("which,mutation,message", [c[1:] for c in SILENT], ids=[c[0] for c in SILENT])
def test_values_that_cannot_be_logprobs_are_refused_not_scored(records, tmp_path, which, mutation, message):
    d, ref, eng = records
    bad = _save(eng if which == "eng" else ref, tmp_path / f"{which}-bad.safetensors", **mutation)
    args = [str(d / "ref.safetensors"), str(bad)] if which == "eng" else [str(bad), str(d / "eng.safetensors")]
    rc, first, out = run("report", *args, "--out", str(tmp_path / "r"), "--n-boot", "100")
    assert_one_line_error(rc, first, out, str(bad), message)
    assert not (tmp_path / "r" / "report.json").exists()


def test_out_of_vocabulary_ids_are_refused_when_the_vocabulary_is_known(records, tmp_path):
    d, ref, eng = records
    import copy

    r = copy.copy(eng)
    r.provenance = Provenance(**{**eng.provenance.__dict__, "extra": {"vocab_size": 50}})
    r.topk_ids = np.array(eng.topk_ids)
    r.topk_ids[5, 3] = 50
    r.save(tmp_path / "oov.safetensors")
    rc, first, out = run("report", str(d / "ref.safetensors"), str(tmp_path / "oov.safetensors"), "-o", str(tmp_path / "r"))
    assert_one_line_error(rc, first, out, "top-k id 50 is outside the vocabulary (size 50)")


@pytest.mark.parametrize("order,message", [
    (("eng", "ref"), "REFERENCE must be an oracle record"),
    (("ref", "ref"), "ENGINE must be an engine record"),
    (("eng", "eng"), "REFERENCE must be an oracle record"),
], ids=["swapped", "oracle as engine", "engine as reference"])
def test_records_given_on_the_wrong_side_are_refused(records, tmp_path, order, message):
    d, _, _ = records
    rc, first, out = run("report", *(str(d / f"{o}.safetensors") for o in order), "-o", str(tmp_path / "r"))
    assert_one_line_error(rc, first, out, message, "swapped?")


def test_a_flipped_byte_in_a_logprob_is_caught_by_the_content_hash(records, tmp_path):
    d, _, _ = records
    data = bytearray((d / "eng.safetensors").read_bytes())
    data[-20] ^= 0x01                       # inside the last array: still a valid float, a different number
    (tmp_path / "flip.safetensors").write_bytes(bytes(data))
    rc, first, out = run("report", str(d / "ref.safetensors"), str(tmp_path / "flip.safetensors"), "-o", str(tmp_path / "r"))
    assert_one_line_error(rc, first, out, "do not match its content_sha256")


# ============================================================================= 2. unknown keys / out of range
BANDS_OK = """[profiles.default.default]
kl_mean = 0.05
kl_p99 = 1.0
top1_decided = 0.9
ln_ppl = 0.05
"""

BANDS_BAD = [
    ("misspelled domain", BANDS_OK + "[profiles.default.mathh]\nkl_mean = 1\nkl_p99 = 1\ntop1_decided = 0.5\nln_ppl = 1\n",
     "profiles.default.mathh: unknown domain"),
    ("misspelled key", BANDS_OK.replace("kl_p99", "kl_p90"), "unknown key(s) ['kl_p90']"),
    ("kl_mean = inf", BANDS_OK.replace("kl_mean = 0.05", "kl_mean = inf"), "kl_mean = inf; must be a number >= 0"),
    ("top1 = -5", BANDS_OK.replace("top1_decided = 0.9", "top1_decided = -5"), "top1_decided = -5; must be a number in [0, 1]"),
    ("top1 = 1.5", BANDS_OK.replace("top1_decided = 0.9", "top1_decided = 1.5"), "must be a number in [0, 1]"),
    ("string value", BANDS_OK.replace("ln_ppl = 0.05", 'ln_ppl = "0.05"'), "ln_ppl = '0.05'; must be a number >= 0"),
    ("band as a scalar", "[profiles.default]\ndefault = 0.05\n", "profiles.default.default must be a table"),
    ("unknown top-level key", "bands = 1\n" + BANDS_OK, "unknown top-level key(s) ['bands']"),
    ("missing key", BANDS_OK.replace("ln_ppl = 0.05\n", ""), "missing key(s) ['ln_ppl']"),
    ("not UTF-8", None, "cannot read bands"),
]


@pytest.mark.parametrize("text,message", [c[1:] for c in BANDS_BAD], ids=[c[0] for c in BANDS_BAD])
def test_bands_refuse_unknown_keys_and_out_of_range_values(tmp_path, text, message):
    path = tmp_path / "bands.toml"
    path.write_bytes(b"\xff\xfe" + BANDS_OK.encode() if text is None else text.encode())
    with pytest.raises(BandsError) as info:
        load_bands("vllm-cpu-fp32", path)
    first = str(info.value).split("\n")[0]
    assert first.startswith(f"{path}: ") and message in first, first
    assert isinstance(info.value, UserError)
    path.write_text(BANDS_OK)                        # the same file, corrected, loads: the check is not blanket
    assert load_bands("vllm-cpu-fp32", path)["default"].top1_decided == 0.9


CONFIG_BAD = [
    ("misspelled key", lambda c: c.__setitem__("n_layer", c.pop("n_layers")), "unknown key 'n_layer' (did you mean 'n_layers'?)"),
    ("string for a number", lambda c: c.__setitem__("dim", "256"), "dim = '256' must be an integer"),
    ("bool for a number", lambda c: c.__setitem__("norm_eps", True), "norm_eps = True must be a number"),
    ("no n_layers", lambda c: c.pop("n_layers"), "n_layers (HF: num_hidden_layers) is missing"),
]


@pytest.mark.parametrize("edit,message", [c[1:] for c in CONFIG_BAD], ids=[c[0] for c in CONFIG_BAD])
def test_checkpoint_config_refuses_unknown_keys_and_wrong_types(tiny_checkpoint, tmp_path, edit, message):
    ckpt = Path(shutil.copytree(tiny_checkpoint(), tmp_path / "ckpt"))
    cfg = json.loads((ckpt / "config.json").read_text())
    edit(cfg)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_json(ckpt / "config.json")
    assert str(info.value).startswith(f"{ckpt / 'config.json'}: config: ") and message in str(info.value)
    # and through the CLI: one line, exit 2
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([[1, 2, 3, 4, 5]]))
    rc, first, out = run("oracle", "run", "--checkpoint", str(ckpt), "--panel", str(ids), "--out",
                         str(tmp_path / "o.safetensors"))
    assert rc == 2 and "Traceback" not in out and message in out, out[-2000:]


PROFILE_OK = 'command = ["{python}", "-c", "pass"]\nserved_model = "m"\n'


@pytest.mark.parametrize("text,message", [
    (PROFILE_OK + "start_timout_s = 5\n", "unknown key(s) ['start_timout_s']"),
    (PROFILE_OK + "port = 70000\n", "'port' must be an integer in [0, 65535], got 70000"),
    (PROFILE_OK + 'stop_grace_s = "x"\n', "'stop_grace_s' must be a positive number"),
    (PROFILE_OK + "[flags.f]\nenv = 3\n", "'env' must be a table of strings"),
    (None, "not UTF-8 text"),
], ids=["misspelled key", "port out of range", "string timeout", "flag env scalar", "not UTF-8"])
def test_engine_profiles_refuse_unknown_keys_and_bad_values(tmp_path, text, message):
    path = tmp_path / "p.toml"
    path.write_bytes(b"# \xff\n" + PROFILE_OK.encode() if text is None else text.encode())
    rc, first, out = run("serve", str(path), "--dry-run")
    assert_one_line_error(rc, first, out, str(path), message)


GATE_SESSION_CONFIG_TEST = "def test_cfg(gate_config):\n    assert gate_config\n"


@pytest.mark.parametrize("text,message", [
    ("[batch]\nmax_tokens = -3\n", "[batch] max_tokens = -3: must be an integer >= 0"),
    ("[batch]\nmax_tokns = 3\n", "[batch]: unknown keys ['max_tokns']"),
    ('[prefix]\nkl_tol_floor = "1e-6"\n', "kl_tol_floor = '1e-6': must be a finite number >= 0"),
    ("[needles]\nlengths = [512, -1]\n", "lengths = [512, -1]: must be a list of numbers >= 0"),
    ("[nope]\nx = 1\n", "unknown gate table [nope]"),
], ids=["negative size", "misspelled key", "string float", "negative in list", "unknown table"])
def test_gate_configs_refuse_unknown_keys_and_bad_values(tmp_path, text, message):
    cfg = tmp_path / "config.toml"
    cfg.write_text(text)
    (tmp_path / "conftest.py").write_text("from gates.conftest import gate_config  # noqa: F401\n")
    (tmp_path / "test_cfg.py").write_text(GATE_SESSION_CONFIG_TEST)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_cfg.py")],
                       cwd=REPO, env=gate_session_env({"DS41_GATES_CONFIG": str(cfg)}), capture_output=True,
                       text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and message in out and str(cfg) in out, out[-2000:]


# ============================================================================= 3. user errors are one line
def _provenance_edit(rec_path: Path, out: Path, edit) -> Path:
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    with safe_open(str(rec_path), framework="numpy") as f:
        meta = dict(f.metadata())
    prov = json.loads(meta["provenance"])
    edit(prov)
    meta["provenance"] = json.dumps(prov)
    save_file(load_file(str(rec_path)), str(out), metadata=meta)
    return out


@pytest.mark.parametrize("edit,message", [
    (lambda p: p.__setitem__("panel_version", 3), "provenance key 'panel_version' must be a str"),
    (lambda p: p.pop("tokenizer_hash"), "provenance lacks key(s) ['tokenizer_hash']"),
    (lambda p: p.__setitem__("colour", "red"), "provenance has unknown key(s) ['colour']"),
    (lambda p: p.__setitem__("side", "judge"), "provenance side 'judge'"),
    (lambda p: p.__setitem__("extra", []), "provenance key 'extra' must be a dict"),
], ids=["wrong type", "missing key", "extra key", "unknown side", "extra not a table"])
def test_bad_provenance_is_one_line(records, tmp_path, edit, message):
    d, _, _ = records
    bad = _provenance_edit(d / "eng.safetensors", tmp_path / "prov.safetensors", edit)
    rc, first, out = run("report", str(d / "ref.safetensors"), str(bad), "-o", str(tmp_path / "r"))
    assert_one_line_error(rc, first, out, str(bad), message)


@pytest.mark.parametrize("mutation,message", [
    ({"pos_index": lambda a: _set(a, 3, 40)}, "position index 40 outside [1, 8]"),
    ({"pos_index": lambda a: _set(a, 0, 0)}, "position index 0 outside [1, 8]"),
    ({"pos_seq": lambda a: _set(a, -1, 9)}, "pos_seq holds a sequence index outside [0, 3)"),
    ({"token_ids": lambda a: a.astype(np.float32)}, "array token_ids has dtype float32, expected int64"),
    ({"actual_rank": lambda a: _set(a, 0, 0)}, "actual-token rank 0; ranks start at 1"),
], ids=["index past the end", "index 0", "sequence index", "float token ids", "rank 0"])
def test_bad_positions_and_arrays_are_one_line(records, tmp_path, mutation, message):
    d, ref, _ = records
    bad = _save(ref, tmp_path / "ref-bad.safetensors", **mutation)
    rc, first, out = run("report", str(bad), str(d / "eng.safetensors"), "-o", str(tmp_path / "r"))
    assert_one_line_error(rc, first, out, str(bad), message)


def test_unwritable_out_is_one_line(records, tmp_path):
    d, _, _ = records
    blocker = tmp_path / "file"
    blocker.write_text("x")
    rc, first, out = run("report", str(d / "ref.safetensors"), str(d / "eng.safetensors"), "-o", str(blocker / "sub"))
    assert_one_line_error(rc, first, out, str(blocker), "--out")


def test_engine_record_with_every_logprob_minus_inf_still_gets_its_report(records, tmp_path):
    """Not a user error: an engine that gives probability 0 everywhere is a hard fail on every position, and
    the report (with its plots) must say so instead of being lost to a log axis with no finite value."""
    d, _, eng = records
    bad = _save(eng, tmp_path / "eng-inf.safetensors", topk_logprobs=lambda a: np.full_like(a, -np.inf),
                actual_logprob=lambda a: np.full_like(a, -np.inf))
    rc, first, out = run("report", str(d / "ref.safetensors"), str(bad), "-o", str(tmp_path / "r"), "--n-boot", "100")
    assert rc == 0 and "Traceback" not in out, out[-3000:]
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    assert rep["engines"][0]["metrics"]["overall"]["hard_fails"] == eng.n_positions
    assert "no finite KL_part" not in (tmp_path / "r" / "report.md").read_text()   # the text goes in the PNG
    assert (tmp_path / "r" / "report.html").stat().st_size > 10_000


def _panel_dir(tmp_path: Path, lines: list[str]) -> Path:
    d = tmp_path / "panel"
    d.mkdir()
    (d / "p-1.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    items = parse_jsonl(d / "p-1.jsonl")
    (d / "p-1.manifest.json").write_text(json.dumps({"name": "p", "version": 1, "file": "p-1.jsonl",
                                                      "content_hash": content_hash(items)}))
    return d / "p-1.manifest.json"


def _first_panel_lines(n: int = 2) -> list[str]:
    return (PANEL_DATA / "default-1.jsonl").read_text(encoding="utf-8").split("\n")[:n]


def test_panel_text_with_a_lone_surrogate_and_a_non_utf8_manifest_are_one_line(tmp_path):
    manifest = _panel_dir(tmp_path, _first_panel_lines())
    rc, first, out = run("panel", "show", str(manifest))
    assert rc == 0, out[-2000:]
    items = manifest.parent / "p-1.jsonl"
    lines = items.read_text().split("\n")
    obj = json.loads(lines[0])
    lines[0] = json.dumps(obj).replace('"text": "', '"text": "\\ud800', 1)
    items.write_text("\n".join(lines))
    rc, first, out = run("panel", "show", str(manifest))
    assert_one_line_error(rc, first, out, f"{items}:1", "lone surrogate escape (\\ud800)")
    manifest.write_bytes(b'{"name": "p\xff"}')
    rc, first, out = run("panel", "show", str(manifest))
    assert_one_line_error(rc, first, out, str(manifest), "manifest is not UTF-8")


def test_a_damaged_spill_file_names_restart(tmp_path):
    f = tmp_path / "stage-3.acts"
    f.write_bytes(b"\0" * 64)
    with pytest.raises(SpillError) as info:
        StageReader.open_verified(f, [], "0" * 64)
    assert isinstance(info.value, UserError)
    assert "run the same command with --restart" in str(info.value).split("\n")[0]
    with pytest.raises(SpillError, match="--restart"):
        StageReader.open_verified(tmp_path / "gone.acts", [], "0" * 64)


# ----------------------------------------------------------------------------- --engine-url answers
KL_GATE = ("import pytest\npytestmark = [pytest.mark.gate, pytest.mark.engine]\n"
           "from gates.test_kl_panel import test_kl_panel_per_domain  # the real gate\n")
MODEL = "fake-smollm2"


def _reference_file(tmp_path: Path) -> Path:
    path = tmp_path / "reference.safetensors"
    exact_reference(plain_sequences()).save(path)
    return path


@pytest.mark.parametrize("models,message", [
    (Canned(200, "<html><body>nginx</body></html>", "text/html"), "/v1/models did not answer JSON (content-type 'text/html')"),
    (Canned(200, [{"id": "m"}]), "/v1/models is not an OpenAI model list"),
    (Canned(200, {"data": [{"name": "m"}]}), "/v1/models is not an OpenAI model list"),
    (Canned(401, {"error": "no key"}), "answered HTTP 401 (set DS41_ENGINE_API_KEY"),
    (None, "no engine answers at"),
], ids=["HTML", "JSON list", "no ids", "401", "dead URL"])
def test_engine_url_that_is_not_an_openai_server_is_one_line(tmp_path, models, message):
    with CannedServer() as srv:
        if models is not None:
            srv.routes["/v1/models"] = lambda r: models
            url = srv.url
        else:
            url = "http://127.0.0.1:9"           # nothing listens on the discard port
        s = run_gate_session(tmp_path, KL_GATE, reference=_reference_file(tmp_path), engine_url=url, timeout=120)
    assert s.returncode == 2, s.output[-3000:]
    errors = [ln for ln in s.output.split("\n") if "error: --engine-url" in ln]
    assert len(errors) == 1 and message in errors[0], s.output[-3000:]
    assert "Traceback" not in s.output and len(s.output.split("\n")) < 40


# ============================================================================= 4. line splitting
# str.splitlines() also breaks at \x0b \x0c \x1c \x1d \x1e, but JSON must escape those inside strings (json.dumps
# does), so only these three can appear raw in a valid panel line
@pytest.mark.parametrize("char", ["\u2028", "\u2029", "\u0085"], ids=["U+2028", "U+2029", "NEL"])
def test_panels_with_characters_json_allows_raw_are_accepted(tmp_path, char):
    obj = json.loads(_first_panel_lines(1)[0])
    obj["text"] = f"before{char}after " + obj["text"]
    line = json.dumps(obj, ensure_ascii=False)
    assert char in line                               # raw in the file, as JSON allows
    manifest = _panel_dir(tmp_path, [line, _first_panel_lines(2)[1]])
    rc, first, out = run("panel", "show", str(manifest))
    assert rc == 0 and "Traceback" not in out, out[-2000:]
    items = parse_jsonl(manifest.parent / "p-1.jsonl")
    assert len(items) == 2 and items[0].text.startswith(f"before{char}after")


def test_no_jsonl_reader_splits_with_splitlines():
    """Every reader of JSONL or panel data splits on "\\n" (str.splitlines breaks valid JSON strings)."""
    offenders = []
    for path in [*REPO.glob("core/**/*.py"), *REPO.glob("panels/**/*.py"), *REPO.glob("reports/**/*.py"),
                 *REPO.glob("oracle/**/*.py"), *REPO.glob("engine/**/*.py"), *REPO.glob("ds41gates/**/*.py")]:
        for n, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
            if ".splitlines()" in line.split("#")[0] and ("jsonl" in line.lower() or "read_text" in line):
                offenders.append(f"{path.relative_to(REPO)}:{n}")
    assert not offenders, offenders


# ============================================================================= 5. secrets
SECRET = "sk-hardening-0123456789abcdef"


@pytest.mark.parametrize("credentials", [False, True], ids=["API key echoed", "URL user:password@"])
def test_engine_that_echoes_the_key_or_url_credentials_never_reach_a_file(tmp_path, credentials):
    import base64

    with CannedServer() as srv:
        serve_vllm(srv, MODEL)
        srv.routes["/v1/completions"] = lambda r: Canned(
            400, {"error": {"message": f"bad request from {r.headers.get('authorization')}"}})
        url = srv.url.replace("http://", "http://admin:hunter2pass@") if credentials else srv.url
        s = run_gate_session(tmp_path, KL_GATE, reference=_reference_file(tmp_path), engine_url=url,
                             env=gate_session_env({"DS41_ENGINE_API_KEY": SECRET}), timeout=120)
        echoed = srv.requests_to("/v1/completions")
    assert echoed, s.output[-3000:]
    sent = echoed[0].headers["authorization"]
    out = s.outcome("test_kl_panel_per_domain")
    assert out["outcome"] == "error" and "bad request from " in out["detail"], out
    if credentials:     # httpx turns URL credentials into Basic auth; the engine echoes that token
        assert sent == "Basic " + base64.b64encode(b"admin:hunter2pass").decode()
        assert "bad request from Basic <redacted>" in out["detail"] and "http://<redacted>@127.0.0.1" in out["detail"]
    else:
        assert sent == f"Bearer {SECRET}"                      # the key reached the engine, and only the engine
        assert "bad request from Bearer <redacted>" in out["detail"]
    for secret in (SECRET, "hunter2pass", base64.b64encode(b"admin:hunter2pass").decode()):
        assert files_containing([s.results_dir], secret) == [], secret
        assert secret not in s.output, secret


def test_launcher_health_probe_sends_the_servers_key(tmp_path):
    """A key-protected server (VLLM_API_KEY in its env, as vLLM reads it) answers /v1/models only with the key:
    the probe sends it, so the start succeeds instead of 401-ing until the timeout."""
    from engine.launcher import EngineServer
    from engine.profiles import Profile

    server_py = tmp_path / "keyed.py"
    server_py.write_text(
        "import http.server, json, os, sys\n"
        "key = os.environ['VLLM_API_KEY']\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        ok = self.headers.get('Authorization') == f'Bearer {key}'\n"
        # the hit is on disk before the answer goes out: the launcher stops the server as soon as a 200 arrives
        "        with open(sys.argv[2], 'a') as f: f.write(('ok' if ok else 'denied') + '\\n')\n"
        "        body = json.dumps({'data': [{'id': 'm'}]} if ok else {'error': 'no key'}).encode()\n"
        "        self.send_response(200 if ok else 401)\n"
        "        self.send_header('content-length', str(len(body)))\n"
        "        self.end_headers()\n"
        "        self.wfile.write(body)\n"
        "    def log_message(self, *a):\n"
        "        pass\n"
        "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n")
    hits = tmp_path / "hits"
    lines: list[str] = []
    prof = Profile(name="keyed", command=(sys.executable, str(server_py), "{port}", str(hits)), served_model="m",
                   env={"VLLM_API_KEY": SECRET}, start_timeout_s=30, stop_grace_s=2,
                   health_url="http://127.0.0.1:{port}/v1/models", log_file=str(tmp_path / "log.txt"))
    srv = EngineServer(prof, echo=lines.append)
    srv.start()
    try:
        assert srv.api_key == SECRET
    finally:
        srv.stop()
    assert hits.read_text().split() == ["ok"]                 # one probe, with the key, answered 200
    assert any("healthy after" in ln for ln in lines), lines
    assert all(SECRET not in ln for ln in lines)
    assert SECRET not in (tmp_path / "log.txt").read_text()


def test_redaction_covers_env_keys_registered_keys_and_url_credentials(monkeypatch):
    from core.redact import REDACTED, redact, redact_data, register_secret

    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijkl")
    monkeypatch.setenv("MY_SERVICE_KEY", "svc-key-998877")
    monkeypatch.setenv("TOKENIZER_PATH", "/models/tok")                 # not a secret by name
    register_secret("cli-given-key-42")
    text = ("hf_abcdefghijkl svc-key-998877 cli-given-key-42 /models/tok "
            "https://bob:pa55word@host:8000/v1 http://token123@h/x")
    got = redact(text)
    assert got == (f"{REDACTED} {REDACTED} {REDACTED} /models/tok https://{REDACTED}@host:8000/v1 "
                   f"http://{REDACTED}@h/x")
    assert redact_data({"a": ["x hf_abcdefghijkl"], "hf_abcdefghijkl": 1}) == {"a": [f"x {REDACTED}"], REDACTED: 1}


# ============================================================================= 6. misleading messages
def test_corrupt_reference_is_named_as_the_reference(records, tmp_path):
    from core.metrics import score_panel

    _, ref, eng = records
    import copy

    bad = copy.copy(ref)
    bad.topk_logprobs = np.array(ref.topk_logprobs)
    bad.topk_logprobs[0, 0] = 2.0
    with pytest.raises(RecordError) as info:
        score_panel(bad, [("eng", eng)], n_boot=100)
    assert str(info.value).startswith("reference record: ")
    assert "engine record" not in str(info.value)


def test_truncated_cached_reference_says_delete_to_rebuild(records, tmp_path, monkeypatch):
    from ds41gates import pipeline
    import oracle.hf

    d, _, _ = records
    cached = tmp_path / "cached.safetensors"
    cached.write_bytes((d / "ref.safetensors").read_bytes()[:-500])
    monkeypatch.setattr(pipeline, "reference_path", lambda *a, **k: cached)
    monkeypatch.setattr(oracle.hf, "model_hash", lambda model_dir: "sha256:x")
    with pytest.raises(RecordError) as info:
        pipeline.ensure_reference(object(), tmp_path)
    assert f"delete it to rebuild: rm {cached}" in str(info.value)


def test_config_without_n_layers_names_n_layers_not_a_compress_ratio_count():
    cfg = {k: (list(v) if isinstance(v, tuple) else v) for k, v in ModelConfig.tiny().__dict__.items() if k != "extra"}
    cfg.pop("n_layers")
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dict(cfg)
    assert "n_layers" in str(info.value) and "compress_ratios" not in str(info.value)


# ============================================================================= 7. newcomer friction
def test_help_shows_no_bool_placeholder():
    for cmd in (["--help"], ["report", "--help"], ["panel", "list", "--help"], ["demo", "--help"]):
        rc, first, out = run(*cmd, env={"COLUMNS": "200"})
        assert rc == 0 and "<bool>" not in out, (cmd, out)


def test_launcher_progress_is_echoed_while_the_engine_starts(tmp_path, monkeypatch):
    from engine import launcher, profiles

    monkeypatch.setattr(launcher, "PROGRESS_EVERY_S", 0.5)
    lines: list[str] = []
    prof = profiles.Profile(name="slow", command=(sys.executable, "-c", "import time; time.sleep(30)"),
                            start_timeout_s=2.2, stop_grace_s=1, health_url="http://127.0.0.1:{port}/v1/models",
                            log_file=str(tmp_path / "log.txt"))
    with pytest.raises(launcher.EngineStartError):
        launcher.EngineServer(prof, echo=lines.append).start()
    progress = [ln for ln in lines if "still starting" in ln]
    assert len(progress) >= 2, lines


def test_engine_url_without_reference_is_refused_for_another_model(tmp_path):
    with CannedServer() as srv:
        serve_vllm(srv, "some-other-model")
        cmd = [sys.executable, "-m", "pytest", "-p", "ds41gates.pytest_plugin", "-p", "no:cacheprovider", "-q",
               str(tmp_path / "test_s.py"), "--engine-url", srv.url, "--results", str(tmp_path / "res")]
        (tmp_path / "test_s.py").write_text(KL_GATE)
        r = subprocess.run(cmd, cwd=REPO, env=gate_session_env(), capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    assert "ds41-gates WARNING: --engine-url without --reference" in out
    assert "serves ['some-other-model'], not the embedded default model 'smollm2'" in out


def test_every_input_error_class_is_a_user_error():
    """The CLI's one handler (ds41gates.cli.main) prints a UserError as one line with exit 2; an input error
    class outside that family would print a traceback instead."""
    from engine.kernels.registry import RegistryError
    from nightly.flags import FlagRegistryError
    from nightly.runner import NightlyConfigError
    from oracle.scoring import OracleError

    for cls in (RegistryError, FlagRegistryError, NightlyConfigError, OracleError, RecordError, BandsError,
                ConfigError, SpillError):
        assert issubclass(cls, UserError), cls


@pytest.mark.parametrize("text,message", [
    ('[nightly.regression]\nmargin_rel = inf\n[[cells]]\nprofile = "vllm-cpu-fp32"\n',
     "nightly.regression.margin_rel must be a number >= 0, got inf"),
    ('[nightly]\ncell_timout_s = 60\n[[cells]]\nprofile = "vllm-cpu-fp32"\n', "unknown [nightly] key(s)"),
    ('[[cells]]\nprofile = "vllm-cpu-fp32"\nflags = ["no_such_flag"]\n', "unknown flag(s) ['no_such_flag']"),
], ids=["infinite margin", "misspelled key", "unknown flag"])
def test_bad_nightly_configs_exit_2_with_one_line(tmp_path, text, message):
    path = tmp_path / "nightly.toml"
    path.write_text(text)
    rc, first, out = run("nightly", str(path), "--dry-run")
    assert_one_line_error(rc, first, out, str(path), message)
