"""oracle/hf_dsv4.py: an official-layout DeepSeek-V4 folder in transformers' DeepseekV4ForCausalLM (fp32).

The config and name tables are checked against hand-written expectations taken from the release layout
(dsv4-engine.md §2, §5) and transformers' module tree, not against the mapping's own output; the decoded weights
against torch's own float8 conversion and a hand-written e2m1 table (formats.py uses neither).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from oracle.hf_dsv4 import (V4MappingError, hf_config_from_official, hf_config_kwargs, hf_tensor_name,
                            is_official_v4, load_official_v4, official_schedule)

# A V4-Flash style config.json for a 4-layer model (field names and values of the release, sizes tiny),
# with a fifth compress_ratios entry for the MTP layer as the release ships it.
OFFICIAL = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "torch_dtype": "bfloat16",
    "vocab_size": 1024, "hidden_size": 256, "num_hidden_layers": 4, "compress_ratios": [0, 4, 128, 4, 0],
    "num_hash_layers": 2, "num_attention_heads": 16, "num_key_value_heads": 1, "head_dim": 512,
    "qk_rope_head_dim": 64, "q_lora_rank": 128, "o_groups": 4, "o_lora_rank": 128, "sliding_window": 128,
    "index_n_heads": 16, "index_head_dim": 128, "index_topk": 512, "n_routed_experts": 64,
    "num_experts_per_tok": 6, "n_shared_experts": 1, "moe_intermediate_size": 128, "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True, "swiglu_limit": 10.0,
    "hidden_act": "silu", "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1048576, "bos_token_id": 0, "eos_token_id": 1, "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False, "expert_dtype": "fp4",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                            "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
}


def test_config_maps_the_layer_schedule_onto_layer_types_and_mlp_layer_types():
    cfg = hf_config_from_official(OFFICIAL)
    assert cfg.layer_types == ["sliding_attention", "compressed_sparse_attention",
                               "heavily_compressed_attention", "compressed_sparse_attention"]
    assert cfg.mlp_layer_types == ["hash_moe", "hash_moe", "moe", "moe"]
    assert cfg.compress_rates == {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    assert cfg.qk_rope_head_dim == 64 and cfg.partial_rotary_factor == 64 / 512
    # window-only layers: plain RoPE at rope_theta; compressed layers: YaRN at compress_rope_theta, no mscale
    assert cfg.rope_parameters["main"] == {"rope_type": "default", "rope_theta": 10000.0,
                                           "partial_rotary_factor": 0.125}
    c = cfg.rope_parameters["compress"]
    assert (c["rope_type"], c["rope_theta"], c["factor"], c["original_max_position_embeddings"],
            c["beta_fast"], c["beta_slow"], c["attention_factor"]) == ("yarn", 160000.0, 16.0, 65536, 32, 1, 1.0)
    for k in ("hidden_size", "num_attention_heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank",
              "index_n_heads", "index_topk", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
              "routed_scaling_factor", "scoring_func", "swiglu_limit", "hc_mult", "hc_sinkhorn_iters", "hc_eps",
              "rms_norm_eps", "sliding_window", "vocab_size"):
        assert getattr(cfg, k) == OFFICIAL[k], k
    assert official_schedule(cfg) == {"compress_ratios": [0, 4, 128, 4], "num_hash_layers": 2}


@pytest.mark.parametrize("change,message", [
    ({"engram_layers": [1]}, "['engram_layers'] have no mapping"),
    ({"n_shared_experts": 2}, "n_shared_experts = 2"),
    ({"norm_topk_prob": False}, "norm_topk_prob = False"),
    ({"compress_ratios": [0, 2, 128, 4]}, "compress_ratios[1] = 2"),
    ({"compress_ratios": [0, 4]}, "compress_ratios has 2 entries for 4 layers"),
    ({"num_hash_layers": 5}, "num_hash_layers 5 outside 0..4"),
    ({"num_key_value_heads": 8}, "num_key_value_heads = 8"),
    ({"rope_scaling": {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                       "mscale": 0.707, "mscale_all_dim": 0.707}}, "mscale"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "only YaRN"),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}}, "'fmt': 'e5m2'"),
])
def test_config_fields_transformers_cannot_honour_are_refused_by_name(change, message):
    with pytest.raises(V4MappingError, match="config.json") as e:
        hf_config_kwargs({**OFFICIAL, **change})
    assert message in str(e.value)


def test_release_tensor_names_map_onto_transformers_modules():
    expected = {  # official name -> (transformers key, expert, part)
        "embed": ("model.embed_tokens.weight", None, None),
        "head": ("lm_head.weight", None, None),
        "norm.weight": ("model.norm.weight", None, None),
        "hc_head_fn": ("model.hc_head.hc_fn", None, None),
        "layers.3.attn_norm.weight": ("model.layers.3.input_layernorm.weight", None, None),
        "layers.3.hc_ffn_base": ("model.layers.3.ffn_hc.base", None, None),
        "layers.1.attn.attn_sink": ("model.layers.1.self_attn.sinks", None, None),
        "layers.1.attn.wq_b": ("model.layers.1.self_attn.q_b_proj.weight", None, None),
        "layers.1.attn.compressor.ape": ("model.layers.1.self_attn.compressor.position_bias", None, None),
        "layers.1.attn.indexer.compressor.norm.weight":
            ("model.layers.1.self_attn.compressor.indexer.kv_norm.weight", None, None),
        "layers.1.attn.indexer.weights_proj":
            ("model.layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight", None, None),
        "layers.0.ffn.gate.tid2eid": ("model.layers.0.mlp.gate.tid2eid", None, None),
        "layers.2.ffn.gate.bias": ("model.layers.2.mlp.gate.e_score_correction_bias", None, None),
        "layers.2.ffn.experts.17.w1": ("model.layers.2.mlp.experts.gate_up_proj", 17, "gate"),
        "layers.2.ffn.experts.17.w3": ("model.layers.2.mlp.experts.gate_up_proj", 17, "up"),
        "layers.2.ffn.experts.17.w2": ("model.layers.2.mlp.experts.down_proj", 17, "down"),
        "layers.2.ffn.shared_experts.w3": ("model.layers.2.mlp.shared_experts.up_proj.weight", None, None),
    }
    for name, want in expected.items():
        s = hf_tensor_name(name)
        assert (s.key, s.expert, s.part) == want, name
    assert hf_tensor_name("mtp.0.e_proj") is None  # transformers builds no MTP layer: skipped, counted
    with pytest.raises(V4MappingError, match="'layers.0.attn.wk'"):
        hf_tensor_name("layers.0.attn.wk")  # a V4.1 index-key name: no place in V4


# ------------------------------------------------------------------------------------------- a real checkpoint
@pytest.fixture(scope="module")
def small_v4(tmp_path_factory) -> Path:
    """The tiny V4 writer's checkpoint with a 1,024-entry vocabulary (all other sizes as served by vLLM CPU)."""
    from oracle.dsv41.tiny_v4 import write_tiny_v4_checkpoint

    return write_tiny_v4_checkpoint(tmp_path_factory.mktemp("v4") / "ck", seed=0, overrides={"vocab_size": 1024})


