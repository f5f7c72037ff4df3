"""DeepSeek-V4 compressor and Lightning indexer (dsv4-engine.md §5, "compressor" and "indexer" rows).

Every compressed V4 layer owns its compressor; nothing is shared across layers (V4.1 §3.1 does not apply).

* ratio 4 (CSA): overlapping windows. `wkv`/`wgate` give 2·d channels per token (coff = 2); compressed entry j
  is a per-channel softmax over 2r slots: the r tokens of group j−1 on the first half of the channels (Ca)
  and the r tokens of group j on the second half (Cb). Group 0 has no predecessor: its Ca slots are kv 0 and
  score −inf.
* ratio 128 (HCA): plain per-channel softmax pooling over the group's r tokens.
* both: a learned position bias `ape` [r, coff·d] is added to the scores (slot = position mod r); the pooled
  vector is rounded to bf16 (reference), RMS-normalised, RoPE'd at the group's first position, then
  quantised: the attention compressor QDQ8s its nope dims (block 64, rope dims stay bf16); the indexer's own
  compressor (d = index_head_dim, `rotate`) applies the Hadamard rotation and QDQ4 (block 32).

Decode state per compressor: `kv_state` / `score_state` [b, coff·r, coff·d] fp32. Without overlap slot
`p mod r` holds token p of the open group. With overlap slots 0..r−1 hold the previous complete group and
slots r..2r−1 the open one; when a group completes the open half moves down.
"""

from __future__ import annotations

import torch

from .config import ModelConfig
from .numerics import Numerics, qdq4p
from .quant import act_quant_dequant
from .weights import need


# ----------------------------------------------------------------------------------------------
# Activation rotations and quantisation of the V4 KV layouts
# ----------------------------------------------------------------------------------------------


_HADAMARD: dict[int, torch.Tensor] = {}


