"""Compressor (§12.2), indexer (§12.3) and candidate blocks (§12.4)."""

from __future__ import annotations

import torch

from .config import ModelConfig
from .numerics import Numerics, qdq4p
from .weights import need


class Compressor:
    """Pools `ratio` consecutive tokens into one latent (pre-RoPE, pre-QDQ), or None when no group completes."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        self.cfg, self.layer_id, self.ratio = cfg, layer_id, cfg.ratio(layer_id)

    def load(self, w: dict, p: str) -> "Compressor":
        self.wkv = need(w, p + "compressor.wkv.weight")
        self.norm = need(w, p + "compressor.norm.weight")
        self.wgate = need(w, p + "compressor.wgate.weight") if self.ratio > 1 else None
        return self

    def __call__(self, x: torch.Tensor, start_pos: int, cache, num: Numerics) -> torch.Tensor | None:
        r, eps = self.ratio, self.cfg.norm_eps
        if r == 1:  # nothing to pool: a plain bf16 linear
            return num.rmsnorm(num.linear(x, self.wkv), self.norm, eps)
        # ratio > 1 runs in fp32 with fp32 weights in the reference too (§12.2)
        kv, score = num.fp32_linear(x, self.wkv), num.fp32_linear(x, self.wgate)
        b, s, _ = x.shape
        if start_pos > 0 and s > 1:  # a chunk of a chunked prefill: the open group's tokens lead the chunk
            n_open = start_pos % r
            kv = torch.cat([cache.carry_kv[:, :n_open], kv], dim=1)
            score = torch.cat([cache.carry_score[:, :n_open], score], dim=1)
            s = kv.shape[1]
        if start_pos == 0 or s > 1:
            cut = s - s % r
            cache.carry_kv = kv.new_zeros(b, r, kv.shape[-1])
            cache.carry_score = kv.new_full((b, r, kv.shape[-1]), float("-inf"))
            cache.carry_kv[:, :s - cut] = kv[:, cut:]
            cache.carry_score[:, :s - cut] = score[:, cut:]
            if cut == 0:
                return None
            kv, score = kv[:, :cut].unflatten(1, (-1, r)), score[:, :cut].unflatten(1, (-1, r))
            pooled = num.f32(lambda v, z: (v * z.softmax(dim=2)).sum(dim=2), kv, score)  # softmax over the group, per channel
        else:
            slot = start_pos % r
            cache.carry_kv[:, slot] = kv[:, 0]
            cache.carry_score[:, slot] = score[:, 0]
            if (start_pos + 1) % r:
                return None
            pooled = num.f32(lambda v, z: (v * z.softmax(dim=1)).sum(dim=1, keepdim=True), cache.carry_kv,
                             cache.carry_score)
        return num.rmsnorm(num.r(pooled), self.norm, eps)  # bf16 cast precedes the norm in the reference


def select_candidate_blocks(scores: torch.Tensor, compress_lens, topk_blocks: int, block: int,
                            num: Numerics) -> torch.Tensor:
    """§12.4: bool mask over positions of the top blocks (block score = max), newest block forced in."""
    n = scores.shape[-1]
    padded = torch.nn.functional.pad(scores, (0, -n % block), value=float("-inf"))
    bs = padded.unflatten(-1, (-1, block)).amax(-1)
    nb = bs.shape[-1]
    last = (torch.as_tensor(compress_lens) - 1) // block
    bs = bs.masked_fill(torch.arange(nb) == last, float("inf"))
    vals, idx = num.topk(bs, min(topk_blocks, nb), "candidate_blocks")
    keep = torch.zeros_like(bs, dtype=torch.bool).scatter_(-1, idx, vals > float("-inf"))
    return keep.repeat_interleave(block, dim=-1)[..., :n]


class Indexer:
    """Scores compressed positions with fp4 query heads and keeps the best `index_topk` per query (§12.3)."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        self.cfg, self.layer_id, self.ratio = cfg, layer_id, cfg.ratio(layer_id)
        self.owns_k = cfg.owns_index_keys(layer_id)

    def load(self, w: dict, p: str) -> "Indexer":
        self.wq_b = need(w, p + "indexer.wq_b.weight")
        self.weights_proj = need(w, p + "indexer.weights_proj.weight")
        if self.owns_k:
            self.wk = need(w, p + "indexer.wk.weight")
            self.k_norm = need(w, p + "indexer.k_norm.weight")
        return self

    def publish_keys(self, latent: torch.Tensor, group_cis: torch.Tensor, start_pos: int, cache,
                     num: Numerics) -> None:
        """Key owner: k = QDQ4p(rope(k_norm(wk(latent)))) from the PRE-RoPE, pre-QDQ latent."""
        k = num.rmsnorm(num.linear(latent, self.wk), self.k_norm, self.cfg.norm_eps)
        k = qdq4p(num.r(num.rope(k, group_cis)), 32)
        cache.index_k = k if start_pos == 0 or cache.index_k is None else torch.cat([cache.index_k, k], dim=1)

    def __call__(self, x, qr, cis, index_k, start_pos: int, offset: int, shared, num: Numerics) -> torch.Tensor:
        cfg, r = self.cfg, self.ratio
        b, s, _ = x.shape
        end_pos = start_pos + s
        H, D = cfg.index_n_heads, cfg.index_head_dim
        q = num.qlinear(qr, self.wq_b).unflatten(-1, (H, D))
        q = qdq4p(num.r(num.rope(q, cis)), 32)
        G = end_pos // r
        if index_k.shape[1] < G:
            raise RuntimeError(f"indexer layer {self.layer_id}: key cache has {index_k.shape[1]} rows, needs {G}")
        K = index_k[:, :G]
        w = num.r(num.linear(x, self.weights_proj) * (D**-0.5 * H**-0.5))
        # bf16 tensors in the reference: q.K, relu x weight, and the sum over heads (§5.3)
        score = num.on_bf16(lambda a, c: torch.einsum("bshd,btd->bsht", a, c), q, K)
        score = num.r(score.relu() * w.unsqueeze(-1))
        score = num.on_bf16(lambda t: t.sum(dim=2), score)  # the reference's top-k runs on bf16 scores
        if start_pos == 0 or s > 1:  # a prefill or a chunk of one: query t sees the groups complete at t
            compress_lens = (torch.arange(start_pos + 1, end_pos + 1) // r).unsqueeze(-1)  # [s, 1]
            score = score.masked_fill(torch.arange(G) >= compress_lens, float("-inf"))
        else:
            compress_lens = torch.tensor(end_pos // r)
        if cfg.is_candidate_source(self.layer_id):
            shared.candidates = select_candidate_blocks(score, compress_lens, cfg.candidate_topk_blocks,
                                                        cfg.candidate_block_size, num)
        elif cfg.uses_candidates(self.layer_id):
            if shared.candidates is None or shared.candidates.shape != score.shape:
                raise RuntimeError(f"indexer layer {self.layer_id}: no candidate mask of shape "
                                   f"{tuple(score.shape)} was published")
            score = score.masked_fill(~shared.candidates, float("-inf"))
        k = min(cfg.index_topk, G)
        vals, sel = num.topk(score, k, f"indexer.{self.layer_id}", sorted=False)
        # §18.2 decision: a pick whose score is -inf is dropped, like an unreachable one
        order = sel.sort(dim=-1)
        sel, vals = order.values, vals.gather(-1, order.indices)
        ok = (sel < compress_lens) & (vals > float("-inf"))
        return torch.where(ok, sel + offset, -1)
