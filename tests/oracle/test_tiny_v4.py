"""The tiny DeepSeek-V4 checkpoint writer: official names and formats, vLLM CPU constraints, trained scale.

Expected names and shapes below are written out by hand from the V4-Flash layout (dsv4-engine.md §2, the
names vLLM 0.32's DeepSeek-V4 weight mapper and transformers' deepseek_v4 conversion start from), not taken
from the writer's own inventory. Decoding goes through oracle.dsv41.formats (own e4m3 / e2m1 / e8m0 tables),
and the mHC comb is recomputed here with an independent numpy Sinkhorn.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from safetensors import safe_open

from oracle.dsv41 import formats as F
from oracle.dsv41.tiny_v4 import TINY_V4_SCALES, tiny_v4_config, write_tiny_v4_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_v4_checkpoint(tmp_path_factory.mktemp("tiny-v4") / "ck", seed=0)


@pytest.fixture(scope="module")
def tensors(ckpt):
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    out = {}
    for fn in sorted(set(index["weight_map"].values())):
        with safe_open(str(ckpt / fn), "pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    assert set(out) == set(index["weight_map"])
    return out


def _dtype_name(t: torch.Tensor) -> str:
    return {torch.float8_e4m3fn: "F8_E4M3", torch.float8_e8m0fnu: "F8_E8M0", torch.int8: "I8",
            torch.bfloat16: "BF16", torch.float32: "F32", torch.int32: "I32"}[t.dtype]


# layer 1 of the defaults is a hash-routed CSA (ratio 4) layer; layer 2 an HCA (ratio 128) layer with biased
# routing; layer 0 window-only. d 256, 16 heads x 512, q_lora 128, 4 groups x o_lora 128, index 16 x 128
EXPECTED = {
    "embed.weight": ("BF16", [129280, 256]), "head.weight": ("BF16", [129280, 256]), "norm.weight": ("BF16", [256]),
    "hc_head_fn": ("F32", [4, 1024]), "hc_head_base": ("F32", [4]), "hc_head_scale": ("F32", [1]),
    "layers.1.hc_attn_fn": ("F32", [24, 1024]), "layers.1.hc_attn_base": ("F32", [24]),
    "layers.1.hc_attn_scale": ("F32", [3]), "layers.1.hc_ffn_fn": ("F32", [24, 1024]),
    "layers.1.attn_norm.weight": ("BF16", [256]), "layers.1.ffn_norm.weight": ("BF16", [256]),
    "layers.1.attn.wq_a.weight": ("F8_E4M3", [128, 256]), "layers.1.attn.wq_a.scale": ("F8_E8M0", [1, 2]),
    "layers.1.attn.q_norm.weight": ("BF16", [128]),
    "layers.1.attn.wq_b.weight": ("F8_E4M3", [8192, 128]), "layers.1.attn.wq_b.scale": ("F8_E8M0", [64, 1]),
    "layers.1.attn.wkv.weight": ("F8_E4M3", [512, 256]), "layers.1.attn.wkv.scale": ("F8_E8M0", [4, 2]),
    "layers.1.attn.kv_norm.weight": ("BF16", [512]),
    "layers.1.attn.wo_a.weight": ("F8_E4M3", [512, 2048]), "layers.1.attn.wo_a.scale": ("F8_E8M0", [4, 16]),
    "layers.1.attn.wo_b.weight": ("F8_E4M3", [256, 512]), "layers.1.attn.wo_b.scale": ("F8_E8M0", [2, 4]),
    "layers.1.attn.attn_sink": ("F32", [16]),
    "layers.1.attn.compressor.ape": ("F32", [4, 1024]), "layers.1.attn.compressor.wkv.weight": ("BF16", [1024, 256]),
    "layers.1.attn.compressor.wgate.weight": ("BF16", [1024, 256]),
    "layers.1.attn.compressor.norm.weight": ("BF16", [512]),
    "layers.1.attn.indexer.wq_b.weight": ("F8_E4M3", [2048, 128]),
    "layers.1.attn.indexer.wq_b.scale": ("F8_E8M0", [16, 1]),
    "layers.1.attn.indexer.weights_proj.weight": ("BF16", [16, 256]),
    "layers.1.attn.indexer.compressor.ape": ("F32", [4, 256]),
    "layers.1.attn.indexer.compressor.wkv.weight": ("BF16", [256, 256]),
    "layers.1.attn.indexer.compressor.wgate.weight": ("BF16", [256, 256]),
    "layers.1.attn.indexer.compressor.norm.weight": ("BF16", [128]),
    "layers.1.ffn.gate.weight": ("BF16", [64, 256]), "layers.1.ffn.gate.tid2eid": ("I32", [129280, 6]),
    "layers.1.ffn.experts.63.w1.weight": ("I8", [128, 128]), "layers.1.ffn.experts.63.w1.scale": ("F8_E8M0", [128, 8]),
    "layers.1.ffn.experts.0.w2.weight": ("I8", [256, 64]), "layers.1.ffn.experts.0.w2.scale": ("F8_E8M0", [256, 4]),
    "layers.1.ffn.shared_experts.w1.weight": ("F8_E4M3", [128, 256]),
    "layers.1.ffn.shared_experts.w2.weight": ("F8_E4M3", [256, 128]),
    "layers.2.attn.compressor.ape": ("F32", [128, 512]), "layers.2.attn.compressor.wkv.weight": ("BF16", [512, 256]),
    "layers.2.ffn.gate.bias": ("F32", [64]),
}
ABSENT = ["layers.0.attn.compressor.ape", "layers.0.attn.indexer.wq_b.weight", "layers.2.attn.indexer.wq_b.weight",
          "layers.2.ffn.gate.tid2eid", "layers.1.ffn.gate.bias", "layers.4.attn_norm.weight", "mtp.0.e_proj.weight"]


def test_official_names_dtypes_and_shapes(tensors):
    got = {k: (_dtype_name(v), list(v.shape)) for k, v in tensors.items() if k in EXPECTED}
    assert got == EXPECTED
    assert not [n for n in ABSENT if n in tensors]
    # every fp8 linear carries its scale and nothing else has one
    fp8 = {k[:-len(".weight")] for k, v in tensors.items() if v.dtype == torch.float8_e4m3fn}
    assert {k[:-len(".scale")] for k in tensors if k.endswith(".scale") and tensors[k].dtype == torch.float8_e8m0fnu
            and tensors[k[:-6] + ".weight"].dtype == torch.float8_e4m3fn} == fp8


def test_config_json_fields_the_engine_reads(ckpt):
    c = json.loads((ckpt / "config.json").read_text())
    assert c["model_type"] == "deepseek_v4" and c["architectures"] == ["DeepseekV4ForCausalLM"]
    assert c["quantization_config"]["weight_block_size"] == [128, 128]
    assert c["quantization_config"]["scale_fmt"] == "ue8m0" and c["expert_dtype"] == "fp4"
    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "qk_rope_head_dim", "q_lora_rank",
              "o_groups", "o_lora_rank", "sliding_window", "compress_ratios", "compress_rope_theta", "rope_theta",
              "rope_scaling", "max_position_embeddings", "index_n_heads", "index_head_dim", "index_topk", "hc_mult",
              "hc_sinkhorn_iters", "hc_eps", "rms_norm_eps", "n_routed_experts", "num_experts_per_tok",
              "n_shared_experts", "moe_intermediate_size", "num_hash_layers", "norm_topk_prob", "swiglu_limit",
              "hidden_act", "vocab_size", "scoring_func", "topk_method", "routed_scaling_factor"):
        assert k in c, k
    assert set(c["compress_ratios"]) <= {0, 4, 128} and c["head_dim"] == 512 and c["index_topk"] == 512
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    assert max(a["id"] for a in tok["added_tokens"]) + 1 == c["vocab_size"] == 129280


def _fp8(t, p):
    return F.fp8_dequant(t[p + ".weight"], t[p + ".scale"], (128, 128))


def test_fp8_linears_are_ue8m0_blocks_at_trained_std(tensors):
    for p, gain in (("layers.1.attn.wq_a", 1.6), ("layers.1.attn.wo_b", 1.9), ("layers.3.ffn.shared_experts.w2", 1.05)):
        w = _fp8(tensors, p)
        want = gain / math.sqrt(w.shape[1])
        assert abs(w.std().item() / want - 1) < 0.08, p
        # each 128x128 block uses its power-of-two scale fully: block amax in [224, 448] x scale (e4m3 rounding can land on 224)
        s = F.e8m0_to_f32(tensors[p + ".scale"])
        blocks = w.view(s.shape[0], 128, s.shape[1], 128).abs().amax(dim=(1, 3))
        ratio = blocks / s
        assert ((ratio >= 224) & (ratio <= 448)).all(), p


def test_mxfp4_experts_at_trained_std(tensors):
    for p, gain in (("layers.0.ffn.experts.5.w1", 1.5), ("layers.2.ffn.experts.40.w2", 1.05)):
        w = F.mxfp4_dequant(tensors[p + ".weight"], tensors[p + ".scale"])
        want = gain / math.sqrt(w.shape[1])
        # the +-1 exponent jitter widens the spread (E[4^j] over j in {-1,0,1} = 1.42 -> std x1.19) and
        # round(log2) can land up to a factor sqrt(2) away: a band, not an equality
        assert 0.6 < w.std().item() / want < 2.0, p


def test_hash_table_routes_each_token_to_distinct_experts(tensors):
    t = tensors["layers.0.ffn.gate.tid2eid"].long()
    assert t.min() >= 0 and t.max() < 64
    srt = t.sort(dim=1).values
    assert (srt[:, 1:] != srt[:, :-1]).all()  # 6 distinct experts per token
    load = torch.bincount(t.flatten(), minlength=64).float()
    assert load.max() / load.mean() < 1.05  # balanced
    assert not torch.equal(t, tensors["layers.1.ffn.gate.tid2eid"].long())  # one table per layer


def _sinkhorn_comb(x_streams: np.ndarray, fn: np.ndarray, base: np.ndarray, scale: np.ndarray, iters: int = 20,
                   eps: float = 1e-6) -> np.ndarray:
    """mHC comb for [T, hc, d] streams (standard mHC: RMS-normalised flat streams -> fn -> softmax + Sinkhorn)."""
    T, hc, d = x_streams.shape
    flat = x_streams.reshape(T, hc * d).astype(np.float64)
    flat = flat / np.sqrt((flat**2).mean(-1, keepdims=True) + eps)
    mix = flat @ fn.T.astype(np.float64)
    logits = mix[:, 2 * hc:].reshape(T, hc, hc) * scale[2] + base[2 * hc:].reshape(hc, hc)
    c = np.exp(logits - logits.max(-1, keepdims=True))
    c = c / c.sum(-1, keepdims=True) + eps
    c = c / (c.sum(-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdims=True) + eps)
        c = c / (c.sum(-2, keepdims=True) + eps)
    return c


def test_mhc_comb_is_clearly_non_uniform_and_asymmetric(tensors):
    ids = torch.tensor([0, 100, 2000, 15000, 90000, 129279])
    emb = tensors["embed.weight"][ids].float().numpy()
    streams = np.repeat(emb[:, None, :], 4, axis=1)  # the first layer sees the embedding in all 4 streams
    for L in (0, 3):
        c = _sinkhorn_comb(streams, tensors[f"layers.{L}.hc_attn_fn"].numpy(), tensors[f"layers.{L}.hc_attn_base"].numpy(),
                           tensors[f"layers.{L}.hc_attn_scale"].numpy())
        assert np.allclose(c.sum(-1), 1, atol=1e-3) and np.allclose(c.sum(-2), 1, atol=1e-3)
        assert np.abs(c - 0.25).max(axis=(1, 2)).min() > 0.15  # not ~uniform at any token
        asym = np.abs(c - c.transpose(0, 2, 1)).max(axis=(1, 2))
        assert asym.min() > 0.05 and asym.mean() > 0.15  # a transposed comb is visible


def test_logits_have_a_trained_like_spread(tensors):
    """Final-norm outputs have unit RMS; with the head at trained-like gain the next-token distribution is
    peaked (entropy a few nats), where a unit-gain head gives a near-uniform ~11 nats."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(8, 256, generator=g) * tensors["norm.weight"].float()
    head = tensors["head.weight"].float()

    def entropy(logits):
        lp = logits.log_softmax(-1)
        return -(lp.exp() * lp).sum(-1)

    ent = entropy(h @ head.T)
    assert ((ent > 1.0) & (ent < 7.5)).all() and 2.5 < ent.mean() < 6.0, ent
    unit_gain = entropy(h @ (head / TINY_V4_SCALES.head_gain).T)
    assert (unit_gain > 10.5).all()  # the property separates the two inits