def hadamard_matrix(n: int) -> torch.Tensor:
    """The n×n Sylvester Hadamard matrix (entries ±1, float64; n a power of two), the order of
    fast_hadamard_transform."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard: size {n} is not a power of two")
    if n not in _HADAMARD:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        _HADAMARD[n] = h
    return _HADAMARD[n]


def rotate_activation(x: torch.Tensor, num: Numerics) -> torch.Tensor:
    """The reference's `rotate_activation`: Walsh–Hadamard transform of the last dim scaled by d^-1/2.

    fp32 mode: one float64 product with the ±1 matrix, scaled and rounded once (row independent).
    reference-bf16 mode: fast_hadamard_transform's arithmetic (read from its CUDA source): fp32 butterfly
    stages of increasing stride (1, 2, 4 in a thread, then across warp lanes and register chunks, the order
    the kernel runs them in for d = 2^k up to 512) on the bf16 input, times the fp32 scale in fp32, rounded
    once to bf16. Checked against scipy.linalg.hadamard at that rounding through the V4 conformance's CPU
    stand-in (tests/oracle/test_fast_hadamard_cpu.py)."""
    d = x.shape[-1]
    scale = d ** -0.5
    if not num.bf16:
        h = hadamard_matrix(d).to(x.device)
        return ((x.double() @ h) * scale).float()
    y = x.to(torch.bfloat16).float()
    step = 1
    while step < d:
        y = y.unflatten(-1, (-1, 2, step))
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack([a + b, a - b], dim=-2).flatten(-3)
        step *= 2
    return (y * scale).to(torch.bfloat16).float()


def qdq8_nope(x: torch.Tensor, rope_dim: int, block: int = 64, scale_fmt: str | None = "ue8m0") -> torch.Tensor:
    """The V4 fp8 KV layout: QDQ8 (e4m3, one scale per `block`) of every channel but the last `rope_dim`,
    which stay as they are (bf16 in the reference)."""
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    return torch.cat([act_quant_dequant(nope, block, scale_fmt), rope], dim=-1)


# ----------------------------------------------------------------------------------------------
# Compressor
# ----------------------------------------------------------------------------------------------


class CompressorV4:
    """One layer's compressor (attention: d = head_dim; indexer: d = index_head_dim with `rotate`).

    `__call__(x, start_pos, state, num)` -> the new compressed cache rows [b, g, d] (post-RoPE, post-QDQ),
    or None when no group completes; `state` is a dict holding "kv"/"score" between calls."""

    def __init__(self, cfg: ModelConfig, layer_id: int, head_dim: int, freqs: torch.Tensor, rotate: bool = False):
        self.cfg, self.layer_id, self.d, self.freqs, self.rotate = cfg, layer_id, head_dim, freqs, rotate
        self.ratio = cfg.ratio(layer_id)
        if self.ratio < 1:
            raise ValueError(f"layer {layer_id}: a V4 compressor needs a ratio >= 1, got {self.ratio}")
        self.overlap = self.ratio == 4
        self.coff = 2 if self.overlap else 1

    def load(self, w: dict, p: str) -> "CompressorV4":
        """`p` ends with 'compressor.'."""
        self.ape = need(w, p + "ape")
        self.wkv = need(w, p + "wkv.weight")
        self.wgate = need(w, p + "wgate.weight")
        self.norm = need(w, p + "norm.weight")
        want = (self.ratio, self.coff * self.d)
        if tuple(self.ape.shape) != want:
            raise ValueError(f"{p}ape has shape {tuple(self.ape.shape)}, expected {want}")
        return self

    def _overlap_windows(self, t: torch.Tensor, fill: float) -> torch.Tensor:
        """[b, g, r, 2d] -> [b, g, 2r, d]: entry j = (group j-1 on channels :d, group j on channels d:)."""
        b, g, r, _ = t.shape
        d = self.d
        out = t.new_full((b, g, 2 * r, d), fill)
        out[:, :, r:] = t[:, :, :, d:]
        out[:, 1:, :r] = t[:, :-1, :, :d]
        return out

    def __call__(self, x: torch.Tensor, start_pos: int, state: dict, num: Numerics) -> torch.Tensor | None:
        pooled = self.pool(x, start_pos, state, num)
        if pooled is None:
            return None
        # the groups this call completed, the first one open before it (a prefill: group 0)
        positions = (torch.arange(pooled.shape[1]) + start_pos // self.ratio) * self.ratio
        return self.finish(pooled, positions.to(x.device), num)

    def pool(self, x: torch.Tensor, start_pos: int, state: dict, num: Numerics) -> torch.Tensor | None:
        """The gated pooling: [b, g, d] fp32 for the groups this call completes, or None."""
        r, d, c = self.ratio, self.d, self.coff
        b, s, _ = x.shape
        # the reference computes the whole compressor in fp32 with fp32 copies of the bf16 weights
        kv, score = num.fp32_linear(x, self.wkv), num.fp32_linear(x, self.wgate)
        pool = lambda v, z, dim: (v * z.softmax(dim=dim)).sum(dim=dim)  # noqa: E731 per channel over slots
        if start_pos > 0 and s > 1:
            return self._pool_chunk(kv, score, start_pos, state, num)
        if start_pos == 0:
            cut = s - s % r
            kv_state = kv.new_zeros(b, c * r, c * d)
            score_state = kv.new_full((b, c * r, c * d), float("-inf"))
            if self.overlap and cut >= r:  # the last complete group is the next group's Ca half
                kv_state[:, :r] = kv[:, cut - r:cut]
                score_state[:, :r] = score[:, cut - r:cut] + self.ape
            open_at = r if self.overlap else 0
            kv_state[:, open_at:open_at + s - cut] = kv[:, cut:]
            score_state[:, open_at:open_at + s - cut] = score[:, cut:] + self.ape[:s - cut]
            state["kv"], state["score"] = kv_state, score_state
            if cut == 0:
                return None
            kv = kv[:, :cut].unflatten(1, (-1, r))
            score = score[:, :cut].unflatten(1, (-1, r)) + self.ape
            if self.overlap:
                kv, score = self._overlap_windows(kv, 0.0), self._overlap_windows(score, float("-inf"))
            return num.f32(lambda v, z: pool(v, z, 2), kv, score)  # [b, g, d]
        else:
            if s != 1 or "kv" not in state:
                raise RuntimeError(f"compressor layer {self.layer_id}: decode at {start_pos} needs one token "
                                   "after a prefill")
            slot = start_pos % r
            score = score + self.ape[slot]
            at = r + slot if self.overlap else slot
            state["kv"][:, at] = kv[:, 0]
            state["score"][:, at] = score[:, 0]
            if (start_pos + 1) % r:
                return None
            kv_s, sc_s = state["kv"], state["score"]
            if self.overlap:
                kv_s = torch.cat([kv_s[:, :r, :d], kv_s[:, r:, d:]], dim=1)
                sc_s = torch.cat([sc_s[:, :r, :d], sc_s[:, r:, d:]], dim=1)
            pooled = num.f32(lambda v, z: pool(v, z, 1), kv_s, sc_s).unsqueeze(1)
            if self.overlap:
                state["kv"][:, :r] = state["kv"][:, r:].clone()
                state["score"][:, :r] = state["score"][:, r:].clone()
            return pooled

    def _pool_chunk(self, kv: torch.Tensor, score: torch.Tensor, start_pos: int, state: dict,
                    num: Numerics) -> torch.Tensor | None:
        """A chunk of a chunked prefill: the open group's tokens (and, with overlap, the last complete group)
        lead the chunk's, then the groups pool exactly as a one-pass prefill pools them; the state is left as
        the prefill leaves it."""
        r, d, c = self.ratio, self.d, self.coff
        if "kv" not in state:
            raise RuntimeError(f"compressor layer {self.layer_id}: a prefill chunk at {start_pos} needs the "
                               "state of the chunks before it")
        b, s, _ = kv.shape
        n_open = start_pos % r
        open_at = r if self.overlap else 0
        score = score + self.ape[(torch.arange(start_pos, start_pos + s) % r)]
        kv = torch.cat([state["kv"][:, open_at:open_at + n_open], kv], dim=1)
        score = torch.cat([state["score"][:, open_at:open_at + n_open], score], dim=1)
        total = kv.shape[1]
        cut = total - total % r
        kv_state = kv.new_zeros(b, c * r, c * d)
        score_state = kv.new_full((b, c * r, c * d), float("-inf"))
        if self.overlap:  # the group before the last one this chunk completes is its Ca half
            if cut >= r:
                kv_state[:, :r], score_state[:, :r] = kv[:, cut - r:cut], score[:, cut - r:cut]
            else:
                kv_state[:, :r], score_state[:, :r] = state["kv"][:, :r], state["score"][:, :r]
        kv_state[:, open_at:open_at + total - cut] = kv[:, cut:]
        score_state[:, open_at:open_at + total - cut] = score[:, cut:]
        prev_kv, prev_score = state["kv"][:, :r], state["score"][:, :r]
        state["kv"], state["score"] = kv_state, score_state
        if cut == 0:
            return None
        kv = kv[:, :cut].unflatten(1, (-1, r))
        score = score[:, :cut].unflatten(1, (-1, r))
        if self.overlap:  # the last complete group before this chunk leads, as group j-1 of the first one
            kv = self._overlap_windows(torch.cat([prev_kv.unsqueeze(1), kv], dim=1), 0.0)[:, 1:]
            score = self._overlap_windows(torch.cat([prev_score.unsqueeze(1), score], dim=1), float("-inf"))[:, 1:]
        return num.f32(lambda v, z: (v * z.softmax(dim=2)).sum(dim=2), kv, score)  # [b, g, d]

    def finish(self, pooled: torch.Tensor, positions: torch.Tensor, num: Numerics) -> torch.Tensor:
        """Pooled [b, g, d] -> cache rows: bf16 cast, RMSNorm, RoPE at each group's first position, then the
        rotation + QDQ4 (indexer) or QDQ8 of the nope dims (attention)."""
        cfg = self.cfg
        latent = num.rmsnorm(num.r(pooled), self.norm, cfg.norm_eps)  # bf16 cast precedes the norm
        cis = num.rope_cis(self.freqs, positions, cfg.max_seq_len)
        latent = num.r(num.rope(latent, cis))
        if self.rotate:
            return qdq4p(rotate_activation(latent, num), 32)
        return qdq8_nope(latent, cfg.rope_head_dim, 64, cfg.scale_fmt)


# ----------------------------------------------------------------------------------------------
# Lightning indexer (ratio-4 layers only)
# ----------------------------------------------------------------------------------------------


class IndexerV4:
    """Scores the layer's own head-128 compressed keys with `index_n_heads` query heads and keeps the best
    `index_topk` per query: q = QDQ4(rotate(rope(wq_b(qr)))), k from the indexer's compressor,
    score = Σ_h relu(q_h·k)·w_h with w = weights_proj(x)·(D·H)^-1/2."""

    def __init__(self, cfg: ModelConfig, layer_id: int, freqs: torch.Tensor):
        self.cfg, self.layer_id, self.freqs, self.ratio = cfg, layer_id, freqs, cfg.ratio(layer_id)
        self.compressor = CompressorV4(cfg, layer_id, cfg.index_head_dim, freqs, rotate=True)

    def load(self, w: dict, p: str) -> "IndexerV4":
        """`p` ends with 'attn.'."""
        self.wq_b = need(w, p + "indexer.wq_b.weight")
        self.weights_proj = need(w, p + "indexer.weights_proj.weight")
        self.compressor.load(w, p + "indexer.compressor.")
        return self

    def __call__(self, x, qr, cis, start_pos: int, offset: int, cache, num: Numerics) -> torch.Tensor:
        """-> compressed indices [b, s, min(index_topk, G)] into kv_all (+ `offset`), −1 where not visible."""
        cfg, r = self.cfg, self.ratio
        b, s, _ = x.shape
        end_pos = start_pos + s
        H, D = cfg.index_n_heads, cfg.index_head_dim
        q = num.qlinear(qr, self.wq_b, 128, fmt=cfg.scale_fmt).unflatten(-1, (H, D))
        q = qdq4p(rotate_activation(num.r(num.rope(q, cis)), num), 32)
        if start_pos == 0:
            cache.index_state = {}
        new = self.compressor(x, start_pos, cache.index_state, num)
        if new is not None:
            cache.index_k = new if start_pos == 0 or cache.index_k is None else torch.cat([cache.index_k, new], 1)
        G = end_pos // r
        if G == 0:
            return torch.empty(b, s, 0, dtype=torch.int64)
        K = cache.index_k[:, :G]
        w = num.r(num.linear(x, self.weights_proj) * (D**-0.5 * H**-0.5))
        # bf16 tensors in the reference: q.K, relu x weight, and the sum over heads
        score = num.on_bf16(lambda a, c: torch.einsum("bshd,btd->bsht", a, c), q, K)
        score = num.r(score.relu() * w.unsqueeze(-1))
        score = num.on_bf16(lambda t: t.sum(dim=2), score)
        if start_pos == 0 or s > 1:  # query t sees entries j < (t+1)//r
            visible = (torch.arange(start_pos + 1, end_pos + 1) // r).unsqueeze(-1)  # [s, 1]
            score = score.masked_fill(torch.arange(G) >= visible, float("-inf"))
        else:
            visible = torch.tensor(G)
        _, sel = num.topk(score, min(cfg.index_topk, G), f"indexer.{self.layer_id}")
        return torch.where(sel >= visible, -1, sel + offset)
