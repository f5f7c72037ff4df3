"""A CPU stand-in for `fast_hadamard_transform.hadamard_transform` (Dao-AILab/fast-hadamard-transform, CUDA only),
for running DeepSeek's V4 reference `rotate_activation` on the CPU (tests/oracle/dsv4_reference_harness.py
installs this module as `fast_hadamard_transform` before the reference is imported).

What the CUDA kernel computes, read from its source (csrc/fast_hadamard_transform_cuda.cu and
fast_hadamard_transform_common.h, v1.1.0): each row is loaded and converted to fp32 (`load_input`); the
unnormalised Walsh-Hadamard transform (Sylvester order, = x @ scipy.linalg.hadamard(d)) runs as radix-2
butterflies on fp32 registers - `a + b`, `a - b` inside a thread over strides 1, 2, 4 of its 8 contiguous
bf16 elements (`hadamard_mult_thread`), then `sign * x + x_other` across warp lanes (`hadamard_mult_warp`,
strides 8, 16, ...), then across warps and register chunks for the larger sizes, every stage in that
increasing-stride order for the power-of-two sizes DeepSeek uses; `store_output` multiplies by `scale`
(a C++ `float`) in fp32 and converts to the input dtype (round to nearest even). So the result is
bf16(fp32(butterfly_fp32(x)) * fp32(scale)); whenever no butterfly partial sum needs more than fp32's 24
bits - always for bf16 inputs of moderate exponent range - that equals bf16(fp32(x @ H) * fp32(scale)) with the
product exact, which is how tests/oracle/test_fast_hadamard_cpu.py checks this module (scipy's matrix in
float64).

This implementation: the same fp32 butterflies, written as one stage per stride over the whole row
(`torch.stack` of the sums and differences), then the fp32 scale product and the cast.
"""

from __future__ import annotations

import torch


def hadamard_transform(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """x [..., d] (d a power of two; fp32, fp16 or bf16) -> x @ H_d * scale in x's dtype, computed as the
    CUDA kernel does (fp32 butterflies of increasing stride, fp32 scale product, one cast)."""
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"hadamard_transform: dtype {x.dtype} (the kernel takes fp32, fp16, bf16)")
    d = x.shape[-1]
    if d < 1 or d & (d - 1):
        raise ValueError(f"hadamard_transform: last dim {d} is not a power of two (this stand-in pads nothing)")
    v = x.float().reshape(-1, d)
    stride = 1
    while stride < d:
        pairs = v.view(v.shape[0], d // (2 * stride), 2, stride)
        lo, hi = pairs[:, :, 0, :], pairs[:, :, 1, :]
        v = torch.stack([lo + hi, lo - hi], dim=2).reshape(v.shape[0], d)
        stride *= 2
    out = v * torch.tensor(scale, dtype=torch.float32)  # `out_vals[c][i] * scale`, float * float
    return out.to(x.dtype).reshape(x.shape)
