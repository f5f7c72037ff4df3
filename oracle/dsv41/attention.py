"""Attention (§11): window KV, compressed KV path (§12.1), sparse attention with sink (§6.3), grouped output."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .compressor import Compressor, Indexer
from .config import ModelConfig
from .numerics import Numerics, qdq4e, qdq8
from .rope import layer_frequencies
from .weights import need


# ----------------------------------------------------------------------------------------------
# State (§17.2)
# ----------------------------------------------------------------------------------------------


@dataclass
class LayerCache:
    """One layer's per-sequence state, batch-major. The window keeps the full history (equivalent to
    the reference's 128-slot ring, §17.2); the index order fed to sparse_attn reproduces the ring's."""

    window_kv: torch.Tensor | None = None  # [b, T - window_start, head_dim] post-RoPE, post-QDQ8
    window_start: int = 0  # the absolute position of window_kv's row 0 (> 0 once a long prefill trimmed it)
    compress_kv: torch.Tensor | None = None  # [b, G, head_dim] post-RoPE, post-QDQ4e (KV sources)
    index_k: torch.Tensor | None = None  # [b, G, index_head_dim] post-RoPE, post-QDQ4p (key owners)
    carry_kv: torch.Tensor | None = None  # [b, r, head_dim] fp32 pending group (ratio-2 sources)
    carry_score: torch.Tensor | None = None
    ring: torch.Tensor | None = None  # DSpark stages: [b, window, head_dim] ring of main_kv

    def trim_window(self, keep: int) -> None:
        """Drop window rows older than the last `keep` (a chunked prefill keeps window - 1: all the next query
        can see), so the window's memory is bounded by the window, not by the context."""
        if self.window_kv is not None and self.window_kv.shape[1] > keep:
            drop = self.window_kv.shape[1] - keep
            self.window_kv = self.window_kv[:, drop:].clone()
            self.window_start += drop


@dataclass
class SharedRuntime:
    """What attention layers hand down the stack (§3.1, §17.2). `index_k_owner` persists across calls:
    it is the stale pointer of §18.1."""

    caches: dict = field(default_factory=dict)  # layer_id -> LayerCache (shared with the model state)
    compress_kv_owner: int | None = None
    index_k_owner: int | None = None
    topk_idxs: torch.Tensor | None = None
    candidates: torch.Tensor | None = None


# ----------------------------------------------------------------------------------------------
# Sparse attention with sink (§6.3)
# ----------------------------------------------------------------------------------------------


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float,
                num: Numerics, block: int = 64) -> torch.Tensor:
    """q [b, m, h, d], kv [b, n, d] (K = V), sink [h], idx [b, m, k] with -1 = no key -> [b, m, h, d].

    fp32 mode: the exact softmax with the unscaled sink as an extra logit that has no value row.
    reference-bf16 mode: the kernel's online softmax over blocks of 64 indices, running max from
    -1e30, probabilities cast to bf16 before P.V, output cast to bf16."""
    if num.bf16:
        return _sparse_attn_reference_order(q, kv, sink, idx, scale, block)
    b, m, h, d = q.shape
    valid = idx >= 0
    g = torch.gather(kv.unsqueeze(1).expand(b, m, kv.shape[1], d), 2,
                     idx.clamp_min(0).long().unsqueeze(-1).expand(b, m, idx.shape[-1], d))  # [b, m, k, d]
    sink = sink.view(1, 1, h)
    # exact softmax evaluated in float64 and rounded once, so the result does not depend on how
    # many -1 holes a list has (prefill and decode lists differ only in those)
    z64 = torch.einsum("bmhd,bmkd->bmhk", q.double(), g.double()) * scale
    z64 = z64.masked_fill(~valid.unsqueeze(2), float("-inf"))
    s64 = sink.double()
    mu = torch.maximum(z64.amax(-1), s64) if z64.shape[-1] else s64.expand(b, m, h)
    p = torch.exp(z64 - mu.unsqueeze(-1))
    den = p.sum(-1) + torch.exp(s64 - mu)
    return (torch.einsum("bmhk,bmkd->bmhd", p, g.double()) / den.unsqueeze(-1)).float()


