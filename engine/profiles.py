"""Engine profiles: the TOML schema, its strict parser, and what a profile is gated on.

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
    unset_env = ["PYTHONPATH"]           # removed from the base environment the engine starts from
    inherit_env = []                     # names the engine takes from the harness's environment besides the base
                                         # (allow-listed, never a secret: exllamav3's PYTHONPATH on a GPU box)
    [env]                                # what the engine gets besides the minimal base (engine/environment.py);
    HF_HUB_OFFLINE = "1"                 # names on engine/environment.py's allow-list only
    [flags.VLLM_DS41_SOMETHING]          # turned on per launch: EngineServer(..., flags=[...])
    env = { VLLM_DS41_SOMETHING = "1" }
    args = ["--some-arg"]
    [gate]                               # what the server is gated on (GateTarget; absent: the embedded default)
    model = "dsv4_tiny_dir"              # a model provider of engine.launcher: the folder the oracle loads
    panel = "dsv4-ci"
    tokenizer = "deepseek"               # panels.load_tokenizer spec; "model" = the model folder's own files
    oracle = "deepseek"                  # "transformers" (oracle/hf.py) | "deepseek" (oracle/dsv41)
    precision = "fp32"
    bands = "gates/bands.toml"           # paths relative to the repository root
    sizes = "gates/config-vllm-cpu-dsv4.toml"

Placeholders in command, args, env, health_url and log_file are resolved at launch by engine.launcher;
this module only reads and checks the file (pure, apart from ``load_profile`` reading it).
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.errors import UnsafeNameError, UserError
from core.paths import safe_name
from core.redact import secret_env_name
from engine.environment import check_engine_env, settable_name

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
REPO_ROOT = Path(__file__).resolve().parent.parent


class ProfileError(UserError, ValueError):
    """A profile file is missing, malformed or uses an unknown placeholder or flag."""


# ------------------------------------------------------------------------------------------ gate target

# The oracles a gate reference can come from, and the precisions the gate builds its reference in: the KL panel
# gate compares against the fp32 oracle only (docs/ORACLE.md); another precision is a floor, not a reference.
ORACLE_PRECISIONS: Mapping[str, tuple[str, ...]] = {"transformers": ("fp32",), "deepseek": ("fp32",)}
OWN_TOKENIZER = "model"   # tokenizer = "model": the model folder's own tokenizer.json and chat template


@dataclass(frozen=True)
class GateTarget:
    """What a profile is gated on, as declared in its ``[gate]`` table: the model the oracle loads (a model
    provider of engine.launcher, the same registry the launch placeholders use), the panel and the tokenizer /
    chat encoding it is encoded with, the oracle and its precision, the KL bands and the gate sizes. Paths are
    relative to the repository root. The defaults are the embedded default: SmolLM2 on the `default` panel."""

    model: str = "model_hf_dir"
    panel: str = "default"
    tokenizer: str = OWN_TOKENIZER    # panels.load_tokenizer spec, or OWN_TOKENIZER
    oracle: str = "transformers"
    precision: str = "fp32"
    bands: str = "gates/bands.toml"
    sizes: str = ""                   # gate sizes over gates/config.toml; "" = the CI sizes alone
    prefix_cache: str = "required"    # "optional": the engine may run without prefix caching (the gate then xfails)


DEFAULT_GATE_TARGET = GateTarget()
_GATE_KEYS = frozenset(f.name for f in dataclasses.fields(GateTarget))


def parse_gate_target(data: Any, where: str) -> GateTarget:
    """The ``[gate]`` table (pure): every key a non-empty string, known keys only, a known oracle and precision."""
    if not isinstance(data, dict):
        raise ProfileError(f"{where}: 'gate' must be a table, got {data!r:.60}")
    unknown = sorted(set(data) - _GATE_KEYS)
    if unknown:
        raise ProfileError(f"{where} [gate]: unknown key(s) {unknown}; known: {sorted(_GATE_KEYS)}")
    for key, value in data.items():
        if not isinstance(value, str) or not value:
            raise ProfileError(f"{where} [gate]: {key!r} must be a non-empty string, got {value!r:.60}")
    target = dataclasses.replace(DEFAULT_GATE_TARGET, **data)
    if target.prefix_cache not in ("required", "optional"):
        raise ProfileError(f"{where} [gate]: prefix_cache {target.prefix_cache!r}: expected \"required\" or "
                           "\"optional\"")
    if target.oracle not in ORACLE_PRECISIONS:
        raise ProfileError(f"{where} [gate]: oracle {target.oracle!r}: expected one of {sorted(ORACLE_PRECISIONS)}")
    if target.precision not in ORACLE_PRECISIONS[target.oracle]:
        raise ProfileError(f"{where} [gate]: precision {target.precision!r}: the {target.oracle} oracle's gate "
                           f"reference is built in {ORACLE_PRECISIONS[target.oracle]}")
    return target


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
    inherit_env: tuple[str, ...] = ()
    engine: str = ""
    served_model: str = ""
    host: str = "127.0.0.1"
    port: int = 0
    health_url: str = "http://{host}:{port}/v1/models"
    start_timeout_s: float = 300.0
    stop_grace_s: float = 15.0
    log_file: str = "{cache}/logs/{profile}-{stamp}.log"
    flags: Mapping[str, FlagSpec] = field(default_factory=dict)
    gate: GateTarget = DEFAULT_GATE_TARGET
    source: Path | None = None

    def with_overrides(self, overrides: Mapping[str, Any] | None) -> Profile:
        """A copy with fields replaced. Besides field names, ``extra_args`` appends arguments and
        ``extra_env`` merges environment entries."""
        if not overrides:
            return self
        fields = {f.name for f in dataclasses.fields(self)} - {"source", "name", "gate"}  # a launch, not a target
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
            elif key in ("args", "command", "unset_env", "inherit_env"):
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
    "health_url", "start_timeout_s", "stop_grace_s", "log_file", "flags", "description", "allow_env", "gate",
    "inherit_env",
}

# What a profile's [env] and its flags' env may set: engine/environment.py's allow-list (a loader or interpreter
# variable never; PYTHONPATH only to tracked source folders of this checkout; DS41_PERTURB_* never). The same
# policy holds for a nightly cell's env (nightly/runner.py) and `ds41gate localize --engine-env`.


def check_profile_env(env: Mapping[str, str], where: str) -> None:
    check_engine_env(env, where, error=ProfileError)


def check_inherit_env(names: Sequence[str], where: str) -> None:
    """`inherit_env` names only allow-listed variables (engine/environment.py), never a secret-looking one: the
    harness's own keys and tokens stay in the harness."""
    for name in names:
        if secret_env_name(name) or not settable_name(name):
            raise ProfileError(f"{where}: inherit_env {name!r}: the engine may inherit only allow-listed, "
                               "non-secret variables from the harness (engine/environment.py)")


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
    if "allow_env" in data:
        raise ProfileError(f"{where}: 'allow_env' is gone: what a profile may set is engine/environment.py's "
                           "allow-list (a loader variable never is)")
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
        check_profile_env(flags[flag].env, fwhere)
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
    check_profile_env(env, where)
    inherit_env = _str_list(data, "inherit_env", where)
    check_inherit_env(inherit_env, where)
    return Profile(
        name=name,
        command=command,
        args=_str_list(data, "args", where),
        env=env,
        unset_env=_str_list(data, "unset_env", where),
        inherit_env=inherit_env,
        port=port,
        flags=flags,
        gate=parse_gate_target(data["gate"], where) if "gate" in data else DEFAULT_GATE_TARGET,
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