def test_values_depend_only_on_seed_and_name(tmp_path, tensors):
    small = write_tiny_v4_checkpoint(tmp_path / "o", seed=0, overrides={"num_hash_layers": 1}, expert_dtype="fp8")
    with safe_open(str(small / "model-00001.safetensors"), "pt") as f:
        keys = set(f.keys())
        k = "layers.1.attn.wq_a.weight"
        if k in keys:
            assert torch.equal(f.get_tensor(k).view(torch.uint8), tensors[k].view(torch.uint8))
    idx = json.loads((small / "model.safetensors.index.json").read_text())["weight_map"]
    assert "layers.1.ffn.gate.bias" in idx and "layers.1.ffn.gate.tid2eid" not in idx
    assert "layers.2.ffn.experts.0.w1.scale" in idx
    cfg = json.loads((small / "config.json").read_text())
    assert cfg["expert_dtype"] == "fp8" and cfg["num_hash_layers"] == 1


@pytest.mark.parametrize("overrides, field", [
    ({"compress_ratios": [0, 2, 128, 4]}, "compress_ratios[1]"),
    ({"head_dim": 256}, "head_dim"),
    ({"n_routed_experts": 32}, "n_routed_experts"),
    ({"index_topk": 256}, "index_topk"),
    ({"hidden_size": 192}, "hidden_size"),
    ({"num_hidden_layres": 3}, "num_hidden_layres"),
])
def test_bad_config_is_refused_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        tiny_v4_config(overrides)