def _sparse_attn_reference_order(q, kv, sink, idx, scale: float, block: int):
    """The reference kernel's online softmax, spelled as its CPU port spells it (same fp32 ops, same block
    shapes): gathered rows zeroed at -1, scores masked to -inf then scaled, running max from -1e30, fp32
    exp and probability sums, probabilities cast to bf16 before P.V, the unscaled sink added last."""
    b, m, h, d = q.shape
    scale_t = torch.tensor(scale, dtype=torch.float32)
    acc = torch.zeros(b, m, h, d)
    den = torch.zeros(b, m, h)
    run = torch.full((b, m, h), -1e30)
    batch = torch.arange(b).view(b, 1, 1)
    for s0 in range(0, idx.shape[-1], block):
        ib = idx[:, :, s0:s0 + block].long()
        valid = ib != -1
        gb = kv[batch, ib.clamp_min(0)] * valid.unsqueeze(-1)
        z = torch.where(valid.unsqueeze(2), torch.einsum("bmhd,bmkd->bmhk", q, gb), -torch.inf) * scale_t
        prev, run = run, torch.maximum(run, z.amax(dim=-1))
        alpha = torch.exp(prev - run)
        p = torch.exp(z - run.unsqueeze(-1))
        den = den * alpha + p.sum(dim=-1)
        acc = acc * alpha.unsqueeze(-1) + torch.einsum("bmhk,bmkd->bmhd", p.to(torch.bfloat16).float(), gb)
    den = den + torch.exp(sink.float() - run)
    return (acc / den.unsqueeze(-1)).to(torch.bfloat16).float()


def window_indices(start_pos: int, s: int, window: int, empty_slots_first: bool = True) -> torch.Tensor:
    """Window positions per query [s, n] in the reference's order (§11.1): prefill lists
    max(0, t-W+1) + arange(min(s, W)) with future slots -1; decode lists the last min(p+1, W) positions
    ascending, with -1 for the ring's empty slots before them (V4.1's ring order) or, with
    `empty_slots_first=False`, after them (DeepSeek-V4's). A chunk of a chunked prefill (start_pos > 0,
    s > 1) lists its queries as the one-pass prefill of a sequence of >= W tokens lists them."""
    if start_pos == 0 or s > 1:
        end = torch.arange(start_pos, start_pos + s).unsqueeze(1)
        idx = (end - window + 1).clamp(min=0) + torch.arange(min(start_pos + s, window))
        return torch.where(idx > end, -1, idx)
    if s != 1:
        raise ValueError(f"decode step at start_pos={start_pos} must have 1 token, got {s} (§17.1)")
    p = start_pos
    n_valid = min(p + 1, window)
    empty, filled = torch.full((window - n_valid,), -1), torch.arange(p + 1 - n_valid, p + 1)
    return torch.cat([empty, filled] if empty_slots_first else [filled, empty]).unsqueeze(0)


def append_window(cache: LayerCache, kv: torch.Tensor, start_pos: int, layer_id: int) -> None:
    """Write a call's window KV rows into the cache: a prefill (start_pos 0) starts it, a decode step or a
    prefill chunk continues it."""
    if start_pos == 0:
        cache.window_kv, cache.window_start = kv, 0
        return
    if cache.window_kv is None or cache.window_start + cache.window_kv.shape[1] != start_pos:
        raise RuntimeError(f"layer {layer_id}: decode at {start_pos} without a prefill of {start_pos} tokens (§17.1)")
    cache.window_kv = torch.cat([cache.window_kv, kv], dim=1)


def window_rows(idx: torch.Tensor, window_start: int) -> torch.Tensor:
    """Absolute window positions (-1 = no key) -> rows of a window cache that starts at `window_start`."""
    return idx if window_start == 0 else torch.where(idx >= 0, idx - window_start, -1)


