"""Kernel cases through the engine: build the seeded cases (inputs + oracle outputs), hand them to the engine's
runner in a subprocess of the engine's environment, and return what the engine computed. The verdict (error
statistics under the registry's tolerances) is the gate's: gates/lib/kernels.py."""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from core.atomic import atomic_write_text
from core.paths import repo_root
from .cases import Case, build_case
from .registry import KernelEntry, Registry

REPO = repo_root()


class KernelGateError(RuntimeError):
    pass


def case_id(entry: KernelEntry, shape: str, seed: int) -> str:
    return f"{entry.name}.{shape}.{seed}"


def plan(entries: list[KernelEntry], shapes: tuple[str, ...], seed: int = 0) -> list[tuple[KernelEntry, Case]]:
    """One case per (runnable entry, shape the entry lists and the run asks for)."""
    out = []
    for e in entries:
        if not e.runnable_on_cpu:
            continue
        for s in e.shapes:
            if s in shapes:
                out.append((e, build_case(e.primitive, s, seed, case_id(e, s, seed))))
    return out


def write_request(work: Path, pairs: list[tuple[KernelEntry, Case]]) -> Path:
    work.mkdir(parents=True, exist_ok=True)
    tensors = {f"{c.case_id}/{k}": v for _, c in pairs for k, v in c.inputs.items()}
    save_file(tensors, str(work / "inputs.safetensors"))
    req = {"inputs": str(work / "inputs.safetensors"), "outputs": str(work / "outputs.safetensors"),
           "report": str(work / "runner.json"),
           "cases": [{"case_id": c.case_id, "target": e.target, "adapter": e.adapter, "params": c.params,
                      "perturb": e.perturb} for e, c in pairs]}
    path = work / "request.json"
    atomic_write_text(path, json.dumps(req, indent=1))
    return path


def run_runner(python: Path, request: Path, timeout: float = 900.0) -> dict:
    """Run ``engine.kernels.runner`` in the engine environment; returns its report."""
    if not python.exists():
        raise KernelGateError(f"engine python not found: {python} (build it with scripts/setup-vllm.sh)")
    from engine.environment import engine_base_env

    # the engine's code under test starts from the minimal base, never the harness's keys (engine/environment.py)
    env = dict(engine_base_env(), VLLM_LOGGING_LEVEL="WARNING", PYTHONPATH=str(REPO))
    proc = subprocess.run([str(python), "-m", "engine.kernels.runner", str(request)], cwd=str(REPO), env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise KernelGateError(f"kernel runner failed (rc {proc.returncode}) with {python}:\n{proc.stderr[-4000:]}")
    req = json.loads(request.read_text())
    return json.loads(Path(req["report"]).read_text())


@dataclass(frozen=True)
class CaseRun:
    """One case as the engine ran it: the entry, the case (inputs + oracle), the engine's outputs and the
    runner's per-case report (wall time, or an error)."""

    entry: KernelEntry
    case: Case
    outputs: dict[str, torch.Tensor]
    report: dict


def run_cases(registry: Registry, engine: str, cache: Path, work: Path,
              shapes: tuple[str, ...] = ("tiny", "production"), seed: int = 0,
              include_test_only: bool = True) -> tuple[list[CaseRun], dict]:
    """Run every runnable kernel of ``engine`` in one runner subprocess; returns (case runs, run info)."""
    if engine not in registry.engines:
        raise KernelGateError(f"kernel registry {registry.path}: no engine {engine!r}")
    entries = registry.for_engine(engine, include_test_only)
    t0 = time.perf_counter()
    pairs = plan(entries, shapes, seed)
    t_cases = time.perf_counter() - t0
    request = write_request(work, pairs)
    t1 = time.perf_counter()
    report = run_runner(registry.engines[engine].resolved_python(cache), request)
    t_runner = time.perf_counter() - t1
    outs = load_file(str(work / "outputs.safetensors"))
    runs = []
    for e, c in pairs:
        pre = c.case_id + "/"
        mine = {k[len(pre):]: v for k, v in outs.items() if k.startswith(pre)}
        runs.append(CaseRun(e, c, mine, report["cases"].get(c.case_id, {"error": "missing from runner report"})))
    info = {"engine": engine, "registry": registry.path, "seed": seed, "shapes": list(shapes),
            "oracle_cases_s": t_cases, "runner_s": t_runner, "runner": {k: v for k, v in report.items() if k != "cases"},
            "skipped": [{"kernel": e.name, "status": e.status, "device": e.device, "notes": e.notes}
                        for e in entries if not e.runnable_on_cpu]}
    return runs, info
