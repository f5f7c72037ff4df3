"""DSpark draft stages `mtp.*` (§15): window-only attention seeded from the backbone taps, a bidirectional
block of draft queries, the Markov bias and the confidence head. Greedy drafts (the oracle never samples)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import Attention, LayerCache, sparse_attn
from .block import Block, StepContext, embed_step
from .config import ModelConfig
from .hyper import hc_pre
from .weights import need


class DSparkAttention(Attention):
    def __call__(self, x, start_pos, cache: LayerCache, shared, num, main_x=None):
        cfg, W = self.cfg, self.cfg.window_size
        b, s_main, _ = main_x.shape
        main_cis = num.rope_cis(self.freqs, torch.arange(start_pos, start_pos + s_main), self.cfg.max_seq_len)
        main_kv = self._kv(main_x, main_cis, num)
        if start_pos == 0:  # prefill only seeds the ring with the prompt positions
            cache.ring = main_kv.new_zeros(b, W, cfg.head_dim)
            keep = torch.arange(max(0, s_main - W), s_main)
            cache.ring[:, keep % W] = main_kv[:, keep]
            return x
        if cache.ring is None:
            raise RuntimeError(f"DSpark stage {self.layer_id}: decode before the prefill seeded its ring")
        B = x.shape[1]
        cis = num.rope_cis(self.freqs, torch.arange(start_pos + s_main, start_pos + s_main + B),
                           self.cfg.max_seq_len)
        _, q = self._query(x, cis, num)
        kv_blk = self._kv(x, cis, num)  # block keys are not cached
        cache.ring[:, start_pos % W] = main_kv[:, 0]
        kv_all = torch.cat([cache.ring, kv_blk], dim=1)
        # the filled ring plus ALL block rows: bidirectional inside the block (§15)
        idx = torch.cat([torch.arange(min(W, start_pos + 1)), W + torch.arange(B)])
        o = sparse_attn(q, kv_all, self.attn_sink, idx.view(1, 1, -1).expand(b, B, -1), cfg.head_dim**-0.5, num)
        return self._output(o, cis, num)


@dataclass
class DraftOutput:
    ids: torch.Tensor  # [b, B + 1]: the given token then B greedy drafts
    logits: torch.Tensor  # [b, B, V] fp32, Markov bias included
    confidence: torch.Tensor  # [b, B]


class DSparkStage(Block):
    """A draft stage: a Block whose attention reads the backbone taps (`ctx.main_x`)."""

    attention_cls = DSparkAttention

    def run_attn(self, x, ctx):
        return self.attn(x, ctx.start_pos, ctx.state.cache(self.layer_id), ctx.state.shared, ctx.num,
                         main_x=ctx.main_x)


class DSpark:
    def __init__(self, cfg: ModelConfig, w: dict, embed, head):
        self.cfg, self.embed, self.head = cfg, embed, head
        self.stages = [DSparkStage(cfg, cfg.n_layers + i).load(w) for i in range(cfg.n_mtp_layers)]
        self.main_proj = need(w, "mtp.0.main_proj.weight")
        self.main_norm = need(w, "mtp.0.main_norm.weight")
        last = f"mtp.{cfg.n_mtp_layers - 1}."
        self.norm = need(w, last + "norm.weight")
        self.markov_embed = need(w, last + "markov_head.embed.weight")
        self.markov_head = need(w, last + "markov_head.head.weight")
        self.confidence = need(w, last + "confidence_head.proj.weight")

    @torch.inference_mode()
    def forward_spec(self, tok: torch.Tensor, main_hidden: torch.Tensor, start_pos: int, state) -> DraftOutput | None:
        """tok [b]: the token just produced; main_hidden: the taps of the backbone call at start_pos."""
        cfg, num = self.cfg, state.num
        main_x = num.rmsnorm(num.qlinear(main_hidden, self.main_proj), self.main_norm, cfg.norm_eps)
        b, B = tok.shape[0], cfg.dspark_block_size
        ids = torch.full((b, B), cfg.dspark_noise_token_id, dtype=torch.int64)
        ids[:, 0] = tok
        x, pre = embed_step(self.embed, ids, cfg.hc_mult)
        ctx = StepContext(start_pos, state, None, main_x)
        for stage in self.stages:
            if start_pos == 0:
                stage.run_attn(x, ctx)  # seeds the ring; x and pre pass through unchanged
            else:
                x, pre = stage(x, pre, ctx)
        if start_pos == 0:
            return None
        # forward_head (§15): the last stage's norm, the backbone head, then the Markov bias
        xc = hc_pre(x, pre, num)
        logits = num.fp32_linear(num.rmsnorm(xc, self.norm, cfg.norm_eps), self.head.weight)
        out = torch.empty(b, B + 1, dtype=torch.int64)
        out[:, 0] = tok
        embeds = []
        for i in range(B):
            e = self.markov_embed[out[:, i]]
            logits[:, i] += num.fp32_linear(e, self.markov_head)
            embeds.append(e)
            out[:, i + 1] = logits[:, i].argmax(-1)
        # x is NOT normed
        conf = num.fp32_linear(torch.cat([xc, torch.stack(embeds, 1)], -1), self.confidence).squeeze(-1)
        return DraftOutput(out, logits, conf)
