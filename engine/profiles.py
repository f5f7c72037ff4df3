"""Engine profiles: the TOML schema (pydantic, core/schema.py), and what a profile is gated on.

A profile (``engine/profiles/<name>.toml``) says what to run::

    name = "vllm-cpu-fp32"
    engine = "vllm"                      # the adapter: one of engine.adapters.ENGINE_KINDS, checked at parse
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
    oracle = "deepseek"                  # a kind of oracle/kinds.py: "transformers" (oracle/hf.py) | "deepseek"
    precision = "fp32"
    bands = "gates/bands.toml"           # paths relative to the repository root
    sizes = "gates/config-vllm-cpu-dsv4.toml"

Placeholders in command, args, env, health_url and log_file are resolved at launch by engine.launcher;
this module only reads and checks the file (pure, apart from ``load_profile`` reading it). The schema is the
dataclasses below (pydantic dataclasses, so launch overrides stay ``dataclasses.replace`` and are validated too);
an unknown key, a wrong type, an engine no adapter is registered for or an oracle kind oracle/kinds.py does not
know is one ProfileError line naming the file and the key, before anything launches. The messages keep the
profile's established wording (``explain``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import field
from pathlib import Path
from typing import Annotated, Any, Literal

import pydantic
from pydantic import BeforeValidator, Field, StrictFloat, StrictInt, StrictStr, field_validator, model_validator
from pydantic.dataclasses import dataclass

from core.errors import UserError
from core.paths import safe_name
from core.redact import secret_env_name
from core.schema import STRICT, Problem, Seq, describe, parse_model, problems_of, value_at
from core.tomlfile import read_toml
from engine.adapters import ENGINE_KINDS
from engine.environment import check_engine_env, settable_name
from oracle.kinds import oracle_kind

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
REPO_ROOT = Path(__file__).resolve().parent.parent


class ProfileError(UserError, ValueError):
    """A profile file is missing, malformed or uses an unknown placeholder or flag."""


def _number_as_text(value: Any) -> Any:
    # a number written for a string (args = ["--max-model-len", 2048]) is its text; a bool is not a number here
    return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


Text = Annotated[StrictStr, BeforeValidator(_number_as_text)]
NonEmpty = Annotated[StrictStr, Field(min_length=1)]
Positive = Annotated[StrictFloat, Field(gt=0)]

# ------------------------------------------------------------------------------------------ gate target

OWN_TOKENIZER = "model"   # tokenizer = "model": the model folder's own tokenizer.json and chat template


@dataclass(frozen=True, config=STRICT)
class GateTarget:
    """What a profile is gated on, as declared in its ``[gate]`` table: the model the oracle loads (a model
    provider of engine.launcher, the same registry the launch placeholders use), the panel and the tokenizer /
    chat encoding it is encoded with, the oracle (a kind of oracle/kinds.py) and its precision (one its gate
    reference is built in), the KL bands and the gate sizes. Paths are relative to the repository root. The
    defaults are the embedded default: SmolLM2 on the `default` panel."""

    model: NonEmpty = "model_hf_dir"
    panel: NonEmpty = "default"
    tokenizer: NonEmpty = OWN_TOKENIZER    # panels.load_tokenizer spec, or OWN_TOKENIZER
    oracle: NonEmpty = "transformers"
    precision: NonEmpty = "fp32"
    bands: NonEmpty = "gates/bands.toml"
    sizes: StrictStr = ""                  # gate sizes over gates/config.toml; "" (left out) = the CI sizes alone
    # "optional": the engine may run without prefix caching (the gate then xfails)
    prefix_cache: Literal["required", "optional"] = "required"

    @model_validator(mode="before")
    @classmethod
    def _written_sizes_name_a_file(cls, data: Any) -> Any:
        # "" is the default (the CI sizes alone), kept by dataclasses.replace; a table that writes sizes names a file
        if isinstance(data, dict) and data.get("sizes") == "":
            raise ValueError("'sizes' must be a non-empty string, got ''")
        return data

    @field_validator("oracle")
    @classmethod
    def _registered_oracle(cls, oracle: str) -> str:
        return oracle_kind(oracle).name

    @model_validator(mode="after")
    def _gate_precision(self) -> GateTarget:
        oracle_kind(self.oracle).check_gate_precision(self.precision)
        return self


DEFAULT_GATE_TARGET = GateTarget()


# ------------------------------------------------------------------------------------------ profiles


@dataclass(frozen=True, config=STRICT)
class FlagSpec:
    """What turning one flag on adds to a launch."""

    env: dict[StrictStr, Text] = field(default_factory=dict)
    args: Seq[Text] = ()


# the profile's established wording of a key that has the wrong shape (ProfileSchema.explain)
_LIST_KEYS = ("command", "args", "unset_env", "inherit_env")
_TEXT_KEYS = ("name", "engine", "served_model", "host", "health_url", "log_file", "description")


def _flag_text(problem: Problem, data: Any) -> str:
    """A problem inside ``[flags.<flag>]``, in the profile's words."""
    loc = problem.loc
    if len(loc) == 2:
        return f"a flag table holds only 'env' and 'args', got {value_at(data, loc)!r}"
    key = loc[2]
    shape = "a table of strings" if key == "env" else "a list of strings"
    return f"{key!r} must be {shape}, got {value_at(data, loc[:3])!r}"


def _gate_text(problem: Problem, data: Any) -> str:
    """A problem inside ``[gate]``, in the profile's words."""
    key = problem.loc[1] if len(problem.loc) > 1 else None
    if problem.kind in ("extra_forbidden", "value_error") or key is None:
        return problem.text
    value = value_at(data, problem.loc[:2])
    if key == "prefix_cache":
        return f"prefix_cache {value!r}: expected \"required\" or \"optional\""
    return f"{key!r} must be a non-empty string, got {value!r:.60}"


