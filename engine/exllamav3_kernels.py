"""Kernel gate on the GPU: exllamav3's own EXL3 matmul kernels beside the oracle's exact EXL3 decode.

For each codebook (3inst, mcg, mul1) and K in 2..5, a random trellis with random sign/scale vectors (``suh``,
``svh``) is decoded by the oracle (``oracle.dsv41.formats.exl3_dequant``: the canonical fp32 weight, exact) and
multiplied in float64 with fp16-representable activations: the reference ``y_ref``. exllamav3's kernels get the
same trellis, vectors and activations:

* ``exl3_gemv``  — ``ext.exl3_gemm`` at m = 1 (the decode path; the kernel picks its GEMV tiling);
* ``exl3_gemm``  — ``ext.exl3_gemm`` at m = 64 (the short-prefill path, below the reconstruct threshold 144);
* ``exl3_mgemm`` — ``ext.exl3_mgemm`` over 4 matrices sharing the input (the multi-matrix path the MoE experts,
  the q/kv bundles and DeepSeek-V4's wo_a slices use at decode), each matrix its own trellis and vectors;
* ``recon_hgemm`` — ``ext.reconstruct_had_slice`` (fp16 original-basis weight) + a cuBLAS fp16 GEMM with fp32
  accumulation (exllamav3's long-prefill path, m = 256).

Measure: max relative error ``max|y - y_ref| / max|y_ref|``. Floor: the same measure for the ideal fp16 kernel,
``x16 @ fp16(W)`` accumulated in float64 and rounded once to fp16 — what any fp16-weight kernel must at least
lose. Verdict PASS when error <= ``FACTOR`` x floor (FACTOR = 8: the kernels also round the Hadamard-rotated
input and accumulate partial sums in fp32/fp16). Planted can-fails, each expected to FAIL: the trellis read at
the wrong K, ``suh`` and ``svh`` swapped, one 16x16 trellis tile perturbed.

``python -m engine.exllamav3_kernels --out gpu_kernels_h200.json`` (needs exllamav3 with its built extension).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

import torch

from oracle.dsv41 import formats as F

FACTOR = 8.0
CODEBOOKS = {"3inst": 0, "mcg": 1, "mul1": 2}
KS = (2, 3, 4, 5)
PLANTED = ("wrong_k", "swapped_sign_vectors", "perturbed_tile")


@dataclass
class Weights:
    trellis: torch.Tensor   # [in/16, out/16, 16K] int16
    suh: torch.Tensor       # [in] fp16
    svh: torch.Tensor       # [out] fp16
    cb: int
    k: int


def random_weights(n_in: int, n_out: int, k: int, cb: int, g: torch.Generator) -> Weights:
    tr = torch.randint(-2 ** 15, 2 ** 15, (n_in // 16, n_out // 16, 16 * k), generator=g, dtype=torch.int16)
    suh = (torch.randn(n_in, generator=g).sign() * (1 + torch.rand(n_in, generator=g))).half()
    svh = (torch.randn(n_out, generator=g).sign() * 0.01 * (1 + torch.rand(n_out, generator=g))).half()
    return Weights(tr, suh, svh, cb, k)


def plant(w: Weights, fault: str, g: torch.Generator) -> Weights:
    """The weights as a broken kernel or loader would see them (the oracle keeps the true ones)."""
    if fault == "wrong_k":      # the same bits read as K - 1 (a wrong bitrate from config or a mis-sized tensor)
        kk = w.k - 1 if w.k > 2 else w.k + 1
        return Weights(w.trellis[..., : 16 * kk].contiguous() if kk < w.k else
                       torch.cat([w.trellis, w.trellis[..., :16]], -1).contiguous(), w.suh, w.svh, w.cb, kk)
    if fault == "swapped_sign_vectors":  # suh and svh exchanged (square weight; a loader mixing the two names)
        if w.suh.numel() != w.svh.numel():
            raise ValueError("swapped_sign_vectors needs a square weight")
        return Weights(w.trellis, w.svh.clone(), w.suh.clone(), w.cb, w.k)
    if fault == "perturbed_tile":  # one 16x16 tile's packed bits replaced (a bad copy or a bit flip in memory)
        tr = w.trellis.clone()
        tr[0, 0] = torch.randint(-2 ** 15, 2 ** 15, tr[0, 0].shape, generator=g, dtype=torch.int16)
        return Weights(tr, w.suh, w.svh, w.cb, w.k)
    raise ValueError(f"unknown planted fault {fault!r}; known {PLANTED}")


def reference(w: Weights, x: torch.Tensor) -> torch.Tensor:
    """y_ref = x @ W^T in float64 with W the oracle's exact fp32 decode (x already fp16-representable)."""
    W = F.exl3_dequant(w.trellis, w.suh, w.svh, w.cb).double()
    return x.double() @ W.t()


