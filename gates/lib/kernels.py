"""The kernel gate's verdict side: ULP distance through integer views, error statistics of an engine output
against the oracle under the registry's tolerance, and one result per (kernel, shape). Torch tensors in, small
records out; no IO. The cases run in the engine's environment through engine.kernels.driver."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from engine.kernels.cases import Case
from engine.kernels.registry import KernelEntry, Tolerance

# dtype -> (signed int view dtype, magnitude mask)
_INT_VIEW = {
    torch.float32: (torch.int32, 0x7FFFFFFF),
    torch.bfloat16: (torch.int16, 0x7FFF),
    torch.float16: (torch.int16, 0x7FFF),
}


def ordered_key(x: torch.Tensor) -> torch.Tensor:
    """Map every finite float of ``x.dtype`` to an int64 whose order is the float order, with consecutive
    representable values one apart and +0 == -0 == 0 (sign-magnitude -> two's-complement line)."""
    if x.dtype not in _INT_VIEW:
        raise TypeError(f"ordered_key: unsupported dtype {x.dtype} (float32, bfloat16, float16)")
    ity, mag = _INT_VIEW[x.dtype]
    bits = x.contiguous().view(ity).to(torch.int64)
    m = bits & mag
    return torch.where(bits < 0, -m, m)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Number of representable values of the common dtype between ``a`` and ``b`` (int64, elementwise).

    0 for equal values (and for +0 vs -0); NaN in either operand gives -1 (never "close")."""
    if a.dtype != b.dtype:
        raise TypeError(f"ulp_distance: dtypes differ ({a.dtype} vs {b.dtype}); round one side first")
    if a.shape != b.shape:
        raise ValueError(f"ulp_distance: shapes differ {tuple(a.shape)} vs {tuple(b.shape)}")
    d = (ordered_key(a) - ordered_key(b)).abs()
    nan = torch.isnan(a) | torch.isnan(b)
    return torch.where(nan, torch.full_like(d, -1), d)


@dataclass(frozen=True)
class ErrorStats:
    """What one engine output did against the oracle."""

    dtype: str
    numel: int
    max_abs: float
    max_rel: float  # max |d| / |ref| over elements with |ref| > 0
    max_row_rel: float  # max |d| / max|ref of the row| (rows = last dim)
    ref_max_abs: float
    max_ulp: int
    mean_ulp: float
    p99_ulp: float
    ulp_hist: dict  # {"0": n, "1": n, "2": n, ">2": n}
    mismatches: int  # elements not bit-identical to the rounded oracle
    violations: int  # elements outside the tolerance
    nan: int

    def to_dict(self) -> dict:
        return asdict(self)


def round_to(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The oracle value as the engine's output dtype would hold it (round to nearest even)."""
    return ref.to(dtype)


def error_stats(engine: torch.Tensor, oracle: torch.Tensor, tol: Tolerance) -> ErrorStats:
    """Compare an engine output with the fp32/fp64 oracle value under ``tol``."""
    if engine.shape != oracle.shape:
        raise ValueError(f"shape mismatch: engine {tuple(engine.shape)} vs oracle {tuple(oracle.shape)}")
    dtype = engine.dtype
    ref_r = round_to(oracle, dtype)
    ulp = ulp_distance(engine, ref_r).flatten()
    nan = int((ulp < 0).sum())
    e64, r64 = engine.double().flatten(), oracle.double().flatten()
    d = (e64 - r64).abs()
    rowmax = (oracle.double().abs().amax(-1, keepdim=True).expand(oracle.shape).flatten() if oracle.ndim
              else r64.abs())
    row_rel = torch.where(rowmax > 0, d / rowmax.clamp_min(1e-300), torch.where(d > 0, torch.inf, 0.0))
    nz = r64 != 0
    rel = (d[nz] / r64[nz].abs()) if bool(nz.any()) else d.new_zeros(1)
    okulp = ulp.clamp_min(0)
    hist = {"0": int((ulp == 0).sum()), "1": int((ulp == 1).sum()), "2": int((ulp == 2).sum()),
            ">2": int((ulp > 2).sum())}
    if tol.exact:
        bad = ulp != 0
    else:
        bad = (ulp < 0) | ((ulp > tol.max_ulp) & ~(d <= tol.atol) & ~(d <= tol.row_rtol * rowmax))
    n = ulp.numel()
    return ErrorStats(
        dtype=str(dtype).replace("torch.", ""), numel=n,
        max_abs=float(d.max()) if n else 0.0, max_rel=float(rel.max()) if n else 0.0,
        max_row_rel=float(row_rel.max()) if n else 0.0,
        ref_max_abs=float(r64.abs().max()) if n else 0.0,
        max_ulp=int(okulp.max()) if n else 0, mean_ulp=float(okulp.double().mean()) if n else 0.0,
        p99_ulp=float(torch.quantile(okulp.double(), 0.99)) if 0 < n <= 16_000_000 else 0.0,
        ulp_hist=hist, mismatches=int((ulp != 0).sum()), violations=int(bad.sum()), nan=nan)


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


def evaluate(entry: KernelEntry, case: Case, outputs: dict[str, torch.Tensor], rec: dict) -> KernelResult:
    """Compare one case's engine outputs with the oracle under the entry's tolerances."""
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


def results_document(results: list[KernelResult], info: dict) -> dict:
    """kernels.json: the run's facts and every result."""
    return {"format": "ds41-kernel-gate/1", **info, "results": [r.to_dict() for r in results]}