@dataclass(frozen=True, config=STRICT)
class Profile:
    name: NonEmpty
    command: Annotated[Seq[Text], Field(min_length=1)]
    args: Seq[Text] = ()
    env: dict[StrictStr, Text] = field(default_factory=dict)
    unset_env: Seq[Text] = ()
    inherit_env: Seq[Text] = ()
    engine: StrictStr = ""            # "" or left out: not declared (the caller's default adapter)
    served_model: StrictStr = ""
    host: StrictStr = "127.0.0.1"
    port: Annotated[StrictInt, Field(ge=0, le=65535)] = 0
    health_url: StrictStr = "http://{host}:{port}/v1/models"
    start_timeout_s: Positive = 300.0
    stop_grace_s: Positive = 15.0
    log_file: StrictStr = "{cache}/logs/{profile}-{stamp}.log"
    flags: dict[StrictStr, FlagSpec] = field(default_factory=dict)
    gate: GateTarget = DEFAULT_GATE_TARGET
    description: StrictStr = ""
    source: Path | None = None        # where it was read from: set by load_profile, never a key of the file

    @model_validator(mode="before")
    @classmethod
    def _source_is_not_a_key(cls, data: Any) -> Any:
        # a table (a parsed file) never says where it came from; dataclasses.replace (a launch override) may
        if isinstance(data, dict) and "source" in data:
            raise ValueError("unknown key(s) ['source']: where a profile was read from is not a key of it")
        return data

    @field_validator("name")
    @classmethod
    def _safe_name(cls, name: str) -> str:
        return safe_name(name, "profile name")   # becomes file names: engine-<name>.safetensors, the launcher log

    @field_validator("engine")
    @classmethod
    def _registered_engine(cls, engine: str) -> str:
        if engine and engine not in ENGINE_KINDS:   # "": not declared
            raise ValueError(f"engine {engine!r}: no adapter for it; expected one of {sorted(ENGINE_KINDS)} "
                             "(engine/adapters)")
        return engine

    @field_validator("inherit_env")
    @classmethod
    def _inheritable(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        """`inherit_env` names only allow-listed variables (engine/environment.py), never a secret-looking one:
        the harness's own keys and tokens stay in the harness."""
        for name in names:
            if secret_env_name(name) or not settable_name(name):
                raise ValueError(f"inherit_env {name!r}: the engine may inherit only allow-listed, non-secret "
                                 "variables from the harness (engine/environment.py)")
        return names

    @classmethod
    def explain(cls, problem: Problem, data: Any) -> str | None:
        loc, kind = problem.loc, problem.kind
        if loc[:1] == ("gate",) and (len(loc) > 1 or kind in ("value_error", "extra_forbidden")):
            return f" [gate]: {_gate_text(problem, data)}"
        if loc[:1] == ("flags",) and len(loc) > 1:
            return f" [flags.{loc[1]}]: {_flag_text(problem, data)}"
        if kind == "extra_forbidden":
            if "allow_env" in problem.unknown:
                return ("'allow_env' is gone: what a profile may set is engine/environment.py's allow-list (a "
                        "loader variable never is)")
            return None
        if not loc or kind == "value_error":
            return problem.text
        key = loc[0]
        value = value_at(data, loc[:1])
        if key == "command" and kind in ("missing", "too_short"):
            return "'command' is required and must not be empty"
        if key in _LIST_KEYS:
            return f"{key!r} must be a list of strings, got {value!r}"
        if key == "env":
            return f"'env' must be a table of strings, got {value!r}"
        if key == "flags":
            return "'flags' must be a table of tables"
        if key == "gate":
            return f"'gate' must be a table, got {value!r:.60}"
        if key == "port":
            return f"'port' must be an integer in [0, 65535], got {value!r}"
        if key in ("start_timeout_s", "stop_grace_s"):
            return f"{key!r} must be a positive number, got {value!r}"
        if key in _TEXT_KEYS:
            return f"{key!r} must be a string, got {value!r}"
        return None

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
                changes["args"] = tuple(changes.get("args", self.args)) + tuple(value)
            elif key == "extra_env":
                changes["env"] = {**changes.get("env", self.env), **value}
            else:
                changes[key] = value
        try:
            return dataclasses.replace(self, **changes)
        except pydantic.ValidationError as exc:   # validated like the file: one line naming the override
            problem = problems_of(Profile, exc)[0]
            raise ProfileError(f"profile {self.name!r} override{describe(Profile, problem, changes)}") from None


# What a profile's [env] and its flags' env may set: engine/environment.py's allow-list (a loader or interpreter
# variable never; PYTHONPATH only to tracked source folders of this checkout; DS41_PERTURB_* never). The same
# policy holds for a nightly cell's env (nightly/runner.py) and `ds41gate localize --engine-env`.


def check_profile_env(env: Mapping[str, str], where: str) -> None:
    check_engine_env(env, where, error=ProfileError)


def parse_profile(data: Mapping[str, Any], source: Path | None = None, default_name: str = "") -> Profile:
    """Build a Profile from parsed TOML (pure): the schema, then the environment policy over what it sets."""
    where = str(source) if source else f"profile {default_name!r}"
    table = {**data, "name": data.get("name") or default_name}
    profile = parse_model(Profile, table, where, ProfileError)
    for flag, spec in profile.flags.items():
        check_profile_env(spec.env, f"{where} [flags.{flag}]")
    check_profile_env(profile.env, where)
    return dataclasses.replace(profile, source=source) if source is not None else profile


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
    return parse_profile(read_toml(path, "engine profile", ProfileError), source=path.resolve(),
                         default_name=path.stem)
