"""Compare our EXL3 decode with exllamav3's CUDA kernel (weight-formats.md §7.12). Needs a CUDA machine with
``exllamav3==1.6.5`` installed (its extension JIT-builds at import). Not run in CI.

Checks Level A bit-for-bit: ``exllamav3_ext.reconstruct(out, trellis, K, mcg, mul1)`` writes ``W_hat`` [in, out]
in fp16, which must equal ``oracle.dsv41.formats.exl3_w_hat`` for every K (1..8, and 1.5/2.5/3.5 with mul1)
and codebook; with ``--pack DIR`` also every EXL3 tensor of a pack folder. Level B is built from W_hat, so
Level A equality carries over to it.

    python scripts/gpu_exl3_check.py [--pack DIR] [--limit 64]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from oracle.dsv41 import formats as F  # noqa: E402


def gpu_w_hat(ext, trellis: torch.Tensor, k2: int, cb: int) -> torch.Tensor:
    out = torch.empty(16 * trellis.shape[0], 16 * trellis.shape[1], dtype=torch.float16, device="cuda")
    ext.reconstruct(out, trellis.cuda(), k2 / 2, cb == 1, cb == 2)
    torch.cuda.synchronize()
    return out.cpu()


def compare(ext, name: str, trellis: torch.Tensor, cb: int) -> bool:
    k2 = F.exl3_k2(trellis.shape, cb, name)
    ours, theirs = F.exl3_w_hat(trellis, cb, k2), gpu_w_hat(ext, trellis, k2, cb)
    diff = int((ours.view(torch.int16) != theirs.view(torch.int16)).sum())
    print(f"{'OK ' if diff == 0 else 'BAD'} {name}: K={k2 / 2} cb={F.CODEBOOKS[cb]} shape={list(trellis.shape)} "
          f"differing={diff}")
    return diff == 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pack", type=Path, help="a pack folder whose EXL3 tensors are compared too")
    ap.add_argument("--limit", type=int, default=64, help="at most this many pack tensors")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this check needs exllamav3's GPU kernels")
        return 2
    from exllamav3.ext import exllamav3_ext as ext  # JIT-builds the extension (needs CUDA_HOME)

    g = torch.Generator().manual_seed(0)
    ok = True
    for cb in (0, 1, 2):
        for k2 in [2, 4, 6, 8, 10, 12, 14, 16] + ([3, 5, 7] if cb == 2 else []):
            tr = torch.randint(-2**15, 2**15, (16, 32, 8 * k2), generator=g, dtype=torch.int16)
            ok &= compare(ext, "random", tr, cb)
        ok &= compare(ext, "arange words K=8", torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16)
                      .view(32, 16, 128), cb)
    if args.pack:
        from oracle.dsv41.checkpoint import _Folder
        folder = _Folder(args.pack, "pack")
        prefixes = sorted(n[:-len(".trellis")] for n in folder.infos if n.endswith(".trellis"))[:args.limit]
        for p in prefixes:
            cb = 1 if f"{p}.mcg" in folder.infos else 2 if f"{p}.mul1" in folder.infos else 0
            ok &= compare(ext, p, folder.read(folder.infos[f"{p}.trellis"]), cb)
    print("ALL IDENTICAL" if ok else "MISMATCHES FOUND")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
