"""The oracle's EXL3 decode against exllamav3 1.6.5's own CUDA reconstruct kernels (device tool only).

exllamav3 ships its CUDA sources in a pure-Python wheel and JIT-compiles all ~180 of them at import,
which does not fit a short device lease. This script compiles only the two kernels it compares, from
the wheel's unmodified sources, behind a four-line binding of our own:

* ``reconstruct``            → W_hat [in, out] fp16 (weight-formats.md §7.3–7.5, "Level A"):
                                must equal ``oracle.dsv41.formats.exl3_w_hat`` bit for bit;
* ``reconstruct_had_slice``  → the original-basis fp16 weight the engine's fused GEMM path multiplies
                                with (Hadamards and sign vectors folded in): compared with the oracle's
                                exact fp32 reconstruction ``exl3_dequant`` (Level B), in fp16 ULPs;
* a GEMM on that fp16 weight (torch fp16 matmul with fp32 accumulation, what hgemm does) against the
  oracle's fp32 matmul: relative error of y = x W^T.

    python scripts/gpu/exl3_vs_exllamav3.py --wheel .whl/exllamav3-1.6.5-py3-none-any.whl --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from oracle.dsv41 import formats as F  # noqa: E402

BINDING = r"""
#include <torch/extension.h>
#include "quant/reconstruct.cuh"
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("reconstruct", &reconstruct);
    m.def("reconstruct_had_slice", &reconstruct_had_slice);
}
"""


def build_ext(wheel: Path, work: Path):
    from torch.utils.cpp_extension import load

    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if name.startswith("exllamav3/exllamav3_ext/"):
                z.extract(name, work)
    src = work / "exllamav3" / "exllamav3_ext"
    (work / "binding.cpp").write_text(BINDING)
    flags = ["-O3", "-std=c++17", "-gencode=arch=compute_90,code=sm_90", "-lineinfo"]
    extra = []
    for attempt in range(3):
        try:
            return load(name=f"ds41_exl3_mini{attempt}", sources=[str(work / "binding.cpp"), str(src / "quant" / "reconstruct.cu"), *extra],
                        extra_include_paths=[str(src)], extra_cuda_cflags=flags, extra_cflags=["-O3", "-std=c++17"],
                        build_directory=str(work), verbose=False)
        except Exception as exc:  # an unresolved symbol: add the translation units that define helpers
            print(f"build attempt {attempt} failed: {str(exc)[-400:]}", flush=True)
            extra = [str(src / "util.cu"), str(src / "quant" / "util.cu")][: attempt + 1]
    raise SystemExit("could not build the reconstruct kernels")


def ulps_f16(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    ia = a.contiguous().view(torch.int16).to(torch.int32)
    ib = b.contiguous().view(torch.int16).to(torch.int32)
    # map sign-magnitude to a monotone integer line
    ia = torch.where(ia < 0, -32768 - ia, ia)
    ib = torch.where(ib < 0, -32768 - ib, ib)
    return (ia - ib).abs()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--wheel", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    t0 = time.time()
    ext = build_ext(args.wheel, Path(tempfile.mkdtemp(prefix="exl3mini-")))
    build_s = time.time() - t0
    g = torch.Generator().manual_seed(0)
    rows, all_ok = [], True
    kt, nt = 32, 32  # 512 x 512
    for cb in (0, 1, 2):
        for k2 in (2, 4, 6, 8, 10, 12, 14, 16):
            k = k2 / 2
            tr = torch.randint(-2**15, 2**15, (kt, nt, 8 * k2), generator=g, dtype=torch.int16)
            ours = F.exl3_w_hat(tr, cb, k2)
            theirs = torch.empty(16 * kt, 16 * nt, dtype=torch.float16, device=dev)
            ext.reconstruct(theirs, tr.to(dev), k, cb == 1, cb == 2)
            torch.cuda.synchronize()
            diff_a = int((ours.view(torch.int16) != theirs.cpu().view(torch.int16)).sum())
            # Level B: original-basis weight, oracle exact fp32 vs kernel fp16
            suh = (torch.randn(16 * kt, generator=g).sign() * (1 + torch.rand(16 * kt, generator=g))).half()
            svh = (torch.randn(16 * nt, generator=g).sign() * 0.01 * (1 + torch.rand(16 * nt, generator=g))).half()
            w32 = F.exl3_dequant(tr, suh, svh, cb)  # [out, in] fp32
            wk = torch.empty(16 * kt, 16 * nt, dtype=torch.float16, device=dev)
            ext.reconstruct_had_slice(wk, tr.to(dev), suh.to(dev), svh.to(dev), k, cb == 1, cb == 2, 0)
            torch.cuda.synchronize()
            wk_t = wk.cpu().t().contiguous()  # → [out, in]
            ref16 = w32.to(torch.float16)
            u = ulps_f16(ref16, wk_t)
            rel_b = float(((wk_t.float() - w32).abs().max() / w32.abs().max()))
            # GEMM: fp16 weight × fp16 activations with fp32 accumulation vs the oracle's fp32 matmul
            x = torch.randn(64, 16 * kt, generator=g)
            y_ref = x.double() @ w32.double().t()
            y_k = (x.half().to(dev) @ wk.to(dev)).float().cpu()
            rel_gemm = float((y_k.double() - y_ref).norm() / y_ref.norm())
            ok = diff_a == 0
            all_ok &= ok
            rows.append({"codebook": F.CODEBOOKS[cb], "K": k, "level_a_differing": diff_a,
                         "level_b_max_ulp_f16": int(u.max()), "level_b_mean_ulp_f16": float(u.float().mean()),
                         "level_b_max_rel": rel_b, "gemm_rel_l2": rel_gemm})
            print(json.dumps(rows[-1]), flush=True)
    result = {"exllamav3": args.wheel.name, "torch": torch.__version__, "device": torch.cuda.get_device_name(),
              "build_seconds": round(build_s, 1), "shape_in_out": [16 * kt, 16 * nt], "rows": rows,
              "level_a_all_identical": all_ok}
    args.out.write_text(json.dumps(result, indent=2))
    print("LEVEL A ALL IDENTICAL" if all_ok else "LEVEL A MISMATCHES FOUND")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