@pytest.fixture(scope="module")
def loaded(small_v4):
    return load_official_v4(small_v4, threads=1)


def _tensor(folder: Path, name: str) -> torch.Tensor:
    from safetensors import safe_open

    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            if name in h.keys():
                return h.get_tensor(name)
    raise KeyError(name)


def test_every_model_entry_is_loaded_once_and_every_tensor_is_consumed(small_v4, loaded):
    model, cfg, report = loaded
    assert is_official_v4(small_v4)
    n_state = len(model.state_dict())
    assert report.expected_entries == report.loaded_entries == n_state
    assert report.consumed_tensors == report.checkpoint_tensors and not report.skipped_not_built
    # 4 layers x 64 experts x (w1, w2, w3) MXFP4; 34 FP8 dense linears; the rest BF16
    assert report.formats["mxfp4"] == 4 * 64 * 3 and report.formats["fp8"] == 34
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert [type(layer.mlp.gate).__name__ for layer in model.model.layers] == \
        ["DeepseekV4HashRouter", "DeepseekV4HashRouter", "DeepseekV4TopKRouter", "DeepseekV4TopKRouter"]


def test_fp8_and_mxfp4_weights_decode_exactly(small_v4, loaded):
    model = loaded[0]
    # FP8 e4m3 with a 128x128 UE8M0 scale, decoded here with torch's own float8 types
    w = _tensor(small_v4, "layers.1.attn.wq_b.weight").float()
    s = _tensor(small_v4, "layers.1.attn.wq_b.scale").float()
    want = w * s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
    assert torch.equal(model.model.layers[1].self_attn.q_b_proj.weight, want)
    # MXFP4: low nibble first, one power-of-two scale per 32 inputs; e2m1 values written out by hand
    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    for part, rows in (("w1", slice(0, 128)), ("w3", slice(128, 256))):
        packed = _tensor(small_v4, f"layers.2.ffn.experts.5.{part}.weight").view(torch.uint8).numpy()
        exps = _tensor(small_v4, f"layers.2.ffn.experts.5.{part}.scale").view(torch.uint8).numpy().astype(int)
        codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
        dec = np.asarray(e2m1, dtype=np.float32)[codes] * np.exp2(np.repeat(exps - 127, 32, axis=1)).astype(np.float32)
        assert np.array_equal(model.model.layers[2].mlp.experts.gate_up_proj[5, rows].numpy(), dec), part
    tid = _tensor(small_v4, "layers.0.ffn.gate.tid2eid")
    assert torch.equal(model.model.layers[0].mlp.gate.tid2eid, tid.long())
    assert torch.equal(model.model.layers[2].mlp.gate.e_score_correction_bias,
                       _tensor(small_v4, "layers.2.ffn.gate.bias").float())


