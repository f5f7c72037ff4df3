"""Issue 35, part B: the engine's environment, what configuration may put into it, and the fault injector.

1. Leak #4: a launched engine (a real llama-server, else a real vLLM CPU server) gets only the documented base of
   the harness's environment plus its profile's entries: the harness's keys and tokens are not in
   /proc/<pid>/environ of any process of its group (tests/reliability/test_secret_canary.py greps the same
   for every form of the canaries).
2. The allow-list (engine/environment.py) for a profile's [env], a flag's env, a nightly cell's env and
   --engine-env: loader and interpreter variables refused naming file, key and value; PYTHONPATH only to tracked
   source folders (not results/, not an untracked folder, not a tracked folder with a planted untracked module).
3. --engine-env over a profile: a conflict refused naming both values; PYTHONPATH merged, and said so;
   `ds41gate localize --engine-profile vllm-cpu-dsv4 --engine-env PYTHONPATH=x`: one clear line, no traceback.
4. Leak #5: an environment written into a record is redacted by key as well as by value.
5. Leak #6: every query value and any userinfo of a URL are redacted unless allow-listed; host and path kept.
6. The fault injector (DS41_PERTURB_*) cannot touch a gate run: a real gate session on vLLM with it in its
   environment refuses before anything is claimed or launched, naming it; the nightly refuses it likewise; a
   profile, a flag and a cell cannot carry it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core import redact as R
from engine import launcher, profiles, supervise
from engine.launcher import EngineServer
from engine.profiles import load_profile
from engine.profiles import ProfileError, parse_profile
from tests.reliability.helpers import REPO, gate_session_env

# harness secrets a launched engine must never see (the names as CI, cloud SDKs and the harness use them)
CANARY_NAMES = ("DS41_ENGINE_API_KEY", "HF_TOKEN", "OPENAI_API_KEY", "AWS_SECRET_ACCESS_KEY", "GITHUB_TOKEN",
                "CI_JOB_TOKEN", "AZURE_CLIENT_SECRET", "GOOGLE_APPLICATION_CREDENTIALS")
NOT_SECRET_BUT_NOT_BASE = ("DS41_PERTURB_LAYER", "OPENSSL_CONF", "VIRTUAL_ENV", "PYTHONSTARTUP")
# the documented base (engine/environment.py's docstring), stated here independently of the code under test
DOCUMENTED_BASE = {"PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TERM", "OMP_NUM_THREADS",
                   "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES",
                   "CUBLAS_WORKSPACE_CONFIG"}


class _LazyEnvironmentModule:
    """engine.environment, imported when a test first uses it (so the tests of behaviour run, and fail for the
    behaviour, on a tree that does not have the module yet)."""

    def __getattr__(self, name):
        from engine import environment

        return getattr(environment, name)


E = _LazyEnvironmentModule()


def _environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)   # type: ignore[misc]


def _require_engine(name: str) -> None:
    ready = {"llama-server-f32": launcher._cache() / "engines" / launcher.LLAMA_SERVER_DIR / ".ds41-ready",
             "vllm-cpu-fp32": launcher._cache() / "venvs" / launcher.VLLM_VENV / ".ds41-ready"}[name]
    if not ready.exists():
        pytest.skip(f"{name}: {ready.parent} not set up (scripts/setup.sh)")


# ================================================================================ 1. a launched engine's environ

@pytest.mark.engine
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["llama-server-f32",
                                  pytest.param("vllm-cpu-fp32", marks=pytest.mark.long)])   # vLLM: its engine core too
def test_a_launched_engine_gets_the_base_and_its_profile_env_and_no_harness_secret(monkeypatch, tmp_path, name):
    tag = os.urandom(6).hex()
    canaries = {name: f"canary-{name.lower()}-{tag}" for name in CANARY_NAMES + NOT_SECRET_BUT_NOT_BASE}
    canaries["DS41_PERTURB_LAYER"] = "3"
    for k, v in canaries.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("LC_CTYPE", "C.UTF-8")          # base: inherited
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        # torch's inductor writes its default cache dir into os.environ of whichever process imports it — this
        # harness (an earlier test) and vLLM's engine core alike, the same path: a harness value of its own keeps
        # an engine's own default from reading as inherited, and an inherited value still shows
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", f"{os.environ['TORCHINDUCTOR_CACHE_DIR']}-harness-{tag}")
    _require_engine(name)
    prof = load_profile(name)
    srv = EngineServer(prof, echo=lambda m: None, overrides={"log_file": str(tmp_path / "engine.log")})
    with srv:
        members = supervise.group_members(srv.pid)
        environs = {pid: _environ_of(pid) for pid in members}
    assert environs, "no process of the engine's group to read"
    allowed = DOCUMENTED_BASE | set(prof.env) | set(getattr(prof, "inherit_env", ()))
    for pid, env in environs.items():
        names = {k.decode() for k in env}
        extra = sorted(n for n in names if n not in allowed and not n.startswith("LC_"))
        # what the engine itself adds to its children's environment is its own business; from the harness
        # nothing besides the base and the profile
        inherited = [n for n in extra if os.environ.get(n) is not None and env[n.encode()].decode() == os.environ[n]]
        assert inherited == [], f"{name} pid {pid} inherited {inherited} from the harness"
        blob = b"\0".join(k + b"=" + v for k, v in env.items())
        found = [k for k, v in canaries.items() if k != "DS41_PERTURB_LAYER" and v.encode() in blob]
        assert found == [] and b"DS41_PERTURB_LAYER" not in blob, (name, pid, found)
    leader = {k.decode(): v.decode() for k, v in environs[srv.proc.pid].items()}
    assert leader.get("LC_CTYPE") == "C.UTF-8" and leader.get("PATH") == os.environ["PATH"]
    assert all(leader.get(k) == v for k, v in prof.env.items() if "{" not in v)
    print(f"{name}: {len(environs)} process(es); leader's environment names {sorted(leader)}")


# ================================================================================ 2. the allow-list

def _profile(tmp_path: Path, env: dict[str, str], flag_env: dict[str, str] | None = None, name: str = "p") -> Path:
    lines = [f'name = "{name}"', 'command = ["{python}", "-c", "pass"]', "[env]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in env.items()]
    if flag_env:
        lines += ["[flags.f]", "env = { " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in flag_env.items()) + " }"]
    path = tmp_path / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("name,value", [
    ("OPENSSL_CONF", "/tmp/evil/openssl.cnf"), ("LD_PRELOAD", "/tmp/evil.so"), ("LD_AUDIT", "/tmp/a.so"),
    ("PYTHONSTARTUP", "/tmp/s.py"), ("PYTHONHOME", "/tmp/h"), ("PYTHONUSERBASE", "/tmp/u"), ("PYTHONINSPECT", "1"),
    ("NCCL_NET_PLUGIN", "/tmp/p.so"), ("GCONV_PATH", "/tmp/g"), ("MALLOC_CONF", "x"), ("BASH_ENV", "/tmp/b"),
    ("NODE_OPTIONS", "--require /tmp/x"), ("TORCHINDUCTOR_CACHE_DIR", "/tmp/c"), ("HF_TOKEN", "hf_x"),
])
def test_a_variable_off_the_allow_list_is_refused_naming_file_key_and_value(tmp_path, name, value):
    path = _profile(tmp_path, {name: value})
    with pytest.raises(ProfileError) as ei:
        load_profile(path)
    msg = str(ei.value)
    assert str(path) in msg and name in msg and "allow-list" in msg
    assert (repr(value) in msg) is not (name == "HF_TOKEN")         # a secret's value is never echoed
    flagged = _profile(tmp_path, {}, {name: value}, name="flagged")
    with pytest.raises(ProfileError, match=r"\[flags\.f\].*" + name):
        load_profile(flagged)


def _git_repo(root: Path) -> Path:
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    (root / "src").mkdir()
    (root / "src" / "fixes.py").write_text("X = 1\n")
    (root / "results" / "x").mkdir(parents=True)
    (root / "results" / "x" / "sitecustomize.py").write_text("raise SystemExit('foreign')\n")
    (root / ".gitignore").write_text("results/\n")
    (root / "loose").mkdir()
    (root / "loose" / "m.py").write_text("")
    subprocess.run(["git", "-C", str(root), "add", "src", ".gitignore"], check=True)
    return root


@pytest.mark.parametrize("entry,ok", [
    ("{repo}/src", True), ("{repo}/results/x", False), ("{repo}/loose", False), ("{repo}/../elsewhere", False),
    ("/tmp", False), ("relative/src", False), ("", False), ("{repo}/nope", False),
])
def test_pythonpath_only_to_tracked_source_folders(tmp_path, entry, ok):
    repo = _git_repo(tmp_path / "repo")
    if ok:
        E.check_pythonpath(entry, "where", repo=repo)
        E.check_pythonpath(str(repo / "src"), "where", repo=repo)     # the same folder as an absolute path
        return
    with pytest.raises(E.EngineEnvError, match=r"where: env PYTHONPATH="):
        E.check_pythonpath(entry, "where", repo=repo)


def test_a_tracked_folder_with_a_planted_untracked_module_is_refused(tmp_path):
    repo = _git_repo(tmp_path / "repo")
    E.check_pythonpath("{repo}/src", "p.toml", repo=repo)
    (repo / "src" / "sitecustomize.py").write_text("import os\n")
    with pytest.raises(E.EngineEnvError, match=r"untracked importable file.*sitecustomize\.py"):
        E.check_pythonpath("{repo}/src", "p.toml", repo=repo)
    (repo / "src" / "sitecustomize.py").unlink()
    (repo / "src" / "evil.pth").write_text("import os\n")
    with pytest.raises(E.EngineEnvError, match=r"evil\.pth"):
        E.check_pythonpath("{repo}/src", "p.toml", repo=repo)
    # a link out of the checkout is not the checkout
    (repo / "src" / "evil.pth").unlink()
    (repo / "out").symlink_to(tmp_path)
    with pytest.raises(E.EngineEnvError, match="not a folder inside"):
        E.check_pythonpath("{repo}/out", "p.toml", repo=repo)


def test_the_results_folder_of_this_checkout_is_not_source(tmp_path):
    path = _profile(tmp_path, {"PYTHONPATH": "{repo}/results/x"})
    with pytest.raises(ProfileError, match=r"PYTHONPATH=.*results/x"):
        load_profile(path)


def test_every_shipped_profile_loads_under_the_allow_list():
    for name in profiles.available_profiles():
        assert load_profile(name).name == name
    assert load_profile("vllm-cpu-dsv4").env["PYTHONPATH"] == "{repo}/engine/vllm_dsv4"


def test_inherit_env_names_only_allow_listed_non_secret_variables(tmp_path):
    base = {"command": ["x"], "inherit_env": ["PYTHONPATH", "CUBLAS_WORKSPACE_CONFIG"]}
    assert parse_profile(base, default_name="ok").inherit_env == ("PYTHONPATH", "CUBLAS_WORKSPACE_CONFIG")
    for name in ("HF_TOKEN", "VLLM_API_KEY", "LD_PRELOAD", "DS41_PERTURB_LAYER"):
        with pytest.raises(ProfileError, match=f"inherit_env '{name}'"):
            parse_profile({"command": ["x"], "inherit_env": [name]}, default_name="bad")


def test_a_nightly_cell_env_goes_through_the_allow_list(tmp_path):
    from nightly import runner as N

    def cfg(env: str) -> Path:
        path = tmp_path / "n.toml"
        path.write_text('[nightly]\nname = "n"\ngates = ["gates/test_kl_panel.py"]\n'
                        f'[[cells]]\nname = "c"\nprofile = "vllm-cpu-fp32"\nenv = {{ {env} }}\n')
        return path

    assert N.load_config(cfg('DS41_GATES_CONFIG = "gates/config.toml", VLLM_DS41_X = "1"')).cells[0].env
    for env, name in (('OPENSSL_CONF = "/tmp/o.cnf"', "OPENSSL_CONF"),
                      ('DS41_PERTURB_LAYER = "3"', "DS41_PERTURB_LAYER"),
                      ('PYTHONPATH = "{repo}/results/x"', "PYTHONPATH"), ('LD_PRELOAD = "/tmp/e.so"', "LD_PRELOAD")):
        with pytest.raises(N.NightlyConfigError, match=rf"cells\[0\].*{name}"):
            N.load_config(cfg(env))


# ================================================================================ 3. --engine-env

def test_engine_env_conflicting_with_the_profile_is_refused_naming_both_values():
    with pytest.raises(E.EngineEnvError, match=r"VLLM_CPU_KVCACHE_SPACE='4'.*already sets VLLM_CPU_KVCACHE_SPACE='1'"):
        E.merge_engine_env({"VLLM_CPU_KVCACHE_SPACE": "1"}, {"VLLM_CPU_KVCACHE_SPACE": "4"})
    same, notes = E.merge_engine_env({"VLLM_CPU_KVCACHE_SPACE": "1"}, {"VLLM_CPU_KVCACHE_SPACE": "1"})
    assert same == {"VLLM_CPU_KVCACHE_SPACE": "1"} and notes == []
    with pytest.raises(E.EngineEnvError, match="LD_PRELOAD"):
        E.merge_engine_env({}, {"LD_PRELOAD": "/tmp/x.so"})
    # the localizer's --engine-env is the one place the fault injector's variables are allowed
    assert E.merge_engine_env({}, {"DS41_PERTURB_LAYER": "2"})[0] == {"DS41_PERTURB_LAYER": "2"}
    with pytest.raises(E.EngineEnvError, match="DS41_PERTURB_LAYER"):
        E.merge_engine_env({}, {"DS41_PERTURB_LAYER": "2"}, injector=False)


def test_engine_env_pythonpath_is_merged_after_the_profiles_and_said_so(tmp_path):
    repo = _git_repo(tmp_path / "repo")   # its own checkout: the shared tree's folders gain untracked files
    fixes = "/checkout/engine/vllm_dsv4"
    merged, notes = E.merge_engine_env({"PYTHONPATH": fixes}, {"PYTHONPATH": "{repo}/src"}, repo=repo)
    assert merged["PYTHONPATH"] == f"{fixes}{os.pathsep}{repo / 'src'}"
    assert len(notes) == 1 and "merged after the profile's own PYTHONPATH" in notes[0]


def test_engine_invocation_applies_the_checks_and_starts_from_the_minimal_base(monkeypatch):
    from engine.localize import engine_invocation

    monkeypatch.setattr(launcher, "_engine_python", lambda *a: "/venv/bin/python")
    base = {"PATH": "/bin", "HOME": "/h", "HF_TOKEN": "hf-secret-123456", "DS41_ENGINE_API_KEY": "k-123456",
            "VIRTUAL_ENV": "/v", "DS41_PERTURB_LAYER": "9"}
    inv = engine_invocation("vllm-cpu-fp32", extra_env={"DS41_PERTURB_LAYER": "2", "DS41_PERTURB_MODULE": "mlp"},
                            base_env=base)
    assert inv.env["DS41_PERTURB_LAYER"] == "2" and inv.env["PATH"] == "/bin"
    assert not {"HF_TOKEN", "DS41_ENGINE_API_KEY", "VIRTUAL_ENV"} & set(inv.env)
    with pytest.raises(E.EngineEnvError, match=r"--engine-env: env OPENSSL_CONF='/tmp/o'"):
        engine_invocation("vllm-cpu-fp32", extra_env={"OPENSSL_CONF": "/tmp/o"}, base_env=base)


@pytest.mark.timeout(600)
def test_localize_engine_env_pythonpath_x_on_dsv4_is_one_clear_line(tmp_path):
    """The CLI end to end, in its own process: exit 2, one line naming the variable and the value, no
    traceback (it used to replace the profile's PYTHONPATH and die in the engine with a TypeError)."""
    proc = subprocess.run([sys.executable, "-m", "ds41gates.cli", "localize", "--engine-profile", "vllm-cpu-dsv4",
                           "--engine-env", "PYTHONPATH=x", "--prompt", "a b c", "--out", str(tmp_path / "loc")],
                          cwd=str(REPO), env=gate_session_env(), capture_output=True, text=True, timeout=580)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    line = err[-1]
    assert line.startswith("error:") and "--engine-env" in line and "PYTHONPATH='x'" in line, line
    assert not (tmp_path / "loc" / "localize.json").exists()


# ================================================================================ 4. environments in records, by key

def test_an_environment_in_a_record_is_redacted_by_key_as_well_as_by_value():
    env = {"MY_SERVICE_TOKEN": "abc", "X_SIG": "sig-value", "VLLM_API_KEY": "k", "ACCESS_CREDENTIALS": "c",
           "DB_PASS": "p", "HF_HUB_OFFLINE": "1", "VLLM_DS41_HC_FUSED": "1", "MAX_NUM_BATCHED_TOKENS": "64",
           "TOKENIZERS_PARALLELISM": "false", "SOME_AUTH": "a"}
    record = {"engine": {"env": env, "profile": "p", "key": "kept: a record field, not a variable"}}
    out = R.redact_data(record)
    hidden = {k for k, v in out["engine"]["env"].items() if v == R.REDACTED}
    assert hidden == {"MY_SERVICE_TOKEN", "X_SIG", "VLLM_API_KEY", "ACCESS_CREDENTIALS", "DB_PASS", "SOME_AUTH"}
    assert out["engine"]["key"] == record["engine"]["key"]
    # upper-case keys that are not a secret's name keep their values: a verdict tally (a bare PASS is a verdict word)
    tally = {"PASS": 3, "FAIL": "1 of 4", "ERROR": 0, "NOT EXERCISED": 1, "TOKEN_COUNT": 12, "KEY_STATS": {"n": 2}}
    assert R.redact_data({"tally": tally}) == {"tally": tally}
    assert launcher.redact_env(env) == out["engine"]["env"]      # the launcher's log header: the same rule
    assert R.redact_env(env) == out["engine"]["env"]


# ================================================================================ 5. URLs

@pytest.mark.parametrize("url,want", [
    ("http://127.0.0.1:8000/v1?client_secret=cs123&sig=sg456&access_key=ak789",
     "http://127.0.0.1:8000/v1?client_secret=<redacted>&sig=<redacted>&access_key=<redacted>"),
    ("https://u:pw@h.example/v1/x?model=m&X-Amz-Signature=abc#frag",
     "https://<redacted>@h.example/v1/x?model=m&X-Amz-Signature=<redacted>#frag"),
    ("http://h:1/cb#access_token=tok&state=s", "http://h:1/cb#access_token=<redacted>&state=<redacted>"),
    ("http://h:1/v1?opaque", "http://h:1/v1?<redacted>"),
    ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1"),
])
def test_every_query_value_and_userinfo_of_a_url_is_secret_unless_allow_listed(url, want):
    assert R.redact(f"engine at {url}, failed") == f"engine at {want}, failed"
    assert R.redact_url(url) == want


def test_the_url_rule_reaches_records_and_reports(tmp_path):
    """The engine record's provenance (source.url) and a report go through the one redaction."""
    from core.records import Record
    from tests.reliability.helpers import exact_reference, plain_sequences

    url = "http://127.0.0.1:9/v1?client_secret=cs-canary-1&sig=sig-canary-2&access_key=ak-canary-3"
    rec = exact_reference(plain_sequences())
    rec.provenance.source["url"] = url
    rec.save(tmp_path / "r.safetensors")
    data = (tmp_path / "r.safetensors").read_bytes()
    assert not any(c in data for c in (b"cs-canary-1", b"sig-canary-2", b"ak-canary-3"))
    assert b"client_secret=<redacted>" in data
    assert Record.load(tmp_path / "r.safetensors").provenance.source["url"].startswith("http://127.0.0.1:9/v1?")


# ================================================================================ 6. the fault injector

KL_GATE = "gates/test_kl_panel.py"


@pytest.mark.engine
@pytest.mark.timeout(300)
def test_a_real_vllm_gate_session_with_the_injector_in_its_environment_refuses_naming_it(tmp_path):
    """`pytest -m gate --engine-profile vllm-cpu-fp32` (a real vLLM profile: the server would be launched) with
    DS41_PERTURB_LAYER in the session's environment: refused at configure time, naming the variable, before the
    results folder is claimed or any engine starts."""
    if not (launcher._cache() / "venvs" / launcher.VLLM_VENV / ".ds41-ready").exists():
        pytest.skip("vLLM CPU not set up (scripts/setup-vllm.sh)")
    results = tmp_path / "results"
    env = gate_session_env({"DS41_PERTURB_LAYER": "3", "DS41_PERTURB_MODULE": "mlp"})
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", KL_GATE, "-m", "gate",
                           "--engine-profile", "vllm-cpu-fp32", "--results", str(results)],
                          cwd=str(REPO), env=env, capture_output=True, text=True, timeout=280)
    wall = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode == 4, out[-3000:]                    # pytest's usage error
    assert "DS41_PERTURB_LAYER='3'" in out and "DS41_PERTURB_MODULE='mlp'" in out and "fault injector" in out
    assert not results.exists()                                  # nothing claimed
    assert "[engine.launcher] started" not in out               # nothing launched
    print(f"refused in {wall:.1f} s")


