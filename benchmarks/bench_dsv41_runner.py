"""The layer-streamed DeepSeek-V4.1 panel runner: panel time against the I/O and compute bounds, and peak RSS
against the memory bound.

    .venv/bin/python benchmarks/bench_dsv41_runner.py            # tiny-large (8 layers, ~1 GB fp32), ~1 min
    .venv/bin/python benchmarks/bench_dsv41_runner.py --large    # 22 layers, ~27 GB fp32 (> this box's RAM),
                                                                 # ~3.6 GB on disk (MXFP4 experts); minutes

Reported (benchmarks/results/dsv41_runner[_large].json):
* `read_once_s`: reading every shard byte once, after posix_fadvise(DONTNEED) evicted our own files from the
  page cache (other people's cache is left alone); the runner run starts cold the same way.
* `compute_bound_s`: active matmul FLOPs of the panel / the measured torch matmul peak, for fp32 (the bound
  the issue names) and fp64 (what the oracle runs: it accumulates every dot product in float64).
* `panel_s / max(read_once_s, compute_bound_s)`: how far the panel run is from the larger bound.
* Peak RSS of the runner process (VmHWM, and the parent's getrusage of the child as a cross-check) against
  1.5 x (largest stage's fp32 weights + activations) above the pre-run baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_dsv41_forward import active_matmul_flops_per_token, matmul_peak  # noqa: E402

from oracle.dsv41.checkpoint import Checkpoint  # noqa: E402
from oracle.dsv41.tiny import write_tiny_checkpoint  # noqa: E402

TINY_LARGE = {"vocab_size": 4096, "dim": 1024, "moe_inter_dim": 512, "n_heads": 16, "head_dim": 128,
              "rope_head_dim": 32, "q_lora_rank": 256, "o_groups": 4, "o_lora_rank": 256, "n_routed_experts": 16,
              "index_n_heads": 8, "index_head_dim": 64, "engram_compressed_vocab_size": 2048,
              "engram_head_dim": 128, "window_size": 128, "max_seq_len": 4096, "dspark_noise_token_id": 4095}
# 22 layers of ~1.25 GB fp32 (48 MXFP4 experts of 1024 x 2048 each): ~27 GB fp32, more than this machine's RAM
LARGE = TINY_LARGE | {
    "dim": 2048, "moe_inter_dim": 1024, "n_routed_experts": 48, "n_layers": 22,
    "compress_ratios": [0, 0] + [2] * 10 + [1] * 10 + [0, 0, 0], "kv_source_layers": [2, 12],
    "index_source_layers": [2, 6, 12, 16], "candidate_source_layer": 12, "dspark_target_layer_ids": [19, 20, 21]}

RUN_SCRIPT = r"""
import json, sys
from oracle.dsv41.checkpoint import Checkpoint
from oracle.dsv41.runner import RunOptions, run_panel
from panels import encoded_from_json
rec = run_panel(Checkpoint(sys.argv[1]), encoded_from_json(sys.argv[2]), sys.argv[3],
                RunOptions(threads=int(sys.argv[4]), spill=sys.argv[5], progress=sys.stderr.isatty(), restart=True))
