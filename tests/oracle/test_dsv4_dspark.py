"""DeepSeek-V4's DSpark drafter: the tiny V4 checkpoint's `mtp.*` (oracle.dsv41.tiny_v4.TinyDSpark) and the
oracle's V4 drafter (oracle/dsv41/dspark_v4.py) against an independent re-derivation.

DeepSeek's V4 reference folder (docs/ORACLE.md) has the classic MTP block, not DSpark, and exllamav3's torch code
needs its CUDA extension, so the second opinion is `_rederived_drafts` below: written from exllamav3's math
(architecture/deepseek_v4_mtp.py, modules/arch_specific/dspark.py), dense and in float64. What it re-derives is
what is DSpark's own: where the taps are read, main_proj / main_norm, which main-KV rows exist and at which
positions, which rows each block query sees (the last min(window, p0) target rows and the WHOLE block, one
softmax with the sinks), the chain of stages over the broadcast block embedding, the last stage's hc_head
collapse, norm and the trunk head, the sequential markov bias and the confidence head. It shares with the oracle
only the trunk's primitives, which the V4 conformance rows hold bit for bit against DeepSeek's V4 reference: the
attention projections and grouped output (`_query`, `_kv`, `_output`), the mHC mixes / hc_pre / hc_post, the MoE.
Can-fail: a causal block, taps at layer inputs and a block one position late each move the result far outside
the tolerance.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from oracle.dsv41.block import StepContext, embed_step
from oracle.dsv41.checkpoint import Checkpoint
from oracle.dsv41.dspark_v4 import DSparkV4
from oracle.dsv41.hyper import hc_post, hc_pre
from oracle.dsv41.model import Model
from oracle.dsv41.numerics import Numerics
from oracle.dsv41.runner import full_weights
from oracle.dsv41.tiny_v4 import TinyDSpark, write_tiny_v4_checkpoint

OVERRIDES = {"vocab_size": 512, "sliding_window": 16}
PREFILL, DECODES = 20, 3  # the prefill passes the window (16): the block sees the last 16 target rows only


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsv4-dspark")
    plain = write_tiny_v4_checkpoint(root / "plain", seed=1, overrides=OVERRIDES)
    with_drafter = write_tiny_v4_checkpoint(root / "dspark", seed=1, overrides=OVERRIDES, dspark=TinyDSpark())
    return plain, with_drafter


def _tensors(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            out.update({k: sf.get_tensor(k) for k in sf.keys()})  # noqa: SIM118 (safe_open is no dict)
    return out


def test_the_drafter_leaves_the_trunk_bit_identical(ckpts):
    plain, with_drafter = (_tensors(p) for p in ckpts)
    assert set(with_drafter) - set(plain) and all(k.startswith("mtp.") for k in set(with_drafter) - set(plain))
    assert set(plain) <= set(with_drafter)
    differ = [k for k in plain if plain[k].dtype != with_drafter[k].dtype
              or not torch.equal(plain[k].view(torch.uint8), with_drafter[k].view(torch.uint8))]
    assert differ == []
    a, b = (json.loads((p / "config.json").read_text()) for p in ckpts)
    dspark_keys = {"dspark_block_size", "dspark_noise_token_id", "dspark_markov_rank", "dspark_target_layer_ids"}
    assert set(b) - set(a) == dspark_keys
    assert b["compress_ratios"] == a["compress_ratios"] + [0, 0] and b["num_nextn_predict_layers"] == 2
    assert {k: v for k, v in b.items() if k not in dspark_keys | {"compress_ratios", "num_nextn_predict_layers"}} \
        == {k: v for k, v in a.items() if k not in {"compress_ratios", "num_nextn_predict_layers"}}


def test_the_drafter_is_in_exllamav3s_layout(ckpts):
    """The names exllamav3's DeepseekV4MTPModel loads (and its gate: mtp.0.attn.wkv exists)."""
    names = set(_tensors(ckpts[1]))
    for n in ("mtp.0.main_proj.weight", "mtp.0.main_proj.scale", "mtp.0.main_norm.weight", "mtp.0.attn.wkv.weight",
              "mtp.1.attn.attn_sink", "mtp.1.hc_attn_fn", "mtp.1.ffn.gate.bias", "mtp.1.ffn.experts.63.w2.weight",
              "mtp.1.ffn.shared_experts.w1.weight", "mtp.1.hc_head_fn", "mtp.1.hc_head_base", "mtp.1.hc_head_scale",
              "mtp.1.norm.weight", "mtp.1.markov_head.markov_w1.weight", "mtp.1.markov_head.markov_w2.weight",
              "mtp.1.confidence_head.proj.weight"):
        assert n in names, n
    assert not any(".compressor." in n or "tid2eid" in n for n in names if n.startswith("mtp."))
    ck = Checkpoint(ckpts[1])   # validates every tensor against the inventory (names, shapes, dtypes)
    assert ck.model_config.n_mtp_layers == 2 and ck.model_config.dspark_target_layer_ids == (1, 2, 3)