def test_refuses_a_non_empty_folder(tmp_path):
    (tmp_path / "x").write_text("")
    with pytest.raises(FileExistsError):
        write_tiny_v4_checkpoint(tmp_path)


def test_unquantized_form_is_the_same_model_in_bf16(tmp_path, tensors):
    """quantized=False stores exactly the decoded fp8 / MXFP4 values in bf16 (same model, no scales)."""
    bf = write_tiny_v4_checkpoint(tmp_path / "bf", seed=0, quantized=False,
                                  overrides={"num_hidden_layers": 2, "compress_ratios": [0, 4]})
    idx = json.loads((bf / "model.safetensors.index.json").read_text())["weight_map"]
    assert not [k for k in idx if k.endswith(".scale")]
    cfg = json.loads((bf / "config.json").read_text())
    assert "quantization_config" not in cfg and "expert_dtype" not in cfg

    def get(k):
        with safe_open(str(bf / idx[k]), "pt") as f:
            return f.get_tensor(k)

    for p in ("layers.1.attn.wq_b", "layers.1.attn.indexer.wq_b", "layers.0.ffn.shared_experts.w2"):
        w = get(p + ".weight")
        assert w.dtype == torch.bfloat16 and torch.equal(w.float(), _fp8(tensors, p)), p
    p = "layers.1.ffn.experts.7.w2"
    assert torch.equal(get(p + ".weight").float(), F.mxfp4_dequant(tensors[p + ".weight"], tensors[p + ".scale"]))
    assert torch.equal(get("layers.1.ffn.gate.tid2eid"), tensors["layers.1.ffn.gate.tid2eid"])


def test_activations_stay_order_one_through_the_stack(ckpt, tensors):
    """A plain fp32 forward of 3 real tokens (tiny_v4_scale_probe: scale only, not a reference): residual
    streams and sublayer outputs stay O(1), no block swamps the stream, and the logits are peaked."""
    from tests.oracle.tiny_v4_scale_probe import forward

    c = json.loads((ckpt / "config.json").read_text())
    ids = torch.tensor([0, 671, 6102])
    logits, stats = forward(tensors, c, ids)
    streams = [s for _, _, s in stats]
    assert all(0.1 < s < 5.0 for s in streams), stats
    assert streams[-1] / streams[0] < 5.0, stats  # grows gently, no blow-up over the layers
    assert all(b / s < 2.0 for (_, b, s) in stats), stats  # each update is at most ~the stream's size
    assert all(0.01 < b for (_, b, _) in stats), stats  # and every sublayer contributes
    lp = logits.log_softmax(-1)
    ent = -(lp.exp() * lp).sum(-1)
    assert torch.isfinite(logits).all() and ((ent > 1.0) & (ent < 7.5)).all(), ent
    assert (logits.std(-1) > 2.0).all() and (logits.std(-1) < 8.0).all()