def test_forward_is_finite_causal_and_uses_hash_routing(loaded):
    model = loaded[0]
    ids = torch.randint(0, 1024, (1, 160), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        full = model(input_ids=ids, use_cache=False).logits[0]
        prefix = model(input_ids=ids[:, :140], use_cache=False).logits[0]
        gate = model.model.layers[0].mlp.gate
        saved = gate.tid2eid.clone()
        gate.tid2eid.copy_(torch.roll(saved, 1, dims=0))  # a different hash table must move the logits
        moved = model(input_ids=ids[:, :140], use_cache=False).logits[0]
        gate.tid2eid.copy_(saved)
    assert torch.isfinite(full).all()
    assert (full[:140] - prefix).abs().max() < 1e-4  # later tokens (and compressed windows) do not leak back
    assert (moved - prefix).abs().max() > 1e-2


def _copy_without(src: Path, dst: Path, drop: str | None = None, add: dict | None = None) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for f in sorted(dst.glob("*.safetensors")):
        t = load_file(str(f))
        if drop in t or add:
            t.pop(drop, None)
            t.update(add or {})
            add = None
            save_file(t, str(f))
    return dst


def test_a_missing_tensor_is_refused_by_name(small_v4, tmp_path):
    ck = _copy_without(small_v4, tmp_path / "ck", drop="layers.3.attn.compressor.ape")
    with pytest.raises(V4MappingError, match=r"model.layers.3.self_attn.compressor.position_bias"):
        load_official_v4(ck)


def test_a_missing_expert_is_refused_by_name(small_v4, tmp_path):
    ck = _copy_without(small_v4, tmp_path / "ck", drop="layers.1.ffn.experts.9.w3.weight")
    with pytest.raises(V4MappingError, match=r"layers.1.ffn.experts.9.w3"):
        load_official_v4(ck)


def test_an_unmapped_tensor_is_refused_not_dropped(small_v4, tmp_path):
    ck = _copy_without(small_v4, tmp_path / "ck", add={"layers.0.attn.k_norm.weight": torch.ones(128)})
    with pytest.raises(V4MappingError, match=r"'layers.0.attn.k_norm.weight': no place"):
        load_official_v4(ck)


def test_a_tensor_of_the_wrong_layer_kind_is_refused(small_v4, tmp_path):
    # a gate bias on a hash-routed layer: the config says hash routing, the weights say biased top-k
    ck = _copy_without(small_v4, tmp_path / "ck", add={"layers.0.ffn.gate.bias": torch.zeros(64)})
    with pytest.raises(V4MappingError, match=r"does not\s+build"):
        load_official_v4(ck)


def test_transformers_oracle_run_writes_a_record_for_a_v4_folder(small_v4, tmp_path):
    from typer.testing import CliRunner

    from core.records import Record
    from ds41gates.cli import app

    panel = tmp_path / "ids.json"
    g = torch.Generator().manual_seed(3)
    panel.write_text(json.dumps([torch.randint(0, 1024, (n,), generator=g).tolist() for n in (9, 14)]))
    out = tmp_path / "ref.safetensors"
    r = CliRunner().invoke(app, ["oracle", "run", "--checkpoint", str(small_v4), "--panel", str(panel),
                                 "--out", str(out), "--top-k", "8", "--implementation", "transformers"])
    assert r.exit_code == 0, r.output
    assert "2 sequences, 21 scored positions (transformers fp32" in r.output
    rec = Record.load(out)
    load = rec.provenance.extra["load"]
    assert load["layout"] == "deepseek-v4-official" and load["loaded_entries"] == load["expected_entries"]
    assert rec.provenance.source["vocab_size"] == 1024 and np.isfinite(rec.actual_logprob).all()


def test_the_unquantized_form_gives_the_same_model(small_v4, loaded, tmp_path):
    """tiny_v4's quantized=False form stores the decoded fp8 / MXFP4 values in bf16: loaded through the
    mapping, the two forms must be the same fp32 model, bit for bit."""
    from oracle.dsv41.tiny_v4 import write_tiny_v4_checkpoint

    bf = write_tiny_v4_checkpoint(tmp_path / "bf", seed=0, quantized=False, overrides={"vocab_size": 1024})
    model_bf, _, report = load_official_v4(bf, threads=1)
    assert set(report.formats) == {"plain"} and report.loaded_entries == report.expected_entries
    sd_q, sd_bf = loaded[0].state_dict(), model_bf.state_dict()
    assert sd_q.keys() == sd_bf.keys()
    assert all(torch.equal(sd_q[k], sd_bf[k]) for k in sd_q)


def test_transformers_equals_the_deepseek_oracle_without_its_quantisation_emulation(small_v4, loaded, monkeypatch):
    """Two independent fp32 implementations of V4 on the same checkpoint: with the DeepSeek oracle's activation
    QDQ, fp8-KV QDQ and indexer Hadamard + QDQ4 switched off (transformers reproduces none of them,
    docs/ORACLE.md), every logprob agrees to fp32 summation noise, through window-only, CSA and HCA positions
    (140 tokens: ratio-4 entries from t = 3, the ratio-128 entry from t = 127) and hash-routed and routed layers."""
    from oracle.dsv41 import attention_v4, compressor_v4, numerics
    from oracle.dsv41.checkpoint import Checkpoint
    from oracle.dsv41.model import Model
    from oracle.dsv41.runner import full_weights

    monkeypatch.setattr(numerics.Numerics, "qlinear",
                        lambda self, x, w, block=32, gemm_block=None, fmt="ue8m0": numerics.mm(x, w))
    monkeypatch.setattr(compressor_v4, "qdq8_nope", lambda x, *a, **k: x)
    monkeypatch.setattr(attention_v4, "qdq8_nope", lambda x, *a, **k: x)
    monkeypatch.setattr(compressor_v4, "qdq4p", lambda x, *a, **k: x)
    monkeypatch.setattr(compressor_v4, "rotate_activation", lambda x, num: x)
    ids = torch.randint(0, 1024, (1, 140), generator=torch.Generator().manual_seed(1))
    ck = Checkpoint(small_v4)
    oracle = Model(ck.model_config, full_weights(ck), None, precision="fp32")
    with torch.inference_mode():
        lo = torch.log_softmax(oracle.forward(ids, oracle.new_state(1)).logits[0].double(), -1)
        lt = torch.log_softmax(loaded[0](input_ids=ids, use_cache=False).logits[0].double(), -1)
    assert (lo - lt).abs().max() < 1e-4
    # and the emulation is what separates them: with it on, the same positions differ by far more
    monkeypatch.undo()
    oracle = Model(ck.model_config, full_weights(ck), None, precision="fp32")
    with torch.inference_mode():
        lq = torch.log_softmax(oracle.forward(ids, oracle.new_state(1)).logits[0].double(), -1)
    assert (lq - lt).abs().max() > 1e-2
