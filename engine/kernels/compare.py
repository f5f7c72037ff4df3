"""Pure comparison functions for kernel gates: ULP distance through integer views, error statistics,
tolerance verdicts. Torch tensors in, small records out; no IO."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

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
class Tolerance:
    """Per-output tolerance. ``exact``: every element bit-identical to the oracle rounded to the output
    dtype. Otherwise an element passes when its ULP distance (in the output dtype) is <= ``max_ulp`` or its
    absolute error is <= ``atol`` or <= ``row_rtol`` times the largest |oracle| value of its row (the last
    two for values near zero after cancellation, where a ULP count says nothing)."""

    exact: bool = False
    max_ulp: int = 0
    atol: float = 0.0
    row_rtol: float = 0.0  # |error| <= row_rtol * max|oracle| over the element's row (last dim)

    def __post_init__(self):
        if self.max_ulp < 0 or self.atol < 0 or self.row_rtol < 0:
            raise ValueError(f"tolerance: max_ulp ({self.max_ulp}), atol ({self.atol}) and row_rtol "
                             f"({self.row_rtol}) must be >= 0")


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