def test_a_profile_or_a_flag_carrying_the_injector_is_refused(tmp_path):
    with pytest.raises(ProfileError, match=r"DS41_PERTURB_LAYER='3'.*fault injector"):
        load_profile(_profile(tmp_path, {"DS41_PERTURB_LAYER": "3"}))
    with pytest.raises(ProfileError, match=r"\[flags\.f\].*DS41_PERTURB_MODULE"):
        load_profile(_profile(tmp_path, {}, {"DS41_PERTURB_MODULE": "mlp"}, name="flagged"))


def test_a_gate_session_refuses_a_profile_flag_that_carries_the_injector(tmp_path):
    prof = _profile(tmp_path, {}, {"DS41_PERTURB_LAYER": "1"}, name="planted")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", KL_GATE, "-m", "gate",
                           "--engine-profile", str(prof), "--engine-flag", "f", "--results", str(tmp_path / "r")],
                          cwd=str(REPO), env=gate_session_env(), capture_output=True, text=True, timeout=280)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 4 and "DS41_PERTURB_LAYER" in out, out[-3000:]
    assert not (tmp_path / "r").exists()


def test_the_nightly_refuses_the_injector_in_its_environment(tmp_path, monkeypatch):
    from nightly import runner as N

    cfg_path = tmp_path / "n.toml"
    cfg_path.write_text('[nightly]\nname = "n"\ngates = ["gates/test_kl_panel.py"]\n'
                        '[[cells]]\nname = "c"\nprofile = "vllm-cpu-fp32"\n')
    cfg = N.load_config(cfg_path)
    monkeypatch.setenv("DS41_PERTURB_SCALE", "0.1")

    def runner(*a):
        raise AssertionError("a cell ran")

    with pytest.raises(N.NightlyConfigError, match=r"nightly environment: DS41_PERTURB_SCALE='0.1'"):
        N.run_nightly(cfg, tmp_path / "h.sqlite", tmp_path / "runs", runner=runner, echo=lambda s: None)
    assert not (tmp_path / "runs").exists()