print(json.dumps(rec.provenance.extra["run"]))
"""


def write_large_checkpoint(out: Path, over: dict, seed: int = 0) -> Path:
    """Like tiny.write_tiny_checkpoint, but the MXFP4 expert bytes are slices of one 64 MiB random pool
    instead of a fresh torch.randint per expert (~10x less CPU on 6.6 G parameters; values repeat across
    experts, which a memory / I/O benchmark does not care about). Everything else is generated with tiny.py's
    own helpers and statistics, so the loader validates it like any generated checkpoint."""
    import dataclasses
    import math

    import numpy as np

    from oracle.dsv41 import tiny as T
    from oracle.dsv41.arch import expected_inventory

    cfg = T.tiny_config(over)
    inv = expected_inventory(cfg)
    out.mkdir(parents=True, exist_ok=False)
    shards = T._ShardWriter(out, 256 << 20)
    rng = np.random.default_rng(seed)
    pool = torch.from_numpy(rng.integers(0, 256, size=64 << 20, dtype=np.uint8))
    jitter = torch.from_numpy(rng.integers(-1, 2, size=1 << 20, dtype=np.int64))
    for i, (p, spec) in enumerate(sorted(inv.linears.items())):
        std = T._gain(p) * spec.in_ ** -0.5
        if spec.storage == "fp4":
            n = spec.out * spec.in_ // 2
            off = (i * 7919 * 4096) % (pool.numel() - n)
            shards.add(f"{p}.weight", pool[off:off + n].view(spec.out, spec.in_ // 2).view(torch.int8).clone())
            k = spec.out * spec.in_ // 32
            joff = (i * 104729) % (jitter.numel() - k)
            e = round(math.log2(std / T.FP4_RMS)) + jitter[joff:joff + k].view(spec.out, -1)
            shards.add(f"{p}.scale", (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu))
        elif spec.storage == "fp8":
            w, sc = T.quantize_fp8_blocks(torch.randn(spec.out, spec.in_, generator=T._gen(seed, p)) * std, T.FP8_BLOCK)
            shards.add(f"{p}.weight", w.view(torch.float8_e4m3fn))
            shards.add(f"{p}.scale", sc.view(torch.float8_e8m0fnu))
        else:
            shards.add(f"{p}.weight", (torch.randn(spec.out, spec.in_, generator=T._gen(seed, p)) * std).to(torch.bfloat16))
    for name, spec in sorted(inv.tensors.items()):
        g = T._gen(seed, name)
        if name == "embed.weight":
            t = torch.randn(spec.shape, generator=g) * T.EMBED_RMS
        elif len(spec.shape) == 2:
            t = torch.randn(spec.shape, generator=g) * spec.shape[1] ** -0.5
        elif name.endswith("norm.weight"):
            key = next((k for k in T._NORM_MEANS if name.endswith(f".{k}.weight")), None)
            t = T._NORM_MEANS.get(key, 1.0) * (1 + 0.1 * torch.randn(spec.shape, generator=g))
        else:
            t = 0.5 * torch.randn(spec.shape, generator=g)
        shards.add(name, t.to(torch.bfloat16 if spec.dtype == "BF16" else torch.float32))
    for p, spec in sorted(inv.tables.items()):
        w, sc = T.quantize_fp8_blocks(torch.randn(spec.rows, spec.width, generator=T._gen(seed, p)) * T.ENGRAM_RMS, (1, 32))
        shards.add(f"{p}.weight", w.view(torch.float8_e4m3fn))
        shards.add(f"{p}.scale", sc.view(torch.float8_e8m0fnu))
    shards.finish()
    config = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "extra"}
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": list(T.FP8_BLOCK), "scale_fmt": "ue8m0",
                                     "expert_dtype": cfg.expert_dtype}
    config["ds41_tiny"] = {"seed": seed, "overrides": over, "expert_bytes": "64 MiB pool (bench_dsv41_runner)"}
    T._atomic_json(config, out / "config.json")
    return out


def shard_files(ck_dir: Path) -> list[Path]:
    return sorted(ck_dir.glob("*.safetensors"))


def evict(files: list[Path]) -> None:
    """Drop our own files from the page cache so reads start cold (no system-wide cache drop)."""
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_once(files: list[Path]) -> tuple[float, int]:
    evict(files)
    n, t = 0, time.perf_counter()
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while chunk := f.read(16 << 20):
                n += len(chunk)
    return time.perf_counter() - t, n


def fp32_bytes(ck: Checkpoint) -> int:
    inv = ck.inventory
    lin = sum(4 * s.out * s.in_ for s in inv.linears.values())
    ten = sum(4 * torch.Size(s.shape).numel() for s in inv.tensors.values())
    tab = sum(4 * t.rows * t.width for t in inv.tables.values())
    return lin + ten + tab


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--large", action="store_true", help="the > RAM checkpoint (generated once under --dir)")
    ap.add_argument("--dir", default="/tmp/ds41-bench-runner", help="where checkpoints and work dirs go")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--spill", default="disk")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    name = "large" if a.large else "tiny-large"
    over = LARGE if a.large else TINY_LARGE
    base = Path(a.dir)
    ck_dir = base / name
    t = time.perf_counter()
    if not (ck_dir / "config.json").exists():
        if a.large:
            write_large_checkpoint(ck_dir, over)
        else:
            write_tiny_checkpoint(ck_dir, seed=0, config_overrides=over, shard_bytes=256 << 20)
    gen_s = time.perf_counter() - t
    ck = Checkpoint(ck_dir)
    cfg = ck.model_config
    files = shard_files(ck_dir)
    g = torch.Generator().manual_seed(0)
    panel = base / f"{name}-panel.json"
    panel.write_text(json.dumps([torch.randint(0, cfg.vocab_size, (a.tokens,), generator=g).tolist()
                                 for _ in range(a.seqs)]))
    read_s, disk_bytes = read_once(files)
    torch.set_num_threads(a.threads)
    peak32, peak64 = matmul_peak(torch.float32, 2048), matmul_peak(torch.float64, 2048)
    tokens = a.seqs * a.tokens
    flops = active_matmul_flops_per_token(cfg) * tokens
    evict(files)
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", RUN_SCRIPT, str(ck_dir), str(panel), str(base / f"{name}-work"),
                        str(a.threads), a.spill], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t
    if r.returncode:
        sys.exit(f"runner failed ({r.returncode})")
    run = json.loads(r.stdout.strip().splitlines()[-1])
    child_maxrss_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    growth = (run["peak_rss_kib"] - run["baseline_rss_kib"]) * 1024
    bound = 1.5 * (run["largest_stage_weight_bytes"] + run["activation_bytes"])
    compute32, compute64 = flops / peak32, flops / peak64
    res = {
        "config": name, "overrides": over, "threads": a.threads, "sequences": a.seqs, "tokens": tokens,
        "spill": a.spill, "generate_s": round(gen_s, 1), "checkpoint_disk_bytes": disk_bytes,
        "checkpoint_fp32_bytes": fp32_bytes(ck), "machine_ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "read_once_s": read_s, "read_once_MB_per_s": disk_bytes / read_s / 1e6,
        "matmul_peak_fp32_gflops": peak32 / 1e9, "matmul_peak_fp64_gflops": peak64 / 1e9,
        "active_matmul_gflop": flops / 1e9, "compute_bound_fp32_s": compute32, "compute_bound_fp64_s": compute64,
        "panel_s": run["total_s"], "process_wall_s": wall,
        "ratio_to_bound_fp32": run["total_s"] / max(read_s, compute32),
        "ratio_to_bound_fp64": run["total_s"] / max(read_s, compute64),
        "runner": run, "rss_growth_bytes": growth, "rss_bound_bytes": bound, "rss_within_bound": growth <= bound,
        "peak_rss_bytes": run["peak_rss_kib"] * 1024, "child_maxrss_bytes": child_maxrss_kib * 1024,
        "torch": torch.__version__, "machine": platform.machine(), "load_average_at_end": os.getloadavg(),
    }
    out = Path(a.out or ROOT / f"benchmarks/results/dsv41_runner{'_large' if a.large else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=float))
    print(json.dumps({k: v for k, v in res.items() if k not in ("overrides", "runner")}, indent=1, default=float))


if __name__ == "__main__":
    main()