def _model(ck_dir, precision):
    ck = Checkpoint(ck_dir)
    cfg = ck.model_config
    w = full_weights(ck)
    for S in range(cfg.n_mtp_layers):
        w.update({f"mtp.{S}.{k}": v for k, v in ck.load_mtp(S).items()})
    return Model(cfg, w, None, precision=precision), w


def _rederived_taps(m: Model, ids: torch.Tensor) -> torch.Tensor:
    """The stream mean at the OUTPUT of each target layer (exllamav3's export_state_layers), one fresh pass."""
    num, st = Numerics("fp32"), m.new_state(ids.shape[0])
    h, pre = embed_step(m.embed, ids, m.cfg.hc_mult)
    ctx = StepContext(0, st, None, input_ids=ids)
    taps = []
    for L, block in enumerate(m.blocks):
        h, pre = block(h, pre, ctx)
        if L in m.cfg.dspark_target_layer_ids:
            taps.append(h.mean(dim=2))
    return num.r(torch.cat(taps, -1))


class Rederived:
    """The drafter from exllamav3's math, dense, float64 softmax / collapse / norm / head / markov / confidence."""

    def __init__(self, m: Model, w: dict, causal: bool = False, shift: int = 0):
        self.m, self.cfg, self.w, self.causal, self.shift = m, m.cfg, w, causal, shift
        self.rows: list[list[torch.Tensor]] = [[] for _ in m.mtp.stages]  # per stage: [b, 1, D] per position

    def _attn(self, stage, x, p0, main_x, num):
        cfg, attn = self.cfg, stage.attn
        n_main = main_x.shape[1]
        cis_main = num.rope_cis(attn.freqs, torch.arange(p0 - n_main, p0), cfg.max_seq_len)
        kv_main = attn._kv(main_x, cis_main, num)
        self.rows[stage.layer_id - cfg.n_layers] += list(kv_main.split(1, dim=1))
        rows = self.rows[stage.layer_id - cfg.n_layers]
        assert len(rows) == p0
        B = x.shape[1]
        pos = torch.arange(p0 + self.shift, p0 + self.shift + B)
        cis = num.rope_cis(attn.freqs, pos, cfg.max_seq_len)
        q, kv_blk = attn._query(x, cis, num).double(), attn._kv(x, cis, num)
        hist = min(cfg.window_size, p0)
        keys = torch.cat(rows[p0 - hist:] + [kv_blk], dim=1).double()            # [b, hist + B, D]
        scores = torch.einsum("bqhd,bkd->bqhk", q, keys) * cfg.head_dim ** -0.5
        if self.causal:  # can-fail: block queries see only earlier block rows
            mask = torch.ones(B, hist + B, dtype=torch.bool)
            mask[:, hist:] = torch.tril(torch.ones(B, B, dtype=torch.bool))
            scores = scores.masked_fill(~mask[None, :, None, :], float("-inf"))
        sink = attn.attn_sink.double().view(1, 1, -1, 1).expand(*scores.shape[:3], 1)
        p = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]          # the sink takes its share
        o = torch.einsum("bqhk,bkd->bqhd", p, keys).float()
        return attn._output(o, cis, num)

    def draft(self, tok, taps, p0, num):
        cfg, w = self.cfg, self.w
        d0 = num.qlinear(taps, w["mtp.0.main_proj.weight"], 128, fmt=cfg.scale_fmt).double()
        main_x = (d0 * torch.rsqrt(d0.square().mean(-1, keepdim=True) + cfg.norm_eps)
                  * w["mtp.0.main_norm.weight"].double()).float()
        B = cfg.dspark_block_size
        ids = torch.full((tok.shape[0], B), cfg.dspark_noise_token_id)
        ids[:, 0] = tok
        x = w["embed.weight"][ids].unsqueeze(2).repeat(1, 1, cfg.hc_mult, 1)   # broadcast to the streams
        for stage in self.m.mtp.stages:
            a_pre, a_post, a_comb = stage.mixes(x, stage.hc_attn, num)
            y = self._attn(stage, num.rmsnorm(hc_pre(x, a_pre, num), stage.attn_norm, cfg.norm_eps), p0, main_x, num)
            x = hc_post(y, x, a_post, a_comb, num)
            f_pre, f_post, f_comb = stage.mixes(x, stage.hc_ffn, num)
            y = stage.ffn(num.rmsnorm(hc_pre(x, f_pre, num), stage.ffn_norm, cfg.norm_eps), num, ids)
            x = hc_post(y, x, f_post, f_comb, num)
        last = f"mtp.{cfg.n_mtp_layers - 1}."
        xf = x.double().flatten(-2)
        mixes = (xf @ w[last + "hc_head_fn"].double().T) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + cfg.norm_eps)
        pre = torch.sigmoid(mixes * w[last + "hc_head_scale"].double() + w[last + "hc_head_base"].double()) + cfg.hc_eps
        xc = (pre.unsqueeze(-1) * x.double()).sum(-2)                            # pre-norm state
        normed = xc * torch.rsqrt(xc.square().mean(-1, keepdim=True) + cfg.norm_eps) * w[last + "norm.weight"].double()
        logits = normed @ w["head.weight"].double().T
        w1, w2 = w[last + "markov_head.markov_w1.weight"].double(), w[last + "markov_head.markov_w2.weight"].double()
        out, embs = [tok], []
        for i in range(B):
            e = w1[out[-1]]
            logits[:, i] += e @ w2.T
            embs.append(e)
            out.append(logits[:, i].argmax(-1))
        conf = (torch.cat([xc, torch.stack(embs, 1)], -1) @ w[last + "confidence_head.proj.weight"].double().T)[..., 0]
        return torch.stack(out, 1), logits, conf


