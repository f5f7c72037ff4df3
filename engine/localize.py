"""The divergence localizer's engine side, from the harness: turn a vLLM profile (plus its flags and extra
environment) into the arguments of engine/localize_runner.py, run that runner in the engine's own venv (one
subprocess, one model load, every case), and read back what it captured. The maths is core/localize.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from core.atomic import atomic_write_text
from core.errors import UserError
from core.paths import repo_root

# api_server options vLLM's EngineArgs does not know (the runner's parser would also skip them, this only keeps
# the report's list of ignored arguments short)
_FRONTEND_ONLY = {"--host": 1, "--port": 1, "--enable-prompt-tokens-details": 0, "--api-key": 1}
PERTURB_ENV = ("DS41_PERTURB_LAYER", "DS41_PERTURB_MODULE", "DS41_PERTURB_SCALE", "DS41_PERTURB_FROM_POS")


class LocalizeRunError(RuntimeError):
    pass


@dataclass(frozen=True)
class EngineInvocation:
    """How to run the runner for a profile: the engine's python, vLLM's engine arguments, the environment."""

    profile: str
    python: str
    engine_args: tuple[str, ...]
    env: Mapping[str, str]        # the full environment of the runner
    profile_env: Mapping[str, str]  # the profile's (and flags', and --engine-env) entries: for the record
    flags: tuple[str, ...]
    dtype: str


def engine_invocation(profile: str, flags: Sequence[str] = (), extra_env: Mapping[str, str] | None = None,
                      base_env: Mapping[str, str] | None = None) -> EngineInvocation:
    """Resolve ``profile`` (engine/profiles/<name>.toml) as the launcher would, minus the HTTP front end."""
    from engine.environment import merge_engine_env
    from engine.launcher import resolve
    from engine.profiles import load_profile

    prof = load_profile(profile)
    if prof.engine != "vllm":
        raise UserError(f"profile {profile!r}: the localizer runs vLLM in process (LLM.apply_model); this profile's "
                        f"engine is {prof.engine!r}")
    spec = resolve(prof, flags)
    argv = list(spec.argv)
    try:
        start = argv.index("-m") + 2
    except ValueError:
        raise UserError(f"profile {profile!r}: command {argv[:3]} is not '<python> -m <vllm server module>'") from None
    args, i = [], start
    while i < len(argv):
        a = argv[i]
        name = a.split("=", 1)[0]
        if name in _FRONTEND_ONLY:
            i += 1 + (_FRONTEND_ONLY[name] if "=" not in a else 0)
            continue
        args.append(a)
        i += 1
    # --engine-env: the same allow-list as a profile's [env] (the fault injector's variables allowed: this is the
    # one place that plants faults), a variable the profile sets too refused, PYTHONPATH merged (said on stderr)
    profile_env, notes = merge_engine_env(spec.env, extra_env or {}, "--engine-env")
    for note in notes:
        print(f"[localize] {note}", file=sys.stderr, flush=True)
    # the runner starts from the engine's minimal environment (engine/environment.py), as a launched server does
    env = spec.full_env(os.environ if base_env is None else base_env)
    env.update(profile_env)
    paths = [str(repo_root())] + ([profile_env["PYTHONPATH"]] if profile_env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    dtype = "auto"
    for j, a in enumerate(args):
        if a == "--dtype" and j + 1 < len(args):
            dtype = args[j + 1]
        elif a.startswith("--dtype="):
            dtype = a.split("=", 1)[1]
    return EngineInvocation(profile, argv[0], tuple(args), env, profile_env, tuple(flags), dtype)


def perturb_plugin_installed(python: str) -> bool:
    """Whether the engine venv has the fault-injection plugin (scripts/setup-vllm.sh installs it)."""
    proc = subprocess.run([python, "-c", "import importlib.metadata as m; import sys; "
                           "sys.exit(0 if any(e.name == 'ds41_perturb' for e in "
                           "m.entry_points(group='vllm.general_plugins')) else 1)"],
                          capture_output=True, text=True, timeout=60)
    return proc.returncode == 0


def run_engine_captures(inv: EngineInvocation, prompt_ids: Sequence[int], cases: Sequence[dict], work: Path,
                        decode: bool = True, sites: Sequence[str] | None = None,
                        layers: Sequence[int] | None = None, timeout: float = 1800.0) -> dict:
    """Run the runner once for every case; returns its report (per case: the capture file, generated ids, the
    fault plugin's state, timings) plus ``wall_s``. Raises LocalizeRunError when the runner or a case fails."""
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    needs_plugin = any(c.get("perturb") is not None for c in cases) or any(k in inv.profile_env for k in PERTURB_ENV)
    if needs_plugin and not perturb_plugin_installed(inv.python):
        raise LocalizeRunError(f"the fault-injection plugin is not installed in {inv.python}'s venv; "
                               "run scripts/setup-vllm.sh (it installs engine/vllm_perturb/)")
    req = {"engine_args": list(inv.engine_args), "prompt_ids": [int(t) for t in prompt_ids], "decode": decode,
           "sites": list(sites) if sites is not None else None, "layers": list(layers) if layers is not None else None,
           "cases": list(cases), "out_dir": str(work / "captures"), "report": str(work / "runner.json")}
    atomic_write_text(work / "request.json", json.dumps(req, indent=1))
    t0 = time.perf_counter()
    log = work / "runner.log"
    with open(log, "wb") as fh:
        proc = subprocess.run([inv.python, "-m", "engine.localize_runner", str(work / "request.json")],
                              cwd=str(repo_root()), env=dict(inv.env), stdout=fh, stderr=subprocess.STDOUT,
                              timeout=timeout)
    wall = time.perf_counter() - t0
    tail = log.read_bytes()[-4000:].decode(errors="replace")
    if proc.returncode != 0 or not (work / "runner.json").exists():
        raise LocalizeRunError(f"localize runner failed (rc {proc.returncode}) with {inv.python}; log {log}:\n{tail}")
    report = json.loads((work / "runner.json").read_text())
    report["wall_s"] = wall
    errors = {n: c["error"] for n, c in report["cases"].items() if "error" in c}
    if errors:
        raise LocalizeRunError(f"localize runner: {errors}\n" + "\n".join(
            c.get("traceback", "") for c in report["cases"].values()))
    return report


class RowView:
    """One tensor of a safetensors file as rows read on demand: ``shape``, and ``view[a:b]`` -> those rows as a
    float32 numpy array (only they are read). What the logits' KL is computed over, a chunk of rows at a time."""

    def __init__(self, path: str, key: str):
        from safetensors import safe_open

        self.path, self.key = path, key
        with safe_open(path, framework="pt") as f:
            self.shape = tuple(f.get_slice(key).get_shape())

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, rows: slice):
        from safetensors import safe_open

        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError(f"{self.key}: rows are read as a contiguous slice, got {rows!r}")
        with safe_open(self.path, framework="pt") as f:
            return f.get_slice(self.key)[rows].float().numpy()


class LazyCaptures(Mapping):
    """A capture file as a mapping key -> tensor, read one tensor at a time (memory: one site); ``row_view(key)``
    reads a tensor's rows on demand (the logits)."""

    def __init__(self, path: str | Path):
        from safetensors import safe_open

        self.path = str(path)
        with safe_open(self.path, framework="pt") as f:
            self._keys = list(f.keys())

    def __getitem__(self, key):
        from safetensors import safe_open

        if key not in self._keys:
            raise KeyError(key)
        with safe_open(self.path, framework="pt") as f:
            return f.get_tensor(key)

    def row_view(self, key: str) -> RowView:
        if key not in self._keys:
            raise KeyError(key)
        return RowView(self.path, key)

    def __iter__(self):
        return iter(self._keys)

    def __len__(self):
        return len(self._keys)
