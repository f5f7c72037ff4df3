"""Precision modes (§5) and the numerical primitives the forward pass shares (§6, §18.3).

The oracle keeps every tensor in fp32. The `reference-bf16` mode reproduces the reference's bf16
roundings by rounding an fp32 value to bf16 (round-to-nearest-even) and back, at exactly the points
§5.3 lists; `fp32` mode makes the same calls a no-op. The activation quantize-dequantize steps (QDQ)
belong to the model's forward and are applied in both modes (§5.2).

The QDQ primitives themselves are oracle/dsv41/quant.py (weight-formats.md §8); this module only
names them as the architecture document does (QDQ8, QDQ4p, QDQ4e).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from . import rope
from .quant import act_quant_dequant, fp4_act_quant_dequant

PRECISION_MODES = ("fp32", "reference-bf16")



# Activation quantize-dequantize (weight-formats.md §8) lives in quant.py (the loader work owns it).
def qdq8(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """QDQ8 = act_quant with ue8m0 scales, quantize then dequantize (§6.1)."""
    return act_quant_dequant(x, block, "ue8m0")


def qdq4p(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """QDQ4p = fp4_act_quant with power-of-two scales (§6.1); indexer q and k."""
    return fp4_act_quant_dequant(x, block, "ue8m0")


def qdq4e(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """QDQ4e = fp4_act_quant with E4M3 scales (§6.1); the compressed latent."""
    return fp4_act_quant_dequant(x, block, "e4m3")


# ----------------------------------------------------------------------------------------------
# Deterministic top-k (§18.3) with tie accounting
# ----------------------------------------------------------------------------------------------


@dataclass
class TieStats:
    """Counts, per selection site, the rows whose k-th and (k+1)-th best finite scores are equal,
    i.e. where the tie rule (not the scores) decided the selection."""

    counts: dict[str, int] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)

    def add(self, site: str, ties: int, rows: int) -> None:
        self.counts[site] = self.counts.get(site, 0) + ties
        self.rows[site] = self.rows.get(site, 0) + rows

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def topk_lowest_index(scores: torch.Tensor, k: int, stats: TieStats | None = None, site: str = "topk"):
    """Top-k along the last dim: higher score first, then lower index (§18.3). Returns (values, indices)
    in that rank order. A stable descending sort keeps equal scores in index order."""
    n = scores.shape[-1]
    if not 0 <= k <= n:
        raise ValueError(f"topk at {site}: k={k} outside 0..{n}")
    vals, idx = torch.sort(scores, dim=-1, descending=True, stable=True)
    if stats is not None and 0 < k < n:
        kth, nxt = vals[..., k - 1], vals[..., k]
        tie = (kth == nxt) & torch.isfinite(kth)
        stats.add(site, int(tie.sum()), int(tie.numel()))
    return vals[..., :k], idx[..., :k]


# ----------------------------------------------------------------------------------------------
# Precision mode
# ----------------------------------------------------------------------------------------------


class _F64Scratch(threading.local):
    """Reusable float64 copies of fp32 weights, one per shape (at most `limit` bytes in all, oldest out).

    A fresh float64 tensor per call means fresh pages: measured on a 1024 x 2048 expert with 12 rows,
    6.4 ms per product with `w.double()` against 1.1 ms copying into a reused buffer. Only the weight goes
    through here, and the copy is consumed by the product before the next call reuses the buffer."""

    limit = 1 << 29

    def __init__(self):
        self.bufs: dict[tuple, torch.Tensor] = {}

    def f64(self, w: torch.Tensor) -> torch.Tensor:
        if w.dtype == torch.float64:
            return w
        need = w.numel() * 8
        if need > self.limit // 2:
            return w.double()
        key = (tuple(w.shape), w.device)
        buf = self.bufs.pop(key, None)
        if buf is None:
            while self.bufs and sum(b.numel() * 8 for b in self.bufs.values()) + need > self.limit:
                self.bufs.pop(next(iter(self.bufs)))
            with torch.inference_mode(False):  # a normal tensor: writable inside and outside inference mode
                buf = torch.empty(w.shape, dtype=torch.float64, device=w.device)
        self.bufs[key] = buf  # most recently used last
        return buf.copy_(w)


_SCRATCH = _F64Scratch()


def mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T for fp32 operands, accumulated in float64 and rounded once to fp32.

    Each fp32 x fp32 product is exact in float64, so the result is the correctly rounded fp32 dot
    product except within ~2^-29 of a rounding boundary. This makes every output row independent of
    the BLAS blocking, i.e. of how many rows (tokens, sequences) share the call: without it, fp32 noise of
    a few ulp between a prefill GEMM and a decode GEMM is amplified by the QDQ roundings, top-k and
    routing into visible logit differences (measured: 6e-2 relative on the tiny model)."""
    return (x.double() @ _SCRATCH.f64(w).T).float()


