"""DeepSeek-V4 attention (dsv4-engine.md §5): MQA over a 128-token window plus the layer's own compressed KV.

Differences from V4.1's `attention.Attention` (each a row of dsv4-engine.md §5):

* q: q_norm on q_lora, then wq_b, then a **per-head weight-free RMSNorm** (eps = norm_eps), then RoPE.
* window KV: kv_norm(wkv(x)), RoPE, then QDQ8 on the **nope dims only** (block 64); the RoPE dims stay bf16.
* ratio 4 (CSA): the layer's Lightning indexer picks top-`index_topk` of its compressed entries; ratio 128
  (HCA): every visible compressed entry is attended. Compressed KV: the layer's own compressor
  (compressor_v4.py; nope dims QDQ8 block 64).
* GEMM inputs are QDQ8'd per 128 channels (the V4 fp8 block), not per 32.
* no cross-layer sharing, so no index-key switch (§18.1 has no V4 counterpart).

As in V4.1 the window keeps the full history (equivalent to the reference's 128-slot ring); the index lists
handed to `sparse_attn` name the same rows in the reference's order: the ring is listed oldest first, and a
decode step before the ring is full lists the filled slots, then −1.
"""

from __future__ import annotations

import torch

from dataclasses import dataclass

from .attention import (AttentionWeights, LayerCache, append_window, grouped_wo_a, sparse_attn, window_indices,
                        window_rows)
from .compressor_v4 import CompressorV4, IndexerV4, qdq8_nope
from .config import ModelConfig
from .numerics import Numerics, rstd_f64
from .rope import layer_frequencies

V4_ACT_BLOCK = 128  # the fp8 GEMM input block of V4 (dsv4-engine.md §5 "quantisation")


@dataclass
class LayerCacheV4(LayerCache):
    """A V4 layer's cache: V4.1's fields plus its compressors' decode state ({"kv", "score"}
    [b, coff*r, coff*d] fp32, compressor_v4.py), which only the owning layer reads, and only in decode."""

    compress_state: dict | None = None
    index_state: dict | None = None


def compressed_indices_v4(ratio: int, start_pos: int, s: int, offset: int) -> torch.Tensor:
    """[s, n] all compressed entries a ratio-128 query sees (entry j is visible to query t once its group
    is complete: j < (t+1) // ratio), as `offset + j`, else -1; a decode step lists the complete ones, a chunk
    of a chunked prefill (start_pos > 0, s > 1) its queries as the one-pass prefill does."""
    if start_pos == 0 or s > 1:
        end_pos = start_pos + s
        j = torch.arange(end_pos // ratio).repeat(s, 1)
        return torch.where(j >= (torch.arange(start_pos + 1, end_pos + 1) // ratio).unsqueeze(1), -1, j + offset)
    return (torch.arange((start_pos + 1) // ratio) + offset).unsqueeze(0)


def head_rmsnorm(q: torch.Tensor, eps: float, num: Numerics) -> torch.Tensor:
    """Weight-free RMSNorm of every query head (V4 only). The reference runs it on the bf16 q in bf16
    arithmetic (`q *= rsqrt(mean(q²) + eps)`)."""
    if num.bf16:
        qb = q.to(torch.bfloat16)
        return (qb * torch.rsqrt(qb.square().mean(-1, keepdim=True) + eps)).float()
    return q * rstd_f64(q, eps, keepdim=True)


class AttentionV4(AttentionWeights):
    compressor_prefix = "compressor."

    def __init__(self, cfg: ModelConfig, layer_id: int):
        self.cfg, self.layer_id = cfg, layer_id
        self.ratio = cfg.ratio(layer_id)
        self.freqs = layer_frequencies(cfg, layer_id)  # ratio > 0: compress θ + YaRN; ratio 0: θ, no YaRN
        self.compressor = CompressorV4(cfg, layer_id, cfg.head_dim, self.freqs) if self.ratio else None
        self.indexer = IndexerV4(cfg, layer_id, self.freqs) if self.ratio == 4 else None

    def _lin(self, x, w, num):
        return num.qlinear(x, w, V4_ACT_BLOCK, fmt=self.cfg.scale_fmt)

    def _output(self, o, cis, num):
        """grouped_wo_a, then wo_b with V4's fp8 input blocks."""
        return self._lin(grouped_wo_a(o, cis, self.wo_a, self.cfg, num), self.wo_b, num)

    def __call__(self, x: torch.Tensor, start_pos: int, cache: LayerCacheV4, num: Numerics) -> torch.Tensor:
        cfg = self.cfg
        b, s, _ = x.shape
        end_pos = start_pos + s
        cis = num.rope_cis(self.freqs, torch.arange(start_pos, end_pos), cfg.max_seq_len)
        qr = num.rmsnorm(self._lin(x, self.wq_a, num), self.q_norm, cfg.norm_eps)
        q = self._lin(qr, self.wq_b, num).unflatten(-1, (cfg.n_heads, cfg.head_dim))
        q = num.r(num.rope(head_rmsnorm(q, cfg.norm_eps, num), cis))
        kv = num.rmsnorm(self._lin(x, self.wkv, num), self.kv_norm, cfg.norm_eps)
        kv = qdq8_nope(num.r(num.rope(kv, cis)), cfg.rope_head_dim, 64, cfg.scale_fmt)
        append_window(cache, kv, start_pos, self.layer_id)
        kv_all = cache.window_kv
        # the V4 reference lists a decode step's empty ring slots after the filled ones
        idx = window_rows(window_indices(start_pos, s, cfg.window_size, empty_slots_first=False),
                          cache.window_start).expand(b, -1, -1)
        if self.ratio:
            offset = kv_all.shape[1]  # compressed rows follow the window's rows in kv_all
            if self.indexer is not None:
                cidx = self.indexer(x, qr, cis, start_pos, offset, cache, num)
            else:
                cidx = compressed_indices_v4(self.ratio, start_pos, s, offset).expand(b, -1, -1)
            if start_pos == 0:
                cache.compress_state = {}
                cache.compress_kv = None
            new = self.compressor(x, start_pos, cache.compress_state, num)
            if new is not None:
                cache.compress_kv = new if cache.compress_kv is None else torch.cat([cache.compress_kv, new], 1)
            n_c = end_pos // self.ratio
            ckv = cache.compress_kv if cache.compress_kv is not None else x.new_zeros(b, 0, cfg.head_dim)
            if ckv.shape[1] != n_c:
                raise RuntimeError(f"layer {self.layer_id}: {ckv.shape[1]} compressed rows, expected {n_c}")
            kv_all = torch.cat([kv_all, ckv], dim=1)
            idx = torch.cat([idx, cidx], dim=-1)
        o = sparse_attn(q, kv_all, self.attn_sink, idx, cfg.head_dim**-0.5, num)
        return self._output(o, cis, num)