def _run(m, ids, drafter_fn, trunk_logits: list | None = None):
    """Prefill PREFILL tokens, then DECODES decode steps; a draft after each call, from the trunk's own taps."""
    st = m.new_state(ids.shape[0])
    o = m.forward(ids[:, :PREFILL], st)
    drafts = [drafter_fn(o.logits[:, -1].argmax(-1), o.main_hidden, 0, st)]
    logits = [o.logits[:, -1]]
    for p in range(PREFILL, PREFILL + DECODES):
        o = m.forward(ids[:, p:p + 1], st)
        drafts.append(drafter_fn(o.logits[:, -1].argmax(-1), o.main_hidden, p, st))
        logits.append(o.logits[:, -1])
    if trunk_logits is not None:
        trunk_logits += logits
    return drafts


@pytest.fixture(scope="module")
def fp32_run(ckpts):
    m, w = _model(ckpts[1], "fp32")
    assert isinstance(m.mtp, DSparkV4)
    ids = torch.randint(0, m.cfg.vocab_size, (2, PREFILL + DECODES), generator=torch.Generator().manual_seed(5))
    trunk: list = []
    drafts = _run(m, ids, m.mtp.forward_spec, trunk)
    return m, w, ids, drafts, trunk


def _rederived_run(m, w, ids, **kw):
    r = Rederived(m, w, **kw)
    return _run(m, ids, lambda tok, taps, s, st: r.draft(tok, taps, s + taps.shape[1], st.num))


