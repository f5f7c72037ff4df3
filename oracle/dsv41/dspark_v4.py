"""DeepSeek-V4's DSpark drafter (the `mtp.*` component of V4-Flash), in the layout exllamav3 1.6.5 reads.

Facts from exllamav3's `architecture/deepseek_v4_mtp.py` and `modules/arch_specific/dspark.py` (read, not
copied); DeepSeek's V4 reference folder of docs/ORACLE.md (V4-Pro's `inference/model.py`) has the classic MTP
block instead, so it cannot be the authority here:

* **taps**: the stream mean of the trunk's residual streams at the OUTPUT of each layer in
  `dspark_target_layer_ids` (V4.1 taps a layer's input), concatenated: [b, s, n_taps * d];
* **entry**: main_x = main_norm(main_proj(taps)) (`mtp.0.main_proj`, `mtp.0.main_norm`); every stage turns each
  target position's main_x into one window-KV row at that position (kv_norm(wkv(main_x)), RoPE);
* **the draft block**: [seed, noise × (block − 1)] (`dspark_noise_token_id`, `dspark_block_size`) at positions
  p0 … p0 + block − 1, p0 = the number of target positions so far; embedded with the trunk's embedding and
  broadcast to `hc_mult` streams;
* **stages** `mtp.0 … mtp.N−1`: a V4 block (standard mHC, compressor-less attention, the biased top-k MoE with
  the trunk's expert count) whose attention lets every block query see, in one softmax with the sinks, the last
  min(window, p0) main-KV rows and the WHOLE block (bidirectional inside the block);
* **exit**: the last stage's own `hc_head_*` collapse (pre-norm state), its `norm`, the trunk's `head`;
* **markov head** (`markov_head.markov_w1` [V, r] embedding, `markov_w2` [V, r]): greedy, one position at a time,
  logits[i] += markov_w2 · markov_w1[out[i]], out[i + 1] = argmax; **confidence** (`confidence_head.proj`
  [1, d + r]) on cat(pre-norm state, markov embedding) per position (exllamav3 keeps the longest prefix with
  sigmoid >= 0.5).

Numerics follow the trunk's V4 attention (attention_v4): QDQ8 of GEMM inputs per 128, the KV nope dims QDQ8 per
64 as the reference's act_quant (exllamav3 leaves the drafter's KV unquantised unless EXL3_DSPARK_FP8KV=1), in
`fp32` with float64 accumulation and in `reference-bf16` with the reference's dtypes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import sparse_attn
from .attention_v4 import AttentionV4, head_rmsnorm
from .block import StepContext, embed_step
from .block_v4 import BlockV4
from .compressor_v4 import qdq8_nope
from .config import ModelConfig
from .head import HyperHead
from .mtp import DraftOutput
from .numerics import Numerics
from .weights import need


@dataclass
class DSparkCacheV4:
    """A drafter stage's main-KV rows, one per target position so far (position order); the draft block's own
    rows are never cached. (The window keeps the full history, as the trunk's does.)"""

    main_kv: torch.Tensor | None = None  # [b, positions, head_dim]


class DSparkAttentionV4(AttentionV4):
    """The trunk's compressor-less V4 attention with DSpark's draft semantics."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__(cfg, layer_id)
        if self.ratio:
            raise ValueError(f"DSpark stage {layer_id - cfg.n_layers}: compress ratio {self.ratio}; the V4 "
                             "drafter's stages are compressor-less (compress_ratios 0 past the trunk)")

    def _kv(self, x, cis, num: Numerics) -> torch.Tensor:
        # as AttentionV4's window KV: kv_norm(wkv(x)), RoPE, QDQ8 of the nope dims
        cfg = self.cfg
        kv = num.rmsnorm(self._lin(x, self.wkv, num), self.kv_norm, cfg.norm_eps)
        return qdq8_nope(num.r(num.rope(kv, cis)), cfg.rope_head_dim, 64, cfg.scale_fmt)

    def _query(self, x, cis, num: Numerics) -> torch.Tensor:
        cfg = self.cfg
        qr = num.rmsnorm(self._lin(x, self.wq_a, num), self.q_norm, cfg.norm_eps)
        q = self._lin(qr, self.wq_b, num).unflatten(-1, (cfg.n_heads, cfg.head_dim))
        return num.r(num.rope(head_rmsnorm(q, cfg.norm_eps, num), cis))

    def __call__(self, x: torch.Tensor, p0: int, cache: DSparkCacheV4, num: Numerics,
                 main_x: torch.Tensor) -> torch.Tensor:
        """main_x [b, s_main, d]: the target positions p0 − s_main … p0 − 1 (appended to the main-KV rows);
        x [b, B, d]: the draft block at positions p0 … p0 + B − 1."""
        cfg = self.cfg
        b, s_main, _ = main_x.shape
        have = 0 if cache.main_kv is None else cache.main_kv.shape[1]
        if have != p0 - s_main:
            raise RuntimeError(f"DSpark stage {self.layer_id - cfg.n_layers}: {have} main-KV rows cached, but the "
                               f"new rows start at position {p0 - s_main}")
        main_cis = num.rope_cis(self.freqs, torch.arange(p0 - s_main, p0), cfg.max_seq_len)
        new = self._kv(main_x, main_cis, num)
        cache.main_kv = new if cache.main_kv is None else torch.cat([cache.main_kv, new], dim=1)
        B = x.shape[1]
        cis = num.rope_cis(self.freqs, torch.arange(p0, p0 + B), cfg.max_seq_len)
        q = self._query(x, cis, num)
        hist = min(cfg.window_size, p0)
        kv_all = torch.cat([cache.main_kv[:, p0 - hist:p0], self._kv(x, cis, num)], dim=1)
        idx = torch.arange(hist + B).view(1, 1, -1).expand(b, B, -1)  # every query sees every row
        o = sparse_attn(q, kv_all, self.attn_sink, idx, cfg.head_dim**-0.5, num)
        return self._output(o, cis, num)


class DSparkStageV4(BlockV4):
    """A drafter stage: a V4 block whose attention also reads the projected taps (`ctx.main_x`)."""

    def make_attention(self, index_k: str) -> DSparkAttentionV4:
        return DSparkAttentionV4(self.cfg, self.layer_id)

    def run_attn(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        return self.attn(x, ctx.start_pos, ctx.state.cache(self.layer_id, DSparkCacheV4), ctx.num,
                         main_x=ctx.main_x)


class DSparkV4:
    """The drafter over the trunk's `embed` and `head` (a HyperHead: only its vocabulary projection is used)."""

    def __init__(self, cfg: ModelConfig, w: dict, embed, head):
        self.cfg, self.embed = cfg, embed
        self.head_weight = head.weight
        self.stages = [DSparkStageV4(cfg, cfg.n_layers + i).load(w) for i in range(cfg.n_mtp_layers)]
        self.main_proj = need(w, "mtp.0.main_proj.weight")
        self.main_norm = need(w, "mtp.0.main_norm.weight")
        last = f"mtp.{cfg.n_mtp_layers - 1}."
        self.exit = HyperHead(cfg).load({"norm.weight": need(w, last + "norm.weight"), "head.weight": head.weight,
                                          **{f"hc_head_{k}": need(w, f"{last}hc_head_{k}")
                                             for k in ("fn", "base", "scale")}})
        self.markov_w1 = need(w, last + "markov_head.markov_w1.weight")
        self.markov_w2 = need(w, last + "markov_head.markov_w2.weight")
        self.confidence = need(w, last + "confidence_head.proj.weight")

    def project_taps(self, taps: torch.Tensor, num: Numerics) -> torch.Tensor:
        """main_x = main_norm(main_proj(taps)) [b, s, d]."""
        return num.rmsnorm(num.qlinear(taps, self.main_proj, 128, fmt=self.cfg.scale_fmt), self.main_norm,
                           self.cfg.norm_eps)

    @torch.inference_mode()
    def forward_spec(self, tok: torch.Tensor, main_hidden: torch.Tensor, start_pos: int, state) -> DraftOutput:
        """tok [b]: the token the trunk just produced (its position is start_pos + s); main_hidden [b, s, n_taps·d]:
        the taps of the trunk call at start_pos (a prefill or one decode step). Drafts after a prefill too."""
        cfg, num = self.cfg, state.num
        main_x = self.project_taps(main_hidden, num)
        p0 = start_pos + main_hidden.shape[1]
        b, B = tok.shape[0], cfg.dspark_block_size
        ids = torch.full((b, B), cfg.dspark_noise_token_id, dtype=torch.int64)
        ids[:, 0] = tok
        x, pre = embed_step(self.embed, ids, cfg.hc_mult)
        ctx = StepContext(p0, state, None, main_x, input_ids=ids)
        for stage in self.stages:
            x, pre = stage(x, pre, ctx)
        xc = self.exit.collapse(x, num)  # the confidence head reads this pre-norm state
        logits = self.exit(x, num)       # the stage's norm, then the trunk's head
        out = torch.empty(b, B + 1, dtype=torch.int64)
        out[:, 0] = tok
        embeds = []
        for i in range(B):
            e = self.markov_w1[out[:, i]]
            logits[:, i] += num.fp32_linear(e, self.markov_w2)
            embeds.append(e)
            out[:, i + 1] = logits[:, i].argmax(-1)
        conf = num.fp32_linear(torch.cat([xc, torch.stack(embeds, 1)], -1), self.confidence).squeeze(-1)
        return DraftOutput(out, logits, conf)


@dataclass(frozen=True)
class DraftAcceptance:
    """The oracle drafter's own acceptance along the trunk's greedy continuation of one prompt (what a lossless
    greedy speculative decoder with this drafter accepts): per draft, the number of leading draft tokens equal to
    the trunk's next greedy tokens. `confident` counts the drafts' leading positions with sigmoid(confidence)
    >= 0.5 (exllamav3's draft-length gate)."""

    block: int
    accepted: tuple[int, ...]    # one per draft
    confident: tuple[int, ...]   # one per draft
    nonfinite_drafts: int        # drafts whose logits or confidences hold a NaN / inf

    @property
    def tau(self) -> float:
        """Mean acceptance length: 1 (the target's own token) + accepted draft tokens per draft."""
        return 1 + sum(self.accepted) / len(self.accepted)

    @property
    def alpha_j(self) -> tuple[float, ...]:
        """Per draft position j = 1..block: the fraction of drafts whose first j tokens were all accepted."""
        return tuple(sum(a >= j for a in self.accepted) / len(self.accepted) for j in range(1, self.block + 1))


@torch.inference_mode()
def draft_acceptance(model, prompt: torch.Tensor, new_tokens: int) -> DraftAcceptance:
    """Greedy-decode `new_tokens` tokens after `prompt` [s] with the trunk, drafting after the prefill and after
    every decode step from the trunk's own taps, and score each draft against the continuation (only drafts
    whose whole block lies inside it). `model`: an oracle Model whose `mtp` is a DSparkV4."""
    if not isinstance(model.mtp, DSparkV4):
        raise TypeError("draft_acceptance: the model has no DeepSeek-V4 DSpark drafter (dspark_block_size 0?)")
    B = model.cfg.dspark_block_size
    if new_tokens <= B:
        raise ValueError(f"draft_acceptance: new_tokens {new_tokens} leaves no draft whose block of {B} fits")
    st = model.new_state(1)
    out = model.forward(prompt.view(1, -1), st)
    greedy, drafts = [], []
    pos = 0
    for _ in range(new_tokens):
        tok = out.logits[:, -1].argmax(-1)
        greedy.append(int(tok))
        drafts.append(model.mtp.forward_spec(tok, out.main_hidden, pos, st))
        pos = st.next_pos
        out = model.forward(tok.view(1, 1), st)
    accepted, confident, bad = [], [], 0
    for t, d in enumerate(drafts):
        bad += int(not (torch.isfinite(d.logits).all() and torch.isfinite(d.confidence).all()))
        if t + B >= len(greedy):
            continue
        proposed = d.ids[0, 1:].tolist()
        n = 0
        while n < B and proposed[n] == greedy[t + 1 + n]:
            n += 1
        accepted.append(n)
        keep = (torch.sigmoid(d.confidence[0]) >= 0.5).int()
        confident.append(int(torch.cumprod(keep, 0).sum()))
    return DraftAcceptance(B, tuple(accepted), tuple(confident), bad)


__all__ = ["DSparkAttentionV4", "DSparkCacheV4", "DSparkStageV4", "DSparkV4", "DraftAcceptance", "draft_acceptance"]
