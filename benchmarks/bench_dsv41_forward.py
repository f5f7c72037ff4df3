"""DeepSeek-V4.1 oracle forward throughput on a 'tiny-large' random-weight configuration, as a ratio to
this machine's measured torch matmul peak (fp32 and fp64: the oracle accumulates dots in fp64).

    .venv/bin/python benchmarks/bench_dsv41_forward.py [--threads 1] [--prefill 256] [--decode 8]

Writes benchmarks/results/dsv41_forward.json."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.oracle.dsv41_random_weights import random_weights  # noqa: E402

from oracle.dsv41.config import ModelConfig  # noqa: E402
from oracle.dsv41.engram import tiny_token_map  # noqa: E402
from oracle.dsv41.model import Model  # noqa: E402


def tiny_large() -> ModelConfig:
    """The §20 schedule (all roles, Engram, DSpark) at larger widths."""
    return ModelConfig.tiny(vocab_size=4096, dim=1024, moe_inter_dim=512, n_heads=16, head_dim=128,
                            rope_head_dim=32, q_lora_rank=256, o_groups=4, o_lora_rank=256,
                            n_routed_experts=16, n_activated_experts=3, index_n_heads=8, index_head_dim=64,
                            engram_compressed_vocab_size=2048, engram_head_dim=128, window_size=128,
                            max_seq_len=4096, dspark_noise_token_id=4095)


def matmul_peak(dtype, n=1024, reps=5) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def active_matmul_flops_per_token(cfg: ModelConfig) -> float:
    """2 x (weights touched per token) over the backbone + head; attention score/value work excluded."""
    d = cfg.dim
    attn = d * cfg.q_lora_rank + cfg.q_lora_rank * cfg.n_heads * cfg.head_dim + d * cfg.head_dim \
        + cfg.n_heads * cfg.head_dim // cfg.o_groups * cfg.o_groups * cfg.o_lora_rank + cfg.o_groups * cfg.o_lora_rank * d
    moe = (cfg.n_activated_experts + 1) * 3 * d * cfg.moe_inter_dim + cfg.n_routed_experts * d
    hc = 2 * cfg.mix_hc * cfg.hc_dim
    per_layer = attn + moe + hc
    return 2.0 * (cfg.n_layers * per_layer + cfg.vocab_size * d)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--decode", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/dsv41_forward.json"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cfg = tiny_large()
    w = random_weights(cfg, seed=0)
    peak32, peak64 = matmul_peak(torch.float32), matmul_peak(torch.float64)
    res = {"config": "tiny-large", "threads": a.threads, "prefill_tokens": a.prefill, "decode_steps": a.decode,
           "matmul_peak_fp32_gflops": peak32 / 1e9, "matmul_peak_fp64_gflops": peak64 / 1e9,
           "flops_per_token_est": active_matmul_flops_per_token(cfg), "torch": torch.__version__,
           "machine": platform.processor() or platform.machine(), "modes": {}}
    ids = torch.randint(0, cfg.vocab_size, (1, a.prefill + a.decode), generator=torch.Generator().manual_seed(0))
    for mode in ("fp32", "reference-bf16"):
        m = Model(cfg, w, tiny_token_map(cfg.vocab_size), precision=mode)
        st = m.new_state(1)
        t = time.perf_counter()
        m.forward(ids[:, :a.prefill], st)
        tp = time.perf_counter() - t
        t = time.perf_counter()
        for p in range(a.prefill, a.prefill + a.decode):
            m.forward(ids[:, p:p + 1], st)
        td = time.perf_counter() - t
        pre_tps, dec_tps = a.prefill / tp, a.decode / td
        f = res["flops_per_token_est"]
        res["modes"][mode] = {
            "prefill_s": tp, "prefill_tokens_per_s": pre_tps, "decode_tokens_per_s": dec_tps,
            "prefill_ratio_to_fp32_peak": pre_tps * f / peak32, "decode_ratio_to_fp32_peak": dec_tps * f / peak32,
            "prefill_ratio_to_fp64_peak": pre_tps * f / peak64, "topk_boundary_ties": st.num.ties.total}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