def grouped_wo_a(o: torch.Tensor, cis, wo_a: torch.Tensor, cfg: ModelConfig, num: Numerics) -> torch.Tensor:
    """Attention output -> wo_b's input: inverse RoPE, then the block-diagonal grouped wo_a (bf16 weight, no
    act QDQ) (§11.3). The same in both architectures; only wo_b's input quantisation differs."""
    o = num.r(num.rope(o, cis, inverse=True))
    b, s = o.shape[:2]
    og = o.reshape(b, s, cfg.o_groups, -1)
    wa = wo_a.view(cfg.o_groups, cfg.o_lora_rank, -1)
    # the reference runs this grouped product on bf16 tensors (wo_a is stored bf16)
    z = num.on_bf16(lambda u, v: torch.einsum("bsgd,grd->bsgr", u, v), og, wa)
    return z.flatten(2)


# ----------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------


class AttentionWeights:
    """The one load of both architectures' attention (this module's Attention, attention_v4.AttentionV4): the
    projections, the q / kv norms and the sink under the layer's ``attn.``, then its compressor and indexer
    when the layer has them."""

    compressor_prefix = ""   # V4.1's Compressor adds its own "compressor."; V4's is handed its full prefix

    def load(self, w: dict, prefix: str):
        p = prefix + "attn."
        for n in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b"):
            setattr(self, n, need(w, p + n + ".weight"))
        self.q_norm = need(w, p + "q_norm.weight")
        self.kv_norm = need(w, p + "kv_norm.weight")
        self.attn_sink = need(w, p + "attn_sink")
        if self.compressor:
            self.compressor.load(w, p + self.compressor_prefix)
        if self.indexer:
            self.indexer.load(w, p)
        return self