def test_taps_are_the_stream_mean_of_each_target_layers_output(fp32_run):
    m, _, ids, _, _ = fp32_run
    st = m.new_state(2)
    o = m.forward(ids[:, :PREFILL], st)
    assert torch.equal(o.main_hidden, _rederived_taps(m, ids[:, :PREFILL]))


def test_fp32_drafts_equal_the_rederivation(fp32_run):
    m, w, ids, drafts, _ = fp32_run
    ref = _rederived_run(m, w, ids)
    for k, (d, (r_ids, r_logits, r_conf)) in enumerate(zip(drafts, ref)):
        assert torch.isfinite(d.logits).all() and torch.isfinite(d.confidence).all()
        assert torch.equal(d.ids, r_ids), f"call {k}: drafts {d.ids.tolist()} vs {r_ids.tolist()}"
        scale = r_logits.abs().max()
        assert (d.logits.double() - r_logits).abs().max() <= 1e-5 * scale, f"call {k}"
        assert (d.confidence.double() - r_conf).abs().max() <= 1e-5 * (1 + r_conf.abs().max()), f"call {k}"


@pytest.mark.parametrize("variant", [{"causal": True}, {"shift": 1}], ids=["causal-block", "block-one-late"])
def test_the_rederivation_separates_a_wrong_draft_block(fp32_run, variant):
    m, w, ids, drafts, _ = fp32_run
    wrong = _rederived_run(m, w, ids, **variant)
    worst = max(float((d.logits.double() - r[1]).abs().max() / r[1].abs().max()) for d, r in zip(drafts, wrong))
    assert worst > 1e-3, f"{variant}: {worst:.2e}"


def test_taps_at_layer_inputs_are_separated(fp32_run):
    m, w, ids, drafts, _ = fp32_run
    st = m.new_state(2)
    o = m.forward(ids[:, :PREFILL], st)
    num = Numerics("fp32")
    h, pre = embed_step(m.embed, ids[:, :PREFILL], m.cfg.hc_mult)
    ctx = StepContext(0, m.new_state(2), None, input_ids=ids[:, :PREFILL])
    taps_in = []
    for L, block in enumerate(m.blocks):
        if L in m.cfg.dspark_target_layer_ids:
            taps_in.append(h.mean(dim=2))
        h, pre = block(h, pre, ctx)
    wrong = Rederived(m, w).draft(o.logits[:, -1].argmax(-1), num.r(torch.cat(taps_in, -1)), PREFILL, num)
    assert float((drafts[0].logits.double() - wrong[1]).abs().max() / wrong[1].abs().max()) > 1e-3


@pytest.mark.long  # a second model in reference-bf16 (~80 s here); the nightly runs it
def test_reference_bf16_drafts_are_finite_and_near_fp32(ckpts, fp32_run):
    """reference-bf16 runs the drafter in the reference's dtypes; no independent bf16 opinion exists here, so it
    is held to the fp32 drafter within the bf16 noise this model's trunk itself shows on the same calls (its
    last-position logits, relative max difference), and must not be bit-equal to it. Both drafters get the fp32
    trunk's seed tokens, and block position 0 is compared (later positions follow each side's own markov chain)."""
    _, _, ids, drafts32, trunk32 = fp32_run
    m, _ = _model(ckpts[1], "reference-bf16")
    trunk: list = []
    seeds = iter([d.ids[:, 0] for d in drafts32])
    drafts = _run(m, ids, lambda tok, taps, s, st: m.mtp.forward_spec(next(seeds), taps, s, st), trunk)

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max())

    draft_diff = [rel(d.logits[:, 0], d32.logits[:, 0]) for d, d32 in zip(drafts, drafts32)]
    trunk_diff = [rel(t, t32) for t, t32 in zip(trunk, trunk32)]
    for d in drafts:
        assert torch.isfinite(d.logits).all() and torch.isfinite(d.confidence).all()
    print(f"bf16 vs fp32, relative max |d logit|: drafts (block position 0) {draft_diff}, trunk {trunk_diff}")
    assert 0 < max(draft_diff) <= 4 * max(trunk_diff), (draft_diff, trunk_diff)