def einsum(eq: str, *ops: torch.Tensor) -> torch.Tensor:
    """torch.einsum accumulated in float64, rounded once to fp32 (see `mm`)."""
    return torch.einsum(eq, *(o.double() for o in ops)).float()


def in_f64(fn, *xs: torch.Tensor) -> torch.Tensor:
    """fn evaluated on float64 copies of fp32 operands, rounded once to fp32.

    torch's CPU sigmoid / softplus / silu take a vectorised or a scalar path depending on the tensor's
    shape, so the same value gives results 1 ulp apart in a 1-row decode call and a 20-row prefill call
    (measured: 12 of 2,960 sigmoid values). A QDQ rounding or a top-k turns such an ulp into a visible
    logit difference. In float64 the paths still differ, but ~2^-29 below fp32 resolution, so the
    rounded fp32 result is the same (the correctly rounded one) except within that distance of a
    rounding boundary. Sums go through here too, for the same reason (reduction order follows shape)."""
    return fn(*(x.double() for x in xs)).float()


def sum_f64(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """x.sum(dim) in float64, rounded once to fp32 (reduction order follows shape, see `in_f64`)."""
    return x.double().sum(dim, keepdim=keepdim).float()


def rstd_f64(x: torch.Tensor, eps: float, keepdim: bool = False) -> torch.Tensor:
    """1 / sqrt(mean(x^2, last dim) + eps) in float64, rounded once to fp32: every RMS statistic."""
    return torch.rsqrt(x.double().square().mean(-1, keepdim=keepdim) + eps).float()


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float32)


def aligned(t: torch.Tensor) -> torch.Tensor:
    """`t`, copied to a fresh (64-byte aligned) allocation when its data is not 64-byte aligned.

    CPU BLAS results depend on operand alignment, not only on shapes (measured: a 1-row fp32 F.linear
    against the same 24 x 1024 weight differs by up to 1.9e-7 for 4/8/12-byte offsets from a 16-byte
    boundary). The reference's parameters are fresh torch allocations; tensors read from a memory-mapped
    checkpoint can sit at any offset."""
    return t if t.data_ptr() % 64 == 0 else t.clone()