class Attention(AttentionWeights):
    def __init__(self, cfg: ModelConfig, layer_id: int, index_k: str = "upstream"):
        if index_k not in ("intended", "upstream"):
            raise ValueError(f"index_k switch {index_k!r}: expected 'intended' or 'upstream' (§18.1)")
        self.cfg, self.layer_id, self.index_k_mode = cfg, layer_id, index_k
        self.ratio = cfg.ratio(layer_id)
        self.freqs = layer_frequencies(cfg, layer_id)
        self.compressor = Compressor(cfg, layer_id) if cfg.is_kv_source(layer_id) else None
        self.indexer = Indexer(cfg, layer_id) if cfg.is_index_source(layer_id) else None

    # -- shared pieces -------------------------------------------------------------------------
    def _kv(self, x, cis, num):
        """Window KV: QDQ8(rope(kv_norm(wkv(x)))) over the whole vector, RoPE tail included (§11.1)."""
        kv = num.rmsnorm(num.qlinear(x, self.wkv), self.kv_norm, self.cfg.norm_eps)
        return qdq8(num.r(num.rope(kv, cis)), 32)

    def _query(self, x, cis, num):
        qr = num.rmsnorm(num.qlinear(x, self.wq_a), self.q_norm, self.cfg.norm_eps)
        q = num.qlinear(qr, self.wq_b).unflatten(-1, (self.cfg.n_heads, self.cfg.head_dim))
        return qr, num.r(num.rope(q, cis))

    def _output(self, o, cis, num):
        """grouped_wo_a, then wo_b (§11.3)."""
        return num.qlinear(grouped_wo_a(o, cis, self.wo_a, self.cfg, num), self.wo_b)

    # -- forward -------------------------------------------------------------------------------
    def __call__(self, x: torch.Tensor, start_pos: int, cache: LayerCache, shared: SharedRuntime,
                 num: Numerics) -> torch.Tensor:
        cfg = self.cfg
        b, s, _ = x.shape
        end_pos = start_pos + s
        pos = torch.arange(start_pos, end_pos)
        cis = num.rope_cis(self.freqs, pos, cfg.max_seq_len)
        qr, q = self._query(x, cis, num)
        kv = self._kv(x, cis, num)
        append_window(cache, kv, start_pos, self.layer_id)
        kv_all = cache.window_kv
        idx = window_rows(window_indices(start_pos, s, cfg.window_size), cache.window_start).expand(b, -1, -1)
        if self.ratio:
            ckv, cidx = self._compress(x, qr, start_pos, cache, shared, num, offset=kv_all.shape[1])
            kv_all = torch.cat([kv_all, ckv], dim=1)
            idx = torch.cat([idx, cidx], dim=-1)
        o = sparse_attn(q, kv_all, self.attn_sink, idx, cfg.head_dim**-0.5, num)
        return self._output(o, cis, num)

    def _compress(self, x, qr, start_pos, cache, shared, num, offset):
        """§12.1. `offset` is where compressed rows start in kv_all (the window's row count)."""
        cfg, r, L = self.cfg, self.ratio, self.layer_id
        b, s, _ = x.shape
        end_pos = start_pos + s
        compress_len = end_pos // r
        latent = None
        if self.compressor is not None:
            latent = self.compressor(x, start_pos, cache, num)
            shared.compress_kv_owner = L
        # group j stands at position j*r (its first token)
        if latent is not None:  # the groups this call completed, the first one open before it
            gpos = torch.arange(latent.shape[1]) * r + (start_pos // r) * r
            gcis = num.rope_cis(self.freqs, gpos, cfg.max_seq_len)
        # the indexer consumes the pre-RoPE, pre-QDQ latent, so it runs before the cache write
        if self.indexer is None:
            if shared.topk_idxs is None:
                raise RuntimeError(f"layer {L}: no top-k indices were published before it")
            cidx = shared.topk_idxs
        elif compress_len == 0:
            cidx = torch.empty(b, s, 0, dtype=torch.int64)
            shared.topk_idxs = cidx
        else:
            if self.indexer.owns_k and latent is not None:
                self.indexer.publish_keys(latent, gcis, start_pos, cache, num)
                shared.index_k_owner = L
            index_k = self._index_keys(shared, L)
            qcis = num.rope_cis(self.freqs, torch.arange(start_pos, end_pos), cfg.max_seq_len)
            cidx = self.indexer(x, qr, qcis, index_k,
                                start_pos, offset, shared, num)
            shared.topk_idxs = cidx
        if latent is not None:
            latent = qdq4e(num.r(num.rope(latent, gcis)), 16)
            cache.compress_kv = latent if cache.compress_kv is None or start_pos == 0 else \
                torch.cat([cache.compress_kv, latent], dim=1)
        src = cfg.kv_source_for(L)
        if src is None:
            raise RuntimeError(f"layer {L}: no KV source layer of ratio {r} at or before it (§3.1)")
        # a source that has not compressed a group yet (a sequence shorter than the ratio, a 1-token one) may
        # have no cache entry at all: the streamed runner stores only caches that hold a tensor
        owner = shared.caches.get(src)
        ckv = owner.compress_kv if owner is not None and owner.compress_kv is not None \
            else x.new_zeros(b, 0, cfg.head_dim)
        if ckv.shape[1] < compress_len:
            raise RuntimeError(f"layer {L}: compressed cache has {ckv.shape[1]} rows, needs {compress_len}")
        return ckv[:, :compress_len], cidx

    def _index_keys(self, shared: SharedRuntime, L: int) -> torch.Tensor:
        """§18.1: 'intended' reads the latest key owner of this layer's ratio; 'upstream' follows the
        pointer last re-published by any key owner, possibly in the previous call (stale)."""
        owner = self.cfg.key_owner_for(L) if self.index_k_mode == "intended" else shared.index_k_owner
        if owner is None or shared.caches[owner].index_k is None:
            raise RuntimeError(f"layer {L}: no index keys published yet (index_k={self.index_k_mode})")
        return shared.caches[owner].index_k