def floor_of(w: Weights, x: torch.Tensor, y_ref: torch.Tensor) -> float:
    W16 = F.exl3_dequant(w.trellis, w.suh, w.svh, w.cb).half().double()
    y = (x.double() @ W16.t()).half().double()
    return max_rel(y, y_ref)


def max_rel(y: torch.Tensor, y_ref: torch.Tensor) -> float:
    return float((y.double() - y_ref).abs().max() / y_ref.abs().max().clamp_min(1e-300))


def verdict(err: float, floor: float, factor: float = FACTOR) -> str:
    if err != err or err == float("inf"):
        return "FAIL"
    return "PASS" if err <= factor * floor else "FAIL"


# ---------------------------------------------------------------------------------------------- GPU runners
def _flags(cb: int) -> tuple[bool, bool]:
    return cb == 1, cb == 2


def run_gemm(ext, w: Weights, x: torch.Tensor, dev) -> torch.Tensor:
    mcg, mul1 = _flags(w.cb)
    a = x.half().to(dev).contiguous()
    c = torch.empty(a.shape[0], w.svh.numel(), dtype=torch.float32, device=dev)
    had = torch.empty_like(a)
    ext.exl3_gemm(a, w.trellis.to(dev), c, w.suh.to(dev), had, w.svh.to(dev), -1, mcg, mul1, 0)
    torch.cuda.synchronize()
    return c.cpu()


def run_mgemm(ext, ws: list[Weights], x: torch.Tensor, dev) -> torch.Tensor:
    mcg, mul1 = _flags(ws[0].cb)
    k = ws[0].k
    tr = [w.trellis.to(dev).contiguous() for w in ws]
    su = [w.suh.to(dev).contiguous() for w in ws]
    sv = [w.svh.to(dev).contiguous() for w in ws]
    ptr = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.long, device=dev)
    m, n_in, n_out = x.shape[0], x.shape[1], ws[0].svh.numel()
    a = x.half().to(dev).view(1, m, n_in).contiguous()
    c = torch.empty(len(ws), m, n_out, dtype=torch.half, device=dev)
    had = torch.empty(len(ws), m, n_in, dtype=torch.half, device=dev)
    ext.exl3_mgemm(a, ptr(tr), c, ptr(su), had, ptr(sv), None, None, float(k), -1, mcg, mul1, -1, -1, 0, 1,
                   None, None)
    torch.cuda.synchronize()
    return c.float().cpu()


def run_recon_hgemm(ext, w: Weights, x: torch.Tensor, dev) -> torch.Tensor:
    mcg, mul1 = _flags(w.cb)
    wk = torch.empty(w.suh.numel(), w.svh.numel(), dtype=torch.half, device=dev)
    ext.reconstruct_had_slice(wk, w.trellis.to(dev), w.suh.to(dev), w.svh.to(dev), w.k, mcg, mul1, 0)
    y = torch.matmul(x.half().to(dev), wk)   # cuBLAS fp16 GEMM, fp32 accumulation (what hgemm does)
    torch.cuda.synchronize()
    return y.float().cpu()


