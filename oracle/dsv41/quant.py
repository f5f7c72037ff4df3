"""DeepSeek-V4.1 run-time activation quantize-dequantize (weight-formats.md §8), exact in torch.

Public API (all return a tensor of the input's dtype and shape):

* ``act_quant_dequant(x, block=32, scale_fmt="ue8m0")``   -- ``QDQ8(x; B)``, §8.2
* ``fp4_act_quant_dequant(x, block=32, scale_fmt="ue8m0")`` -- ``QDQ4p`` (``"ue8m0"``) / ``QDQ4e`` (``"e4m3"``), §8.3

and the element helpers ``pow2ceil``, ``e4m3_rne``, ``e2m1_rne``.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0
# Multiplies by the fp32-rounded reciprocals, never divides (§8.1): fp32(1/448) has bits 0x3B124925.
_INV_448 = torch.tensor(1.0 / 448.0, dtype=torch.float32)
_INV_6 = torch.tensor(1.0 / 6.0, dtype=torch.float32)


def pow2ceil(t: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2 t) for positive normal fp32 ``t``, from the bits (§8.1; a float log2 can be 1 binade low)."""
    if t.dtype != torch.float32:
        raise TypeError(f"pow2ceil: expected float32, got {t.dtype}")
    u = t.contiguous().view(torch.int32)
    e = ((u >> 23) & 0xFF) + ((u & 0x7FFFFF) != 0).to(torch.int32)
    return (e << 23).view(torch.float32)


def e4m3_rne(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> nearest e4m3 value (ties to even), saturating at ±448; returned as fp32 (§3.2)."""
    v = v.float().clamp(-E4M3_MAX, E4M3_MAX)  # explicit clamp, as DeepSeek's kernels do
    return v.to(torch.float8_e4m3fn).to(torch.float32)


def e2m1_rne(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> nearest e2m1 value with the tie rules of §3.3 (ties go to the even code); fp32 out.

    Magnitude thresholds: ties at 0.25, 1.25, 2.5, 5 round down, at 0.75, 1.75, 3.5 round up.
    """
    v = v.float()
    a = v.abs().clamp(max=E2M1_MAX)
    q = torch.full_like(a, 6.0)
    # evaluated from the top down so the smallest matching bucket wins
    for bound, value, inclusive in ((5.0, 4.0, True), (3.5, 3.0, False), (2.5, 2.0, True), (1.75, 1.5, False),
                                    (1.25, 1.0, True), (0.75, 0.5, False), (0.25, 0.0, True)):
        hit = a <= bound if inclusive else a < bound
        q = torch.where(hit, torch.full_like(a, value), q)
    return torch.copysign(q, v)


def _blocks(x: torch.Tensor, block: int, who: str) -> torch.Tensor:
    if x.ndim == 0 or x.shape[-1] % block != 0:
        raise ValueError(f"{who}: last dimension {tuple(x.shape)} is not a multiple of block {block}")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)


def act_quant(x: torch.Tensor, block: int = 32, scale_fmt: str | None = "ue8m0") -> tuple[torch.Tensor, torch.Tensor]:
    """``act_quant`` (§8.2): returns (q as fp32 e4m3 values [..., n/B, B], scale fp32 [..., n/B, 1])."""
    g = _blocks(x, block, "act_quant")
    amax = g.abs().amax(dim=-1, keepdim=True).clamp(min=1e-4)
    t = amax * _INV_448
    if scale_fmt == "ue8m0":
        s = pow2ceil(t)
    elif scale_fmt is None:
        s = t
    else:
        raise ValueError(f"act_quant: unknown scale_fmt {scale_fmt!r} (expected 'ue8m0' or None)")
    return e4m3_rne(g / s), s


def act_quant_dequant(x: torch.Tensor, block: int = 32, scale_fmt: str | None = "ue8m0") -> torch.Tensor:
    """``QDQ8(x; B)``: DeepSeek's in-place (fake) FP8 activation quantization, in ``x.dtype`` (§8.2)."""
    q, s = act_quant(x, block, scale_fmt)
    return (q * s).reshape(x.shape).to(x.dtype)  # exact: q has 4 significant bits, s is 2^k


def fp4_act_quant(x: torch.Tensor, block: int = 32, scale_fmt: str = "ue8m0") -> tuple[torch.Tensor, torch.Tensor]:
    """``fp4_act_quant`` (§8.3): returns (q as fp32 e2m1 values, scale fp32 [..., n/B, 1]).

    ``scale_fmt="ue8m0"``: power-of-two scales (indexer q/k, B = 32);
    ``scale_fmt="e4m3"``: e4m3 scales (compressed KV latent, B = 16).
    """
    g = _blocks(x, block, "fp4_act_quant")
    amax = g.abs().amax(dim=-1, keepdim=True)
    if scale_fmt == "ue8m0":
        s = pow2ceil(amax.clamp(min=6.0 * 2.0**-126) * _INV_6)
    elif scale_fmt == "e4m3":
        s = e4m3_rne(amax.clamp(min=6.0 * 2.0**-9) / 6.0)  # a true fp32 division here (§8.3)
    else:
        raise ValueError(f"fp4_act_quant: unknown scale_fmt {scale_fmt!r} (expected 'ue8m0' or 'e4m3')")
    return e2m1_rne((g / s).clamp(-E2M1_MAX, E2M1_MAX)), s


def fp4_act_quant_dequant(x: torch.Tensor, block: int = 32, scale_fmt: str = "ue8m0") -> torch.Tensor:
    """``QDQ4p`` (``scale_fmt="ue8m0"``) / ``QDQ4e`` (``"e4m3"``), in ``x.dtype`` (§8.3)."""
    q, s = fp4_act_quant(x, block, scale_fmt)
    return (q * s).reshape(x.shape).to(x.dtype)  # exact: <= 2 + 4 significant bits
