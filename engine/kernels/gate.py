"""Kernel gate orchestration (harness side): build cases, hand them to the engine's runner in a subprocess
of the engine's environment, compare the returned outputs with the oracle, and produce result records."""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .cases import Case, build_case
from .compare import ErrorStats, Tolerance, error_stats
from .registry import KernelEntry, Registry

REPO = Path(__file__).resolve().parents[2]


class KernelGateError(RuntimeError):
    pass


@dataclass(frozen=True)
class OutputResult:
    name: str
    tolerance: Tolerance
    stats: ErrorStats

    @property
    def ok(self) -> bool:
        return self.stats.violations == 0


@dataclass(frozen=True)
class KernelResult:
    kernel: str
    primitive: str
    shape: str
    engine: str
    target: str
    flag: str
    test_only: bool
    expect_violation: bool
    wall_s: float | None
    error: str | None
    outputs: tuple[OutputResult, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        """True when the kernel ran and every output is inside its tolerance."""
        return self.error is None and all(o.ok for o in self.outputs)

    @property
    def violations(self) -> list[str]:
        if self.error is not None:
            return [f"{self.kernel}[{self.shape}]: engine call failed: {self.error}"]
        return [f"{self.kernel}[{self.shape}].{o.name}: {o.stats.violations}/{o.stats.numel} elements outside "
                f"{_tol_text(o.tolerance)} (max {o.stats.max_ulp} ulp, max abs {o.stats.max_abs:.3g})"
                for o in self.outputs if not o.ok]

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "outputs"}
        d["ok"] = self.ok
        d["outputs"] = {o.name: {"tolerance": asdict(o.tolerance), "ok": o.ok, **o.stats.to_dict()}
                        for o in self.outputs}
        return d


def _tol_text(t: Tolerance) -> str:
    return "bit-exact" if t.exact else f"max_ulp={t.max_ulp} / atol={t.atol:g}"


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
    path.write_text(json.dumps(req, indent=1))
    return path


def run_runner(python: Path, request: Path, timeout: float = 900.0) -> dict:
    """Run ``engine.kernels.runner`` in the engine environment; returns its report."""
    if not python.exists():
        raise KernelGateError(f"engine python not found: {python} (build it with scripts/setup-vllm.sh)")
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING", PYTHONPATH=str(REPO))
    proc = subprocess.run([str(python), "-m", "engine.kernels.runner", str(request)], cwd=str(REPO), env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise KernelGateError(f"kernel runner failed (rc {proc.returncode}) with {python}:\n{proc.stderr[-4000:]}")
    req = json.loads(request.read_text())
    return json.loads(Path(req["report"]).read_text())


def evaluate(entry: KernelEntry, case: Case, outputs: dict[str, torch.Tensor], rec: dict) -> KernelResult:
    """Compare one case's engine outputs with the oracle under the entry's tolerances (pure)."""
    base = dict(kernel=entry.name, primitive=entry.primitive, shape=case.shape, engine=entry.engine,
                target=entry.target, flag=entry.flag, test_only=entry.test_only,
                expect_violation=entry.expect_violation, wall_s=rec.get("wall_s"))
    if "error" in rec:
        return KernelResult(**base, error=rec["error"])
    results = []
    for name, tol in entry.tolerance.items():
        if name not in outputs:
            return KernelResult(**base, error=f"engine returned no output {name!r} (got {sorted(outputs)})")
        if name not in case.oracle:
            return KernelResult(**base, error=f"oracle primitive {entry.primitive!r} has no output {name!r}")
        try:
            results.append(OutputResult(name, tol, error_stats(outputs[name], case.oracle[name], tol)))
        except (ValueError, TypeError) as e:
            return KernelResult(**base, error=f"output {name!r}: {e}")
    return KernelResult(**base, error=None, outputs=tuple(results))


def run_kernel_gate(registry: Registry, engine: str, cache: Path, work: Path,
                    shapes: tuple[str, ...] = ("tiny", "production"), seed: int = 0,
                    include_test_only: bool = True) -> tuple[list[KernelResult], dict]:
    """Run every runnable kernel of ``engine`` in one runner subprocess; returns (results, run info)."""
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
    results = []
    for e, c in pairs:
        pre = c.case_id + "/"
        mine = {k[len(pre):]: v for k, v in outs.items() if k.startswith(pre)}
        results.append(evaluate(e, c, mine, report["cases"].get(c.case_id, {"error": "missing from runner report"})))
    info = {"engine": engine, "registry": registry.path, "seed": seed, "shapes": list(shapes),
            "oracle_cases_s": t_cases, "runner_s": t_runner, "runner": {k: v for k, v in report.items() if k != "cases"},
            "skipped": [{"kernel": e.name, "status": e.status, "device": e.device, "notes": e.notes}
                        for e in entries if not e.runnable_on_cpu]}
    return results, info


def write_results(path: Path, results: list[KernelResult], info: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"format": "ds41-kernel-gate/1", **info, "results": [r.to_dict() for r in results]}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)
    return path