def test_url_redaction_is_linear_in_the_text():
    """A long run of letters (an engine's reply, a log) is scanned in linear time: the scheme pattern was unbounded
    and took 69 s on 200,000 letters."""
    for text in ("a" * 200_000, "a." * 100_000, "x://" + "b" * 200_000):
        t0 = time.perf_counter()
        R.redact(text, [])
        assert time.perf_counter() - t0 < 3.0, text[:12]


def test_a_gate_session_with_query_credentials_in_its_engine_url_prints_and_writes_none(tmp_path):
    """`--engine-url http://...?client_secret=..&sig=..&access_key=..` (nothing answers there): the exit line names
    the URL with every query value redacted, and nothing the session wrote holds one."""
    from tests.reliability.helpers import exact_reference, plain_sequences

    ref = tmp_path / "ref.safetensors"
    exact_reference(plain_sequences()).save(ref)
    secrets = ("cs-canary-7a", "sig-canary-7b", "ak-canary-7c")
    url = f"http://127.0.0.1:9/v1?client_secret={secrets[0]}&sig={secrets[1]}&access_key={secrets[2]}"
    results = tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", KL_GATE, "-m", "gate",
                           "--engine-url", url, "--reference", str(ref), "--results", str(results)],
                          cwd=str(REPO), env=gate_session_env(), capture_output=True, text=True, timeout=280)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "error: --engine-url http://127.0.0.1:9/v1?client_secret=<redacted>&sig=<redacted>" \
                                   "&access_key=<redacted>" in out, out[-3000:]
    written = [p for p in results.rglob("*") if p.is_file()]
    assert written                                            # results.json at least
    assert not [s for s in secrets if s in out or any(s.encode() in p.read_bytes() for p in written)]


