"""The DeepSeek-V4 mode's modules against independent computations: explicit loops in float64 numpy, scipy's
Hadamard matrix, and worked examples by hand (dsv4-engine.md §5 gives the rules each test follows)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import scipy.linalg
import torch

import oracle
from oracle.dsv41.arch import V4, V41, arch_of, expected_inventory
from oracle.dsv41.block import Block
from oracle.dsv41.block_v4 import BlockV4
from oracle.dsv41.attention import window_indices
from oracle.dsv41.attention_v4 import compressed_indices_v4, head_rmsnorm
from oracle.dsv41.inventory import inventory_v4, inventory_v41
from oracle.dsv41.compressor_v4 import CompressorV4, qdq8_nope, rotate_activation
from oracle.dsv41.config import ConfigError, ModelConfig
from oracle.dsv41.head import Head, HyperHead
from oracle.dsv41.moe_v4 import route_v4
from oracle.dsv41.numerics import Numerics
from oracle.dsv41.quant import act_quant_dequant
from oracle.dsv41.rope import layer_frequencies

from .dsv4_random_weights import small_v4_config

FP32 = Numerics("fp32")


def _compressor(cfg, layer, seed=0):
    g = torch.Generator().manual_seed(seed)
    comp = CompressorV4(cfg, layer, cfg.head_dim, layer_frequencies(cfg, layer))
    c, r, d = comp.coff, comp.ratio, cfg.head_dim
    comp.load({"ape": torch.randn(r, c * d, generator=g), "wkv.weight": torch.randn(c * d, cfg.dim, generator=g) * 0.1,
               "wgate.weight": torch.randn(c * d, cfg.dim, generator=g) * 0.1,
               "norm.weight": 1 + 0.1 * torch.randn(d, generator=g)}, "")
    return comp


def _explicit_pool(comp, x: np.ndarray) -> np.ndarray:
    """Entry j, channel c: softmax over its slots of (score + ape[slot]) times kv, in float64 loops. Ratio 4:
    the slots are group j-1's tokens on channel c (none for j = 0) and group j's on channel d + c."""
    r, d = comp.ratio, comp.d
    kv = x @ comp.wkv.double().numpy().T
    sc = x @ comp.wgate.double().numpy().T
    ape = comp.ape.double().numpy()
    out = np.zeros((x.shape[0] // r, d))
    for j in range(x.shape[0] // r):
        for c in range(d):
            slots = []
            if comp.overlap:
                if j > 0:
                    slots += [(kv[t, c], sc[t, c] + ape[t % r, c]) for t in range((j - 1) * r, j * r)]
                slots += [(kv[t, d + c], sc[t, d + c] + ape[t % r, d + c]) for t in range(j * r, (j + 1) * r)]
            else:
                slots += [(kv[t, c], sc[t, c] + ape[t % r, c]) for t in range(j * r, (j + 1) * r)]
            v, z = np.array(slots).T
            p = np.exp(z - z.max())
            out[j, c] = (v * p).sum() / p.sum()
    return out


@pytest.mark.parametrize("layer,n", [(0, 11), (1, 19)])  # ratio 4 (overlap), ratio 8 (plain pooling)
def test_compressor_pooling_matches_an_explicit_loop(layer, n):
    cfg = small_v4_config()
    comp = _compressor(cfg, layer)
    x = torch.randn(1, n, cfg.dim, generator=torch.Generator().manual_seed(5))
    got = comp.pool(x, 0, {}, FP32)[0].double().numpy()
    want = _explicit_pool(comp, x[0].double().numpy())
    assert got.shape == want.shape == (n // comp.ratio, cfg.head_dim)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-7)


@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("n_prefill", [1, 6, 9])
def test_compressor_decode_state_gives_the_prefill_entries_bit_for_bit(layer, n_prefill):
    """The decode state (open group, and with overlap the previous group's Ca half) reproduces the entries a
    one-pass prefill computes, whatever the prefill length (remainders 1, 2, 1 for ratio 4)."""
    cfg = small_v4_config()
    comp = _compressor(cfg, layer, seed=1)
    x = torch.randn(1, 33, cfg.dim, generator=torch.Generator().manual_seed(6))
    full = comp(x, 0, {}, FP32)
    state: dict = {}
    rows = [comp(x[:, :n_prefill], 0, state, FP32)]
    rows += [comp(x[:, p:p + 1], p, state, FP32) for p in range(n_prefill, 33)]
    inc = torch.cat([r for r in rows if r is not None], dim=1)
    assert inc.shape == full.shape == (1, 33 // comp.ratio, cfg.head_dim)
    assert torch.equal(inc, full)


def test_compressor_finish_is_norm_rope_at_the_group_start_then_qdq8_of_the_nope_dims():
    cfg = small_v4_config()
    comp = _compressor(cfg, 0)
    pooled = torch.randn(1, 2, cfg.head_dim, generator=torch.Generator().manual_seed(2))
    got = comp.finish(pooled, torch.tensor([0, 4]), FP32)[0].double().numpy()
    p = pooled[0].double().numpy()
    y = p / np.sqrt((p ** 2).mean(-1, keepdims=True) + cfg.norm_eps) * comp.norm.double().numpy()
    rd = cfg.rope_head_dim
    f = comp.freqs.double().numpy()
    for j, pos in enumerate((0, 4)):  # interleaved pairs of the last rd channels, angle pos * f_i
        a, b = y[j, -rd::2].copy(), y[j, -rd + 1::2].copy()
        cos, sin = np.cos(pos * f), np.sin(pos * f)
        y[j, -rd::2], y[j, -rd + 1::2] = a * cos - b * sin, a * sin + b * cos
    np.testing.assert_allclose(got[:, -rd:], y[:, -rd:], rtol=1e-5, atol=1e-6)  # rope dims unquantised
    nope = torch.from_numpy(y[:, :-rd]).float()
    want = torch.cat([act_quant_dequant(nope[:, k:k + 64], 64, "ue8m0") for k in range(0, nope.shape[1], 64)], 1)
    assert torch.equal(torch.from_numpy(got[:, :-rd]).float(), want)


def test_qdq8_nope_quantises_each_64_block_to_e4m3_with_a_power_of_two_scale():
    x = torch.zeros(64 + 16)
    x[0], x[1], x[2] = 3.0, 0.1, -1.3
    x[64:] = 0.123456  # the rope tail
    y = qdq8_nope(x.unsqueeze(0), 16)[0]
    # amax 3 -> scale 2^ceil(log2(3/448)) = 2^-7; 0.1 * 128 = 12.8 -> e4m3 13 (step 1 in [8, 16)); -1.3 * 128 = -166.4
    # -> -160 (step 16 in [128, 256): 166.4 is nearer 160 than 176)
    assert y[0].item() == 3.0 and y[1].item() == 13 / 128 and y[2].item() == -160 / 128
    assert torch.equal(y[64:], x[64:])


def test_window_and_compressed_index_lists_worked_examples():
    v4_order = {"empty_slots_first": False}
    assert window_indices(0, 5, 3, **v4_order).tolist() == [[0, -1, -1], [0, 1, -1], [0, 1, 2], [1, 2, 3], [2, 3, 4]]
    assert window_indices(1, 1, 3, **v4_order).tolist() == [[0, 1, -1]]  # ring not full: filled slots, then -1
    assert window_indices(5, 1, 3, **v4_order).tolist() == [[3, 4, 5]]  # oldest first
    # ratio 4, 9 tokens, compressed rows at offset 100: entry j visible once (t + 1) // 4 > j
    want = [[-1, -1]] * 3 + [[100, -1]] * 4 + [[100, 101]] * 2
    assert compressed_indices_v4(4, 0, 9, 100).tolist() == want
    assert compressed_indices_v4(4, 11, 1, 12).tolist() == [[12, 13, 14]]


def test_hash_layers_route_by_tid2eid_and_others_by_biased_top_k():
    cfg = small_v4_config(n_routed_experts=8, n_activated_experts=2)
    g = torch.Generator().manual_seed(3)
    x, wg = torch.randn(5, cfg.dim, generator=g), torch.randn(8, cfg.dim, generator=g) * 0.1
    ids = torch.tensor([3, 0, 3, 7, 1])
    tid2eid = torch.randint(0, 8, (cfg.vocab_size, 2), generator=g)
    s = np.sqrt(np.log1p(np.exp(x.double().numpy() @ wg.double().numpy().T)))  # sqrt(softplus)
    wts, idx = route_v4(x, wg, None, tid2eid, ids, 2, cfg, FP32)
    assert torch.equal(idx, tid2eid[ids])
    want = np.take_along_axis(s, idx.numpy(), 1)
    np.testing.assert_allclose(wts.numpy(), want / want.sum(1, keepdims=True) * cfg.route_scale, rtol=1e-6)
    bias = torch.zeros(8)
    bias[6] = 100.0  # the bias picks expert 6 everywhere but does not weight it
    wts, idx = route_v4(x, wg, bias, None, None, 2, cfg, FP32)
    assert (idx == 6).any(1).all()
    second = [int(np.argsort(-row)[0 if np.argsort(-row)[0] != 6 else 1]) for row in s]
    assert [set(r) for r in idx.tolist()] == [{6, e} for e in second]
    want = np.take_along_axis(s, idx.numpy(), 1)
    np.testing.assert_allclose(wts.numpy(), want / want.sum(1, keepdims=True) * cfg.route_scale, rtol=1e-6)
    with pytest.raises(ValueError, match="token id"):
        route_v4(x, wg, None, tid2eid, None, 2, cfg, FP32)


def test_hyper_head_collapses_the_streams_with_its_own_weights():
    cfg = small_v4_config()
    g = torch.Generator().manual_seed(4)
    hc, d = cfg.hc_mult, cfg.dim
    w = {"norm.weight": torch.ones(d), "head.weight": torch.randn(cfg.vocab_size, d, generator=g),
         "hc_head_fn": torch.randn(hc, hc * d, generator=g) * 0.05, "hc_head_base": torch.randn(hc, generator=g),
         "hc_head_scale": torch.tensor([1.5])}
    head = HyperHead(cfg).load(w)
    h = torch.randn(1, 3, hc, d, generator=g)
    got = head.collapse(h, FP32)[0].double().numpy()
    x = h[0].double().numpy().reshape(3, hc * d)
    rstd = 1 / np.sqrt((x ** 2).mean(-1, keepdims=True) + cfg.norm_eps)
    mixes = x @ w["hc_head_fn"].double().numpy().T * rstd
    pre = 1 / (1 + np.exp(-(mixes * 1.5 + w["hc_head_base"].double().numpy()))) + cfg.hc_eps
    want = (pre[:, :, None] * h[0].double().numpy()).sum(1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_hadamard_rotation_is_sylvester_scaled_by_inverse_sqrt_d():
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(7))
    want = x.double().numpy() @ scipy.linalg.hadamard(32) / math.sqrt(32)
    np.testing.assert_allclose(rotate_activation(x, FP32).double().numpy(), want, rtol=1e-6, atol=1e-7)
    bf = rotate_activation(x, Numerics("reference-bf16"))
    assert torch.equal(bf, bf.to(torch.bfloat16).float())  # stored as bf16
    ref = torch.from_numpy(x.to(torch.bfloat16).double().numpy() @ scipy.linalg.hadamard(32) / math.sqrt(32))
    assert (bf.double() - ref).abs().max() <= ref.abs().max() * 2 ** -8  # within a bf16 rounding
    e0 = torch.zeros(1, 32)
    e0[0, 5] = 1.0  # a unit vector maps to row 5 of H, scaled
    assert torch.allclose(rotate_activation(e0, FP32)[0], torch.from_numpy(scipy.linalg.hadamard(32)[5] / math.sqrt(32)).float())


def test_per_head_q_norm_is_weight_free():
    q = torch.randn(1, 2, 4, 80, generator=torch.Generator().manual_seed(8)) * 3
    got = head_rmsnorm(q, 1e-6, FP32).double().numpy()
    a = q.double().numpy()
    np.testing.assert_allclose(got, a / np.sqrt((a ** 2).mean(-1, keepdims=True) + 1e-6), rtol=1e-6)


# ---- config: the V4 mode is chosen by the checkpoint's config -------------------------------------------

def _hf_v4(**kw):
    d = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "hidden_size": 256,
         "num_hidden_layers": 4, "compress_ratios": [0, 4, 128, 4], "num_hash_layers": 2,
         "num_nextn_predict_layers": 0, "num_attention_heads": 16, "head_dim": 512, "qk_rope_head_dim": 64,
         "q_lora_rank": 128, "o_groups": 4, "o_lora_rank": 128, "sliding_window": 128, "index_n_heads": 16,
         "n_routed_experts": 64, "num_experts_per_tok": 6, "moe_intermediate_size": 128, "rms_norm_eps": 1e-6,
         "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "vocab_size": 1000,
         "rope_scaling": {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                          "beta_fast": 32, "beta_slow": 1},
         "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}}
    d.update(kw)
    return d


def test_a_v4_config_maps_its_keys_and_takes_the_v4_defaults():
    cfg = ModelConfig.from_dict(_hf_v4())
    assert cfg.arch == "v4" and arch_of(cfg) is V4
    assert (cfg.dim, cfg.n_layers, cfg.n_mtp_layers, cfg.n_hash_layers) == (256, 4, 0, 2)
    assert cfg.compress_ratios == (0, 4, 128, 4) and cfg.norm_eps == 1e-6 and cfg.scale_fmt == "ue8m0"
    assert cfg.engram_layer_ids == () and cfg.dspark_block_size == 0 and cfg.vision_n_layers == 0
    assert (cfg.rope_factor, cfg.original_seq_len, cfg.window_size) == (16.0, 65536, 128)
    assert [cfg.is_hash_layer(L) for L in range(4)] == [True, True, False, False]
    assert ModelConfig.from_dict({k: v for k, v in _hf_v4().items() if k not in ("architectures", "model_type")}).arch == "v4"
    assert arch_of(ModelConfig.tiny()) is V41  # V4.1 stays V4.1


def test_the_arch_is_chosen_once_from_the_config_and_names_what_differs():
    v4, v41 = arch_of(small_v4_config()), arch_of(ModelConfig.tiny())
    assert (v4.block, v4.head, v4.inventory) == (BlockV4, HyperHead, inventory_v4)
    assert (v41.block, v41.head, v41.inventory) == (Block, Head, inventory_v41)
    assert set(v4.head_tensors) - set(v41.head_tensors) == {"hc_head_fn", "hc_head_base", "hc_head_scale"}
    # what the head stage reads is exactly the inventory's top-level tensors that are not the embedding
    for arch, cfg in ((v4, small_v4_config()), (v41, ModelConfig.tiny())):
        inv = arch.inventory(cfg)
        top = {n for n in inv.tensors if "." not in n.removesuffix(".weight")} | {f"{p}.weight" for p in inv.linears
                                                                                   if "." not in p}
        assert top - {"embed.weight"} == set(arch.head_tensors), arch.name
        assert expected_inventory(cfg) == inv


def test_no_branch_on_the_architecture_outside_the_arch_module():
    """The oracle asks arch_of(cfg) for what differs; `is_v4` (the old branch flag) is gone everywhere."""
    root = Path(oracle.__file__).parent
    hits = [f"{p.relative_to(root)}:{n}" for p in sorted(root.rglob("*.py")) if p.name != "arch.py"
            for n, line in enumerate(p.read_text().splitlines(), 1) if "is_v4" in line]
    assert hits == []


@pytest.mark.parametrize("change,match", [
    ({"norm_topk_prob": False}, "always divides"),
    ({"compress_ratios": [0, 4, 128, 4], "num_nextn_predict_layers": 1}, "one more"),
    ({"arch": "v4.1"}, "marks a DeepSeek-V4"),
    ({"q_lora_rank": 96}, "multiple of 128"),
    ({"num_hash_layers": 9}, "num_hash_layers 9"),
    ({"hidden_sizee": 3}, "unknown key"),
])
def test_bad_v4_configs_are_named_errors(change, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict(_hf_v4(**change))


def test_release_size_inventory_has_the_v4_flash_shapes():
    """V4-Flash sizes (dsv4-engine.md §5: dim 4096, 43 layers, q_lora 1024, 256 experts, moe_inter 2048,
    64 index heads x 128) give the shapes public V4-Flash ports read from the release headers (e.g. the CSA
    layer 2: indexer.compressor.wkv [256, 4096], ape [4, 256], indexer.wq_b [8192, 1024])."""
    ratios = [0, 0] + [4, 128] * 20 + [4, 0]  # 43 layers + 1 MTP layer, CSA/HCA alternating
    cfg = ModelConfig.from_dict(_hf_v4(hidden_size=4096, num_hidden_layers=43, q_lora_rank=1024,
                                       o_groups=8, o_lora_rank=1024, num_attention_heads=64, index_n_heads=64,
                                       n_routed_experts=256, moe_intermediate_size=2048, num_hash_layers=3,
                                       num_nextn_predict_layers=1, compress_ratios=ratios, vocab_size=129280))
    inv = inventory_v4(cfg)
    lin, ten = inv.linears, inv.tensors
    assert (lin["layers.2.attn.indexer.compressor.wkv"].out, lin["layers.2.attn.indexer.compressor.wkv"].in_) == (256, 4096)
    assert ten["layers.2.attn.indexer.compressor.ape"].shape == (4, 256)
    assert ten["layers.2.attn.compressor.ape"].shape == (4, 1024)
    assert ten["layers.3.attn.compressor.ape"].shape == (128, 512)
    assert "layers.3.attn.indexer.wq_b" not in lin and "layers.0.attn.compressor.wkv" not in lin
    assert (lin["layers.2.attn.indexer.wq_b"].out, lin["layers.2.attn.indexer.wq_b"].in_) == (8192, 1024)
    assert ten["layers.2.ffn.gate.tid2eid"].shape == (129280, 6) and "layers.3.ffn.gate.tid2eid" not in ten
    assert "layers.3.ffn.gate.bias" in ten and "layers.2.ffn.gate.bias" not in ten
    assert (lin["layers.5.attn.wo_a"].out, lin["layers.5.attn.wo_a"].in_) == (8192, 4096)
    assert ten["hc_head_fn"].shape == (4, 16384) and ten["mtp.0.hc_head_scale"].shape == (1,)
    assert {"mtp.0.e_proj", "mtp.0.h_proj"} <= lin.keys() and lin["layers.42.ffn.experts.255.w2"].storage == "fp4"