def test_draft_acceptance_counts_what_a_greedy_verifier_accepts(fp32_run):
    """draft_acceptance (the oracle drafter's own acceptance, the reference of the GPU spec-dec gate) against
    drafters whose proposals are known: the trunk's own greedy continuation (everything accepted), the same with
    its second token wrong (one accepted); and on the real drafter, counts inside 0..block and finite drafts."""
    from oracle.dsv41.dspark_v4 import draft_acceptance
    from oracle.dsv41.mtp import DraftOutput

    m, _, ids, _, _ = fp32_run
    prompt, n_new, B = ids[0, :8], 6, m.cfg.dspark_block_size
    st = m.new_state(1)
    o = m.forward(prompt.view(1, -1), st)
    greedy = []
    for _ in range(n_new + B):   # an independent greedy loop, long enough for every block
        tok = o.logits[:, -1].argmax(-1)
        greedy.append(int(tok))
        o = m.forward(tok.view(1, 1), st)

    class Known(DSparkV4):
        def __init__(self, cfg, wrong_at=None):
            self.cfg, self.wrong_at = cfg, wrong_at

        def forward_spec(self, tok, taps, start_pos, state):
            t = 0 if start_pos == 0 else start_pos - len(prompt) + 1
            assert int(tok) == greedy[t]
            prop = list(greedy[t + 1:t + 1 + B])
            if self.wrong_at is not None:
                prop[self.wrong_at] = (prop[self.wrong_at] + 1) % self.cfg.vocab_size
            return DraftOutput(torch.tensor([[int(tok), *prop]]), torch.zeros(1, B, self.cfg.vocab_size),
                               torch.full((1, B), 10.0))

    real = m.mtp
    try:
        m.mtp = Known(m.cfg)
        perfect = draft_acceptance(m, prompt, n_new)
        m.mtp = Known(m.cfg, wrong_at=1)
        one = draft_acceptance(m, prompt, n_new)
    finally:
        m.mtp = real
    assert perfect.accepted == (B,) * (n_new - B) and perfect.tau == B + 1 and perfect.alpha_j == (1.0,) * B
    assert one.accepted == (1,) * (n_new - B) and one.tau == 2 and one.confident == (B,) * (n_new - B)
    acc = draft_acceptance(m, prompt, n_new)
    assert len(acc.accepted) == n_new - B and all(0 <= a <= B for a in acc.accepted)
    assert acc.nonfinite_drafts == 0 and list(acc.alpha_j) == sorted(acc.alpha_j, reverse=True)
    print(f"tiny V4 drafter (random weights), prompt of {len(prompt)}, {n_new} new tokens: tau {acc.tau:.3f}, "
          f"alpha_j {acc.alpha_j}, confident {acc.confident}")


@pytest.mark.parametrize("change,match", [
    ({"dspark_target_layer_ids": [1, 4]}, "must be trunk layers 0..3"),
    ({"compress_ratios": [0, 4, 128, 4, 0, 4]}, "compress ratio 0 past the trunk"),
    ({"dspark_n_routed_experts": 8}, "the trunk's experts"),
    ({"dspark_noise_token_id": 512}, "a token id below 512"),
])
def test_bad_v4_dspark_configs_are_named_errors(ckpts, change, match):
    from oracle.dsv41.config import ConfigError, ModelConfig

    cfg = json.loads((ckpts[1] / "config.json").read_text())
    ModelConfig.from_dict(cfg)   # the written one is valid
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict({**cfg, **change})