def blocked_gemm(x: torch.Tensor, w: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x @ w.T the way the reference's fp8/fp4 GEMM kernels accumulate: one fp32 product per K block of
    `block`, the block results added in K order to an fp32 accumulator starting at zero.

    The operands are dequantised values (quantised value x power-of-two scale); scaling by a power of two
    commutes with every fp32 rounding, so each block product equals the kernel's (unscaled block product)
    x a_s x b_s exactly, and the sum matches its order."""
    k = x.shape[-1]
    if k % block:
        raise ValueError(f"blocked_gemm: inner dimension {k} is not a multiple of {block}")
    rows, w = aligned(x.reshape(-1, k)), aligned(w)
    acc = torch.zeros(rows.shape[0], w.shape[0], dtype=torch.float32, device=x.device)
    for k0 in range(0, k, block):
        acc += rows[:, k0:k0 + block] @ w[:, k0:k0 + block].T
    return acc.view(*x.shape[:-1], w.shape[0])


@dataclass
class Numerics:
    """The precision mode (§5.2 / §5.3) plus the per-run tie statistics.

    `r(x)` marks a point where the reference rounds to bf16; it is the identity in `fp32` mode."""

    mode: str = "fp32"
    ties: TieStats = field(default_factory=TieStats)

    def __post_init__(self):
        if self.mode not in PRECISION_MODES:
            raise ValueError(f"precision mode {self.mode!r}: expected one of {PRECISION_MODES}")

    @property
    def bf16(self) -> bool:
        return self.mode == "reference-bf16"

    def r(self, x: torch.Tensor) -> torch.Tensor:
        return _bf16(x) if self.bf16 else x

    # The two contracts. fp32 mode: every shape- or device-dependent fp32 operation in float64, rounded once
    # (decode == prefill, CPU == CUDA, bit for bit). reference-bf16 mode: the reference's own operation in the
    # reference's dtype and order (fp32 torch op where it computes fp32, a bf16 tensor op where it computes
    # bf16), so that the same torch build on the same machine gives the reference's numbers, including their
    # dependence on how many rows share a call.

    def topk(self, scores: torch.Tensor, k: int, site: str, sorted: bool = True):
        """Top-k along the last dim -> (values, indices), ties counted per site in both modes.

        fp32 mode: higher score first, then lower index (§18.3, `topk_lowest_index`). reference-bf16 mode:
        torch.topk as the reference calls it (`sorted` as there), so equal scores are decided as the
        reference's torch build decides them for that shape."""
        if not self.bf16:
            return topk_lowest_index(scores, k, self.ties, site)
        n = scores.shape[-1]
        if not 0 <= k <= n:
            raise ValueError(f"topk at {site}: k={k} outside 0..{n}")
        if 0 < k < n:
            ranked = torch.sort(scores, dim=-1, descending=True).values
            kth, nxt = ranked[..., k - 1], ranked[..., k]
            tie = (kth == nxt) & torch.isfinite(kth)
            self.ties.add(site, int(tie.sum()), int(tie.numel()))
        out = torch.topk(scores, k, dim=-1, sorted=sorted)
        return out.values, out.indices

    def rope_cis(self, freqs: torch.Tensor, positions: torch.Tensor, table_len: int) -> torch.Tensor:
        """RoPE rotations of `positions`; reference-bf16 mode takes them from the reference's fp32 table."""
        if self.bf16:
            return rope.rope_cis_reference_order(freqs, positions, table_len)
        return rope.rope_cis(freqs, positions)

    def rope(self, x: torch.Tensor, cis: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """Rotate the RoPE tail of x; the reference's complex64 product in reference-bf16 mode."""
        if self.bf16:
            return rope.apply_rope_reference_order(x, cis, inverse)
        return rope.apply_rope(x, cis, inverse)

    def f32(self, fn, *xs: torch.Tensor) -> torch.Tensor:
        """`fn` where the reference evaluates it on fp32 tensors."""
        return fn(*xs) if self.bf16 else in_f64(fn, *xs)

    def on_bf16(self, fn, *xs: torch.Tensor) -> torch.Tensor:
        """`fn` where the reference evaluates it on bf16 tensors (bf16 result, widened back to fp32)."""
        if self.bf16:
            return fn(*(x.to(torch.bfloat16) for x in xs)).float()
        return in_f64(fn, *xs)

    def sum(self, x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
        """An fp32 sum of the reference (torch's fp32 reduction in reference-bf16 mode)."""
        return x.sum(dim, keepdim=keepdim) if self.bf16 else sum_f64(x, dim, keepdim)

    def fp32_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """A linear the reference runs as an fp32 F.linear (fp32 weight: head, router, ratio-2 compressor)."""
        return torch.nn.functional.linear(aligned(x), aligned(w)) if self.bf16 else mm(x, w)

    def qlinear(self, x: torch.Tensor, w: torch.Tensor, block: int = 32, gemm_block: int | None = None,
                fmt: str | None = "ue8m0") -> torch.Tensor:
        """A linear whose reference weight is FP8/FP4: QDQ8 on the input (one scale per `block` channels:
        32 in V4.1, 128 in V4; `fmt` its scale format), then the GEMM; in reference mode accumulated per
        `gemm_block`-wide (default `block`) K block like the kernel and rounded to bf16 (§5.1, §6.2)."""
        xq = qdq8(x, block) if fmt == "ue8m0" else act_quant_dequant(x, block, fmt)
        if self.bf16:
            return _bf16(blocked_gemm(xq, w, gemm_block or block))
        return mm(xq, w)

    def linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """A plain bf16-weight linear (no activation QDQ); a bf16 F.linear in reference mode. A bias is added
        before the single rounding (fp32 mode: in float64, like the product)."""
        if self.bf16:
            b = None if bias is None else bias.to(torch.bfloat16)
            return torch.nn.functional.linear(x.to(torch.bfloat16), w.to(torch.bfloat16), b).float()
        if bias is None:
            return mm(x, w)
        return (x.double() @ _SCRATCH.f64(w).T + bias.double()).float()

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """§5.1 RMSNorm; eps = 1e-20 in the LLM."""
        if self.bf16:  # the reference: fp32 mean of squares, rsqrt, weight * x, cast to bf16
            return _bf16(weight * (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)))
        # the statistic in float64 (rounded once), independent of the row count (see `mm`)
        y = x * rstd_f64(x, eps, keepdim=True)
        return weight * y
