"""engine.launcher / engine.profiles / engine.supervise: profiles, placeholders, and that no server process is
ever left behind.

The process-group tests use a tiny real HTTP server (written to tmp_path) that also spawns a child,
so "the whole group is gone" is checked on more than the leader. Tests marked `engine` start the
real vLLM CPU and llama-cpp-python servers and check the engines.md §12.7 canary values.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from engine import launcher, profiles
from engine.launcher import EngineServer, EngineStartError, resolve
from engine.profiles import ProfileError, load_profile, parse_profile
from engine.supervise import group_members

REPO = Path(__file__).resolve().parents[2]

FAKE_SERVER = textwrap.dedent(
    '''
    """A stand-in engine: an HTTP server with /v1/models that also spawns a child process."""
    import argparse, http.server, json, os, signal, subprocess, sys, time

    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--pidfile", required=True)
    ap.add_argument("--mode", default="ok", choices=["ok", "die", "slow", "stubborn-child"])
    a = ap.parse_args()

    child_code = "import time; time.sleep(600)"
    ready = a.pidfile + ".child-ready"
    if a.mode == "stubborn-child":
        child_code = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                      "open(sys.argv[1], 'w').close(); time.sleep(600)")
    child = subprocess.Popen([sys.executable, "-c", child_code, ready])
    if a.mode == "stubborn-child":  # serve only once the child really ignores SIGTERM
        while not os.path.exists(ready):
            time.sleep(0.01)
    with open(a.pidfile + ".tmp", "w") as f:
        json.dump({"leader": os.getpid(), "child": child.pid, "pgid": os.getpgid(0)}, f)
    os.replace(a.pidfile + ".tmp", a.pidfile)
    print("fake server starting, mode", a.mode, flush=True)
    if a.mode == "die":
        print("fatal: boom at start (fake engine)", flush=True)
        sys.exit(3)
    if a.mode == "slow":
        time.sleep(600)

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/v1/models":
                body = json.dumps({"object": "list", "data": [{"id": "fake"}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            else:
                self.send_error(404)
        def log_message(self, *args):
            pass

    http.server.HTTPServer(("127.0.0.1", a.port), H).serve_forever()
    '''
)

# A parent started from a background shell inherits SIGINT ignored (and Python then keeps it
# ignored); the drivers restore the interactive defaults so the test means the same everywhere.
RESET_SIGNALS = (
    "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "signal.signal(signal.SIGTERM, signal.SIG_DFL)\n"
)

DRIVER = RESET_SIGNALS + textwrap.dedent(
    '''
    import sys, time
    from engine.launcher import EngineServer
    with EngineServer(sys.argv[1]) as srv:
        print("READY", srv.pid, flush=True)
        time.sleep(600)
    '''
)


def _write_profile(tmp_path: Path, mode: str = "ok", **extra: object) -> Path:
    (tmp_path / "fake_server.py").write_text(FAKE_SERVER)
    fields: dict[str, object] = {
        "name": f"fake-{mode}",
        "engine": "vllm",
        "served_model": "fake",
        "command": ["{python}", "{profile_dir}/fake_server.py"],
        "args": ["--port", "{port}", "--pidfile", "{profile_dir}/pids.json", "--mode", mode],
        "log_file": "{profile_dir}/server.log",
        "start_timeout_s": 120,  # generous: the shared 2-core box can be loaded 10x over
        "stop_grace_s": 5,
        **extra,
    }
    lines = [f"{key} = {json.dumps(value)}" for key, value in fields.items()]
    path = tmp_path / f"fake-{mode}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _pids(tmp_path: Path, timeout: float = 120.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    f = tmp_path / "pids.json"
    while not f.exists():
        assert time.monotonic() < deadline, f"fake server never wrote {f}"
        time.sleep(0.05)
    return json.loads(f.read_text())


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def _assert_all_gone(pids: dict[str, int]) -> None:
    assert group_members(pids["pgid"]) == []
    assert not _alive(pids["leader"]), f"leader {pids['leader']} still running"
    assert not _alive(pids["child"]), f"child {pids['child']} still running"


def _kill_leftovers(tmp_path: Path) -> None:
    """After a failed driver test: never leave the fake server behind (the test has failed already)."""
    f = tmp_path / "pids.json"
    if f.exists():
        pgid = json.loads(f.read_text())["pgid"]
        if group_members(pgid):
            os.killpg(pgid, signal.SIGKILL)


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        return json.loads(resp.read())


# ---------------------------------------------------------------------------------- profiles


def test_shipped_profiles_resolve_to_the_documented_commands() -> None:
    assert set(profiles.available_profiles()) >= {
        "vllm-cpu-fp32", "vllm-cpu-bf16", "llamacpp-f32", "llamacpp-q4_1"
    }
    fake = {
        name: (lambda n=name: f"<{n}>")
        for name in ("vllm_python", "llama_python", "model_hf_dir", "gguf_f32", "gguf_q4_1", "cache", "stamp")
    }
    for dtype, name in (("float32", "vllm-cpu-fp32"), ("bfloat16", "vllm-cpu-bf16")):
        spec = resolve(load_profile(name), providers=fake)
        argv = list(spec.argv)
        assert argv[:3] == ["<vllm_python>", "-m", "vllm.entrypoints.openai.api_server"]
        assert argv[argv.index("--model") + 1] == "<model_hf_dir>"
        assert argv[argv.index("--dtype") + 1] == dtype
        assert argv[argv.index("--max-model-len") + 1] == "2048"
        assert argv[argv.index("--served-model-name") + 1] == "smollm2"
        assert argv[argv.index("--max-logprobs") + 1] == "100"
        assert "--enable-prompt-tokens-details" in argv
        assert argv[argv.index("--port") + 1] == str(spec.port) and spec.port > 0
        assert spec.env["HF_HUB_OFFLINE"] == "1" and spec.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
        assert spec.health_url == f"http://127.0.0.1:{spec.port}/v1/models"
        assert spec.log_path == Path(f"<cache>/logs/{name}-<stamp>.log")
        assert spec.served_model == "smollm2"
    for gguf, name in (("<gguf_f32>", "llamacpp-f32"), ("<gguf_q4_1>", "llamacpp-q4_1")):
        argv = list(resolve(load_profile(name), providers=fake).argv)
        assert argv[:3] == ["<llama_python>", "-m", "llama_cpp.server"]
        assert argv[argv.index("--model") + 1] == gguf
        assert argv[argv.index("--n_ctx") + 1] == "2048"
        assert argv[argv.index("--model_alias") + 1] == "smollm2"


def test_placeholders_flags_and_overrides() -> None:
    prof = parse_profile(
        {
            "command": ["{python}", "-c", "pass"],
            "args": ["--cfg", '{"level": 0}', "--port={port}"],
            "env": {"VLLM_DS41_A": "{profile}-x"},   # an allow-listed name (engine/environment.py)
            "port": 4567,
            "flags": {"FAST": {"env": {"VLLM_DS41_FAST": "1"}, "args": ["--fast"]}},
        },
        default_name="p",
    )
    spec = resolve(prof, flags=["FAST"])
    assert spec.argv == (sys.executable, "-c", "pass", "--cfg", '{"level": 0}', "--port=4567", "--fast")
    assert spec.env == {"VLLM_DS41_A": "p-x", "VLLM_DS41_FAST": "1"}
    assert resolve(prof).env == {"VLLM_DS41_A": "p-x"}
    with pytest.raises(ProfileError, match=r"no flag\(s\) \['SLOW'\].*\['FAST'\]"):
        resolve(prof, flags=["SLOW"])
    bad = parse_profile({"command": ["x"], "args": ["{nope}"]}, default_name="bad")
    with pytest.raises(ProfileError, match=r"'bad'.*\{nope\} in args"):
        resolve(bad)
    moved = prof.with_overrides({"port": 9999, "extra_args": ["--more"], "extra_env": {"B": "2"}})
    assert moved.port == 9999 and moved.args[-1] == "--more" and moved.env == {"VLLM_DS41_A": "{profile}-x", "B": "2"}
    with pytest.raises(ProfileError, match="unknown override"):
        prof.with_overrides({"prot": 1})


def test_profile_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="no engine profile 'does-not-exist'.*vllm-cpu-fp32"):
        load_profile("does-not-exist")
    p = tmp_path / "broken.toml"
    p.write_text('command = ["x"]\nportt = 3\n')
    with pytest.raises(ProfileError, match=r"broken\.toml: unknown key\(s\) \['portt'\]"):
        load_profile(p)
    p.write_text("command = [\n")
    with pytest.raises(ProfileError, match="broken.toml: cannot read engine profile: not valid TOML"):
        load_profile(p)
    p.write_text('command = []\n')
    with pytest.raises(ProfileError, match="'command' is required"):
        load_profile(p)


def test_missing_engine_venv_names_the_setup_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DS41_CACHE", str(tmp_path))
    with pytest.raises(ProfileError, match="setup-vllm.sh"):
        resolve(load_profile("vllm-cpu-fp32"))
    with pytest.raises(ProfileError, match="setup-llamacpp.sh"):
        resolve(load_profile("llamacpp-q4_1"))


# ---------------------------------------------------------------------------------- process groups


def test_start_serve_stop_leaves_nothing(tmp_path: Path) -> None:
    profile = _write_profile(tmp_path)
    with EngineServer(str(profile)) as srv:
        pids = _pids(tmp_path)
        assert pids["pgid"] == pids["leader"] == srv.pid
        assert sorted(group_members(srv.pid)) == sorted([pids["leader"], pids["child"]])
        assert _get(srv.base_url + "/v1/models")["data"][0]["id"] == "fake"
        assert srv.served_model == "fake"
        assert srv.start_seconds is not None and srv.start_seconds < 120
    _assert_all_gone(pids)
    log = (tmp_path / "server.log").read_text()
    assert "fake server starting" in log and "# argv:" in log
    srv.stop()  # a second stop is a no-op


def test_exception_inside_with_stops_the_group(tmp_path: Path) -> None:
    profile = _write_profile(tmp_path)
    with pytest.raises(RuntimeError, match="test failure inside the with"):
        with EngineServer(str(profile)):
            pids = _pids(tmp_path)
            raise RuntimeError("test failure inside the with")
    _assert_all_gone(pids)


def test_keyboard_interrupt_inside_with_stops_the_group(tmp_path: Path) -> None:
    profile = _write_profile(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        with EngineServer(str(profile)):
            pids = _pids(tmp_path)
            raise KeyboardInterrupt
    _assert_all_gone(pids)


def test_sigterm_ignoring_child_is_killed_after_grace(tmp_path: Path) -> None:
    profile = _write_profile(tmp_path, mode="stubborn-child", stop_grace_s=1)
    with EngineServer(str(profile)):
        pids = _pids(tmp_path)
        t0 = time.monotonic()
    assert time.monotonic() - t0 >= 0.9  # waited out the grace period before SIGKILL
    _assert_all_gone(pids)


def test_server_dying_at_start_reports_exit_code_and_log_tail(tmp_path: Path) -> None:
    profile = _write_profile(tmp_path, mode="die")
    with pytest.raises(EngineStartError) as err:
        with EngineServer(str(profile)):
            pytest.fail("the with body must not run when the server dies at start")
    msg = str(err.value)
    assert "'fake-die' exited with code 3" in msg
    assert "fatal: boom at start (fake engine)" in msg
    assert str(tmp_path / "server.log") in msg
    _assert_all_gone(_pids(tmp_path))


def test_server_never_healthy_times_out_and_is_stopped(tmp_path: Path) -> None:
    profile = _write_profile(tmp_path, mode="slow", start_timeout_s=3)
    srv = EngineServer(str(profile))
    t0 = time.monotonic()
    with pytest.raises(EngineStartError, match=r"'fake-slow' not healthy after 3 s") as err:
        srv.start()
    assert time.monotonic() - t0 < 60
    assert str(tmp_path / "server.log") in str(err.value)
    assert "/v1/models" in str(err.value)
    assert group_members(srv.pid) == []  # whatever had been spawned by then is gone
    pidfile = tmp_path / "pids.json"
    if pidfile.exists():  # the server got as far as spawning its child before the timeout
        _assert_all_gone(json.loads(pidfile.read_text()))


def test_missing_executable_is_a_start_error(tmp_path: Path) -> None:
    prof = parse_profile(
        {"command": [str(tmp_path / "no-such-engine")], "log_file": str(tmp_path / "x.log")}, default_name="ghost"
    )
    with pytest.raises(EngineStartError, match="'ghost': cannot run"):
        EngineServer(prof).start()


def test_port_in_use_is_refused(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        profile = _write_profile(tmp_path)
        with pytest.raises(EngineStartError, match=f"port 127.0.0.1:{port} is already in use"):
            EngineServer(str(profile), overrides={"port": port}).start()
    assert not (tmp_path / "pids.json").exists()


def _run_driver(tmp_path: Path, profile: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(profile)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    return proc


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_to_parent_stops_the_group(tmp_path: Path, sig: int) -> None:
    profile = _write_profile(tmp_path)
    proc = _run_driver(tmp_path, profile)
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY"), (line, proc.stderr.read() if proc.poll() is not None else "")
        pids = _pids(tmp_path)
        assert _alive(pids["child"])
        proc.send_signal(sig)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            _kill_leftovers(tmp_path)
    if sig == signal.SIGTERM:
        assert rc == -signal.SIGTERM  # the safety net re-raises the signal after cleaning up
    else:
        assert rc != 0 and "KeyboardInterrupt" in proc.stderr.read()
    _assert_all_gone(pids)


def test_sigint_while_starting_stops_the_group(tmp_path: Path) -> None:
    profile = _write_profile(tmp_path, mode="slow")
    proc = _run_driver(tmp_path, profile)
    try:
        pids = _pids(tmp_path)  # the server is up but never healthy: the parent is in start()
        assert _alive(pids["child"])
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            _kill_leftovers(tmp_path)
    assert rc != 0
    _assert_all_gone(pids)


ATEXIT_DRIVER = RESET_SIGNALS + textwrap.dedent(
    '''
    import sys
    from engine.launcher import EngineServer
    srv = EngineServer(sys.argv[1]).start()  # never stopped by the script itself
    print("READY", srv.pid, flush=True)
    sys.stdin.readline()
    sys.exit(0)
    '''
)


def test_interpreter_exit_without_stop_still_stops_the_group(tmp_path: Path) -> None:
    profile = _write_profile(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-c", ATEXIT_DRIVER, str(profile)],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY"), line
        pids = _pids(tmp_path)
        assert _alive(pids["child"])
        proc.stdin.close()  # the script returns; only the atexit hook can stop the server now
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            _kill_leftovers(tmp_path)
    assert rc == 0, proc.stderr.read()
    _assert_all_gone(pids)


def test_session_server_is_shared_then_stopped(tmp_path: Path) -> None:
    profile = str(_write_profile(tmp_path))
    try:
        a = launcher.session_server(profile)
        b = launcher.session_server(profile)
        assert a is b and a.running()
        pids = _pids(tmp_path)
    finally:
        launcher.stop_session_servers()
    _assert_all_gone(pids)


# ---------------------------------------------------------------------------------- real engines

CANARY = "The capital of France is"
CANARY_IDS = [504, 3575, 282, 4649, 314]


def _require_venv(name: str, script: str) -> None:
    from core.paths import cache_dir

    if not (cache_dir() / "venvs" / name / ".ds41-ready").exists():
        pytest.skip(f"{name} not set up under the cache; run scripts/{script}")


def _post(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


@pytest.mark.engine
@pytest.mark.timeout(1500)
def test_vllm_cpu_fp32_serves_the_reference_logprobs(engine_endpoint) -> None:
    """On the session's vllm-cpu-fp32 server (the plugin's, launched from the profile by this launcher and shared
    with the gate suite: one vLLM launch fewer in CI). A real vLLM's process group leaving nothing behind on stop
    is held by tests/reliability/test_reliability_vllm_session.py::test_no_server_process_left."""
    _require_venv(launcher.VLLM_VENV, "setup-vllm.sh")
    if engine_endpoint.profile != "vllm-cpu-fp32":
        pytest.skip(f"the session engine is {engine_endpoint.profile!r}, not vllm-cpu-fp32")
    models = _get(engine_endpoint.base_url + "/v1/models")
    assert [m["id"] for m in models["data"]] == ["smollm2"]
    resp = _post(
        engine_endpoint.base_url + "/v1/completions",
        {"model": "smollm2", "prompt": CANARY_IDS, "max_tokens": 1, "temperature": 0,
         "prompt_logprobs": 5, "logprobs": 5},
    )
    choice = resp["choices"][0]
    pl = choice["prompt_logprobs"]
    assert pl[0] is None
    assert pl[1]["3575"]["logprob"] == pytest.approx(-11.5393, abs=1e-4)
    assert pl[1]["3575"]["rank"] == 2923
    assert pl[3]["4649"]["logprob"] == pytest.approx(-2.4387, abs=1e-4)
    nxt = choice["logprobs"]["top_logprobs"][0]
    assert nxt[" Paris"] == pytest.approx(-0.2581, abs=1e-4)


@pytest.mark.engine
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "profile,tol", [("llamacpp-f32", 2e-3), ("llamacpp-q4_1", None)], ids=["f32", "q4_1"]
)
def test_llamacpp_serves_echo_logprobs(profile: str, tol: float | None) -> None:
    _require_venv(launcher.LLAMA_VENV, "setup-llamacpp.sh")
    with EngineServer(profile) as srv:
        pgid = srv.pid
        assert [m["id"] for m in _get(srv.base_url + "/v1/models")["data"]] == ["smollm2"]
        toks = _post(srv.base_url + "/extras/tokenize", {"input": CANARY})
        resp = _post(
            srv.base_url + "/v1/completions",
            {"model": "smollm2", "prompt": CANARY, "max_tokens": 1, "temperature": 0,
             "echo": True, "logprobs": 5},
        )
    assert group_members(pgid) == []
    assert toks["tokens"] == CANARY_IDS
    lp = resp["choices"][0]["logprobs"]
    # llama-cpp-python 0.3.36 echo is shifted by one (abetlen/llama-cpp-python#1983, llama.py
    # _create_completion pairs token i with the logits computed *after* token i): top_logprobs[i] is
    # the distribution of position i+1, token_logprobs[i] is token i scored under it, the
    # distribution of position 1 is lost, and the generated token is dropped. These asserts pin
    # that behaviour so an upgrade that fixes it fails here and the adapter gets revisited.
    assert lp["tokens"] == ["The", " capital", " of", " France", " is"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    top = lp["top_logprobs"]
    best = [max(d, key=d.get) for d in top[1:]]
    assert best == [" of", " the", " is", " Paris"]
    paris = top[4][" Paris"]
    if tol is None:  # the quantized subject: the same answer, not the same numbers
        assert -1.0 < paris < 0.0
        assert top[1][" of"] == pytest.approx(-0.3376, abs=0.3)
    else:
        assert top[1][" of"] == pytest.approx(-0.3376, abs=tol)  # reference position 2
        assert top[2][" France"] == pytest.approx(-2.4387, abs=tol)  # reference position 3
        assert top[3][" is"] == pytest.approx(-0.4510, abs=tol)  # reference position 4
        assert paris == pytest.approx(-0.2581, abs=tol)  # reference next token
