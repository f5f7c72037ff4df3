"""RoPE with YaRN (§10): fp32 frequencies, fp32 angles, interleaved pairs on the last rd channels."""

from __future__ import annotations

import math

import torch

from .config import ModelConfig


def rope_frequencies(rd: int, base: float, original_seq_len: int = 0, factor: float = 1.0,
                     beta_fast: int = 32, beta_slow: int = 1) -> torch.Tensor:
    """f_i = 1 / base^(2i/rd) in fp32; YaRN whenever original_seq_len > 0 (§10), independent of length.

    Always built on the CPU, as the reference builds its table (§20.2 publishes those fp32 values): a CUDA
    fp32 pow can land an ulp away, and the GPU mode must use the same table."""
    freqs = 1.0 / (base ** (torch.arange(0, rd, 2, dtype=torch.float32, device="cpu") / rd))
    if original_seq_len > 0:
        def corrected_dim(rotations: float) -> float:
            return rd * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corrected_dim(beta_fast)), 0)
        high = min(math.ceil(corrected_dim(beta_slow)), rd - 1)
        ramp = ((torch.arange(rd // 2, dtype=torch.float32, device="cpu") - low) / max(high - low, 1e-3)).clamp(0, 1)
        # the reference's operation order: (f / factor) * ramp + f * (1 - ramp), all fp32
        smooth = 1 - ramp
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    return freqs


def layer_frequencies(cfg: ModelConfig, layer_id: int) -> torch.Tensor:
    """Ratio > 0: compress_rope_theta with YaRN; ratio 0 (incl. MTP stages): rope_theta, no YaRN (§10)."""
    if cfg.ratio(layer_id) > 0:
        return rope_frequencies(cfg.rope_head_dim, cfg.compress_rope_theta, cfg.original_seq_len,
                                cfg.rope_factor, cfg.beta_fast, cfg.beta_slow)
    return rope_frequencies(cfg.rope_head_dim, cfg.rope_theta, 0)


def rope_cis(freqs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """complex64 [n, rd/2]; angle = fp32(pos) * f_i rounded to fp32 (an fp32 outer product, §10.5 of §5.2);
    cos and sin of that fp32 angle in float64, rounded once (the same on every device)."""
    angles = torch.outer(positions.to(torch.float32), freqs.to(positions.device)).double()
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64)


_REFERENCE_TABLES: dict[tuple, torch.Tensor] = {}


def rope_cis_reference_order(freqs: torch.Tensor, positions: torch.Tensor, table_len: int) -> torch.Tensor:
    """complex64 [n, rd/2] as the reference builds it: torch.polar over its whole fp32 angle table of
    `table_len` (= max_seq_len) rows at once (cos / sin in fp32, evaluated for that table shape), then
    indexed by position."""
    need = int(positions.max()) + 1 if positions.numel() else 0
    # beyond max_seq_len the reference has no table at all; a longer one keeps the oracle running there
    n = max(int(table_len), need)
    key = (tuple(freqs.tolist()), n)
    table = _REFERENCE_TABLES.get(key)
    if table is None:
        angles = torch.outer(torch.arange(n, device="cpu"), freqs.cpu())
        table = _REFERENCE_TABLES[key] = torch.polar(torch.ones_like(angles), angles)
    return table[positions.cpu()].to(positions.device)


def apply_rope_reference_order(x: torch.Tensor, cis: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """The reference's fp32 complex64 product (x as complex pairs times cis, or its conjugate)."""
    rd = 2 * cis.shape[-1]
    head, tail = x[..., :-rd], x[..., -rd:]
    z = torch.view_as_complex(tail.float().contiguous().unflatten(-1, (-1, 2)))
    c = cis.conj() if inverse else cis
    c = c.view(1, c.shape[0], *([1] * (x.ndim - 3)), c.shape[-1])
    return torch.cat([head, torch.view_as_real(z * c).flatten(-2)], dim=-1)


def apply_rope(x: torch.Tensor, cis: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last 2*cis.size(-1) channels of x as adjacent (even, odd) complex pairs.

    x: [b, s, d] or [b, s, h, d]; cis: [s, rd/2]. Returns a new tensor (the rest of x unchanged)."""
    rd = 2 * cis.shape[-1]
    head, tail = x[..., :-rd], x[..., -rd:]
    # the complex product in float64, rounded once: fp32 complex multiplies are contracted into FMAs on
    # CUDA but not on the CPU, an ulp apart, and the QDQ8 after RoPE can amplify one ulp (numerics.in_f64)
    z = torch.view_as_complex(tail.double().contiguous().unflatten(-1, (-1, 2)))
    c = (cis.conj() if inverse else cis).to(torch.complex128)
    c = c.view(1, c.shape[0], *([1] * (x.ndim - 3)), c.shape[-1])
    rot = torch.view_as_real(z * c).flatten(-2).float()
    return torch.cat([head, rot], dim=-1)