def run_cases(ext, dev="cuda", n: int = 512, seed: int = 0, log=print) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    cases = []

    def add(kernel, k, cb_name, err, floor, planted=None, m=None, note=""):
        v = verdict(err, floor)
        row = {"kernel": kernel, "k": k, "codebook": cb_name, "verdict": v, "max_rel_err": err, "floor": floor,
               "ratio": err / floor if floor else None, "factor": FACTOR, "m": m, "shape_in_out": [n, n],
               "planted": planted, "expected": "FAIL" if planted else "PASS", "detected": (v == "FAIL") if planted
               else None, "note": note}
        cases.append(row)
        log(json.dumps({k_: row[k_] for k_ in ("kernel", "k", "codebook", "planted", "max_rel_err", "floor",
                                                "verdict")}))

    for cb_name, cb in CODEBOOKS.items():
        for k in KS:
            w = random_weights(n, n, k, cb, g)
            for kernel, m in (("exl3_gemv", 1), ("exl3_gemm", 64), ("recon_hgemm", 256)):
                x = torch.randn(m, n, generator=g).half().float()
                y_ref = reference(w, x)
                floor = floor_of(w, x, y_ref)
                run = run_gemm if kernel != "recon_hgemm" else run_recon_hgemm
                add(kernel, k, cb_name, max_rel(run(ext, w, x, dev), y_ref), floor, m=m)
            ws = [w] + [random_weights(n, n, k, cb, g) for _ in range(3)]
            x = torch.randn(4, n, generator=g).half().float()
            errs, floors = [], []
            y = run_mgemm(ext, ws, x, dev)
            for i, wi in enumerate(ws):
                y_ref = reference(wi, x)
                errs.append(max_rel(y[i], y_ref))
                floors.append(floor_of(wi, x, y_ref))
            add("exl3_mgemm", k, cb_name, max(errs), max(floors), m=4, note="4 matrices, worst one")
    # planted can-fails on the decode GEMV and the multi-matrix path (mul1, the codebook exllamav3 writes today)
    for fault in PLANTED:
        for k in (2, 4):
            w = random_weights(n, n, k, 2, g)
            bad = plant(w, fault, g)
            x = torch.randn(1, n, generator=g).half().float()
            y_ref = reference(w, x)
            add("exl3_gemv", k, "mul1", max_rel(run_gemm(ext, bad, x, dev), y_ref), floor_of(w, x, y_ref),
                planted=fault, m=1)
            ws = [bad] + [random_weights(n, n, bad.k, 2, g) for _ in range(3)]
            x4 = torch.randn(4, n, generator=g).half().float()
            y_ref4 = reference(w, x4)
            add("exl3_mgemm", k, "mul1", max_rel(run_mgemm(ext, ws, x4, dev)[0], y_ref4), floor_of(w, x4, y_ref4),
                planted=fault, m=4)
    return cases


def summary(cases: list[dict]) -> dict:
    real = [c for c in cases if not c["planted"]]
    planted = [c for c in cases if c["planted"]]
    return {"cases": len(cases), "pass": sum(c["verdict"] == "PASS" for c in real), "of": len(real),
            "worst_ratio": max((c["ratio"] for c in real if c["ratio"] is not None), default=None),
            "planted_detected": sum(bool(c["detected"]) for c in planted), "planted": len(planted),
            "gate_passed": all(c["verdict"] == "PASS" for c in real) and all(c["detected"] for c in planted)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.exllamav3_kernels", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=512)
    a = ap.parse_args(argv)
    t0 = time.time()
    from exllamav3.ext import exllamav3_ext as ext

    import exllamav3

    import os

    mode = os.environ.get("EXL3_INT8_GEMV", "2")   # exllamav3's CUDA default is 2 (exl3_gemv_int8.cu)
    cases = run_cases(ext, "cuda", a.n)
    for c in cases:
        c["exl3_int8_gemv"] = int(mode)
    res = {"what": "exllamav3 EXL3 kernels vs the oracle's exact EXL3 decode + float64 GEMM",
           "exl3_int8_gemv": int(mode),
           "exllamav3": getattr(exllamav3, "__version__", "?"), "torch": torch.__version__,
           "device": torch.cuda.get_device_name(), "seconds": round(time.time() - t0, 1), "factor": FACTOR,
           "summary": summary(cases), "cases": cases}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res["summary"]))
    return 0 if res["summary"]["gate_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