def test_the_kernel_and_vision_tower_runners_start_from_the_base(monkeypatch, tmp_path):
    """The engine's code the harness runs in the engine's venv (the kernel gate's runner, the vision tower runner)
    gets the minimal base too: the environment handed to the subprocess is captured, the run stops there."""
    import engine.kernels.driver as driver
    import engine.vision_tower as tower

    class Captured(Exception):
        pass

    seen: list[dict] = []

    def fake_run(argv, **kw):
        seen.append(dict(kw["env"]))
        raise Captured

    monkeypatch.setenv("HF_TOKEN", "hf-canary-runner-1")
    monkeypatch.setenv("DS41_ENGINE_API_KEY", "key-canary-runner-2")
    monkeypatch.setenv("DS41_PERTURB_LAYER", "4")
    for module in (driver, tower):
        monkeypatch.setattr(module.subprocess, "run", fake_run)
    with pytest.raises(Captured):
        driver.run_runner(Path(sys.executable), tmp_path / "request.json")
    with pytest.raises(Captured):
        tower.run_engine_image_encoder(Path(sys.executable), tmp_path, {}, tmp_path / "work")
    assert len(seen) == 2
    for env in seen:
        assert not {"HF_TOKEN", "DS41_ENGINE_API_KEY", "DS41_PERTURB_LAYER"} & set(env)
        assert env["PATH"] == os.environ["PATH"] and env["PYTHONPATH"] == str(REPO)
