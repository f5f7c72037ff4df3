"""Decode throughput of the exact weight decoders vs reading the same bytes (weight-formats.md §5, §7).

Cases: one 4096x4096 EXL3 K=3 tensor (3INST and mul1 codebooks), one release-size MXFP4 routed expert
(w1, w3 [2304, 5120], w2 [5120, 2304]) and one release-size FP8 32x32 tensor (wo_a [8192, 4096]). Each case is
written to a safetensors file; "read" is ``safe_open().get_tensor(...).clone()`` of all its tensors from the page cache,
"decode" the fp32 dequantisation of the tensors already in memory. Writes benchmarks/results/formats.json.

    .venv/bin/python benchmarks/bench_formats.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from oracle.dsv41 import formats as F  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "formats.json"


def timed(fn, repeats: int) -> float:
    fn()  # warm-up (page cache, lookup tables)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def exl3_case(cb: int):
    g = torch.Generator().manual_seed(0)
    t = {"w.trellis": torch.randint(-2**15, 2**15, (256, 256, 48), generator=g, dtype=torch.int16),
         "w.suh": torch.randn(4096, generator=g).half(), "w.svh": (0.01 * torch.randn(4096, generator=g)).half()}
    if cb == 2:
        t["w.mul1"] = torch.tensor(F.MUL1_MARKER, dtype=torch.int32)
    return t, lambda r: F.exl3_dequant(r["w.trellis"], r["w.suh"], r["w.svh"], cb), 4096 * 4096


def mxfp4_case():
    g = torch.Generator().manual_seed(1)
    t = {}
    for n, (o, i) in (("w1", (2304, 5120)), ("w3", (2304, 5120)), ("w2", (5120, 2304))):
        t[f"{n}.weight"] = torch.randint(-128, 128, (o, i // 2), generator=g, dtype=torch.int8)
        t[f"{n}.scale"] = torch.randint(110, 130, (o, i // 32), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    dec = lambda r: [F.mxfp4_dequant(r[f"{n}.weight"], r[f"{n}.scale"]) for n in ("w1", "w3", "w2")]  # noqa: E731
    return t, dec, 3 * 2304 * 5120


def fp8_case():
    g = torch.Generator().manual_seed(2)
    w = torch.randint(0, 0x7E, (8192, 4096), generator=g, dtype=torch.uint8)
    s = torch.randint(110, 130, (256, 128), generator=g, dtype=torch.uint8)
    t = {"w.weight": w.view(torch.float8_e4m3fn), "w.scale": s.view(torch.float8_e8m0fnu)}
    return t, lambda r: F.fp8_dequant(r["w.weight"], r["w.scale"], (32, 32)), 8192 * 4096


def run(repeats: int) -> dict:
    cases = {"exl3_4096x4096_K3_3inst": exl3_case(0), "exl3_4096x4096_K3_mul1": exl3_case(2),
             "mxfp4_expert_release_w1w2w3": mxfp4_case(), "fp8_32x32_8192x4096": fp8_case()}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (tensors, decode, n_elem) in cases.items():
            path = Path(tmp) / f"{name}.safetensors"
            save_file(tensors, str(path))
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())

            def read():
                with safe_open(str(path), "pt") as f:
                    return {k: f.get_tensor(k).clone() for k in f.keys()}  # touch every byte
            loaded = read()
            t_read = timed(read, repeats)
            t_dec = timed(lambda: decode(loaded), repeats)
            results[name] = {
                "elements": n_elem, "stored_bytes": nbytes, "read_s": round(t_read, 5), "decode_s": round(t_dec, 5),
                "decode_over_read": round(t_dec / t_read, 2),
                "decode_Melem_per_s": round(n_elem / t_dec / 1e6, 2),
                "decode_stored_MB_per_s": round(nbytes / t_dec / 1e6, 2),
                "read_MB_per_s": round(nbytes / t_read / 1e6, 1),
            }
            print(name, results[name], flush=True)
    return {
        "benchmark": "bench_formats", "repeats": repeats, "statistic": "median seconds after one warm-up",
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "machine": platform.machine(), "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "note": "read = safetensors get_tensor + clone (every byte touched) from the page cache; decode = exact fp32 dequantisation in memory",
        "cases": results,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    res = run(args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=args.out.parent, prefix=args.out.name, suffix=".partial")
    with os.fdopen(fd, "w") as f:
        json.dump(res, f, indent=1)
        f.write("\n")
    os.replace(tmp, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
