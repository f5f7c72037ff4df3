"""Checkpoint inventory, loading, validation, pack composition and provenance (dsv41-architecture.md §4, §19,
§20; weight-formats.md §2, §9 item 26), on tiny checkpoints written in the real formats."""

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from oracle.dsv41 import formats as F
from oracle.dsv41.checkpoint import INDEX_NAME, PLAN_NAME, Checkpoint, CheckpointError, parse_moe_plan
from oracle.dsv41.engram import engram_prime_rows
from oracle.dsv41.arch import expected_inventory
from oracle.dsv41.config import ModelConfig
from oracle.dsv41.tiny import write_tiny_checkpoint, write_tiny_exl3_pack


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint) -> Path:
    return tiny_checkpoint(seed=0)


@pytest.fixture(scope="module")
def pack(tiny, tmp_path_factory) -> Path:
    return write_tiny_exl3_pack(tiny, tmp_path_factory.mktemp("pack") / "exl3", seed=0, layers=[2])


def copy(src: Path, tmp_path: Path, name="copy") -> Path:
    return Path(shutil.copytree(src, tmp_path / name))


def edit_shards(folder: Path, fn):
    """Apply fn(tensors: dict) to every shard's tensors and rewrite the shards and the index."""
    index = json.loads((folder / INDEX_NAME).read_text())
    wm = {}
    for shard in sorted({*index["weight_map"].values()}):
        t = load_file(folder / shard)
        fn(t, shard)
        save_file(t, folder / shard)
        wm.update({k: shard for k in t})
    index["weight_map"] = wm
    (folder / INDEX_NAME).write_text(json.dumps(index))


def problems_of(ckpt_dir, pack_dir=None) -> list[str]:
    with pytest.raises(CheckpointError) as e:
        Checkpoint(ckpt_dir, pack_dir)
    return e.value.problems


# ---------------------------------------------------------------------------------------------------
# inventory


def test_release_inventory_census():  # dsv41-architecture.md §4.4 / §21.1
    cfg = ModelConfig.release()
    tensors = expected_inventory(cfg).official_tensors((32, 32))
    assert len(tensors) == 96_085
    nbytes = {}
    for spec in tensors.values():
        size = {"F32": 4, "BF16": 2, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1}[spec.dtype]
        nbytes[spec.dtype] = nbytes.get(spec.dtype, 0) + int(np.prod(spec.shape)) * size
    assert nbytes == {"F32": 169_229_128, "BF16": 3_952_883_712, "F8_E4M3": 204_015_223_296,
                      "F8_E8M0": 23_563_015_184, "I8": 278_585_671_680}
    assert tensors["layers.0.attn.wq_a.scale"].shape == (40, 160)
    assert tensors["layers.5.ffn.experts.7.w2.scale"].shape == (5120, 72)


def test_engram_rows_are_prime_sums():  # §8.2, §20.2
    assert engram_prime_rows(ModelConfig.tiny()) == [660, 864]
    assert engram_prime_rows(ModelConfig.release()) == [384_006_168, 384_016_682]


def test_tiny_inventory_shapes(tiny):  # §20.3
    ck = Checkpoint(tiny)
    names = ck.tensor_names()
    # §20.3 counts 826 with gate.bias_vl; the reference's vision-off model has none (8 + 3 gates)
    assert len(names) == 826 - 11
    hdr = {n: (ck._official.infos[n].dtype, ck._official.infos[n].shape) for n in names}
    assert hdr["layers.3.attn.wq_b.scale"] == ("F8_E8M0", (16, 2))
    assert hdr["layers.1.engram.embed.weight"] == ("F8_E4M3", (660, 64))
    assert hdr["layers.2.engram.embed.scale"] == ("F8_E8M0", (864, 2))
    assert hdr["layers.2.engram.wkv.scale"] == ("F8_E8M0", (40, 12))
    assert hdr["layers.0.ffn.experts.7.w2.weight"] == ("I8", (256, 64))
    assert hdr["mtp.1.ffn.gate.weight"] == ("BF16", (4, 256))
    assert hdr["mtp.0.main_proj.scale"] == ("F8_E8M0", (8, 24))
    assert hdr["mtp.2.confidence_head.proj.weight"] == ("BF16", (1, 288))
    assert "layers.2.attn.compressor.wgate.weight" in hdr and "layers.4.attn.compressor.wgate.weight" not in hdr
    assert "layers.6.attn.indexer.wq_b.weight" in hdr and "layers.6.attn.indexer.wk.weight" not in hdr
    assert sum(f.stat().st_size for f in tiny.glob("*.safetensors")) == pytest.approx(10.7e6, rel=0.05)


# ---------------------------------------------------------------------------------------------------
# loading: exact decode against independent computations


def test_fp8_and_mxfp4_loads_match_independent_decode(tiny):
    ck = Checkpoint(tiny)
    w = ck.load_layer(3)
    raw = {}
    for f in tiny.glob("*.safetensors"):
        raw |= load_file(f)
    # FP8: torch's own float8 dtypes, scales expanded by kron
    p = "layers.3.attn.wo_b"
    s = raw[p + ".scale"].float()  # float8_e8m0fnu -> fp32
    ref = raw[p + ".weight"].float() * torch.kron(s, torch.ones(32, 32))
    assert torch.equal(w["attn.wo_b.weight"], ref) and ref.shape == (256, 128)
    # MXFP4: ml_dtypes float4 and ldexp in float64
    p = "layers.3.ffn.experts.5.w1"
    b = raw[p + ".weight"].view(torch.uint8).numpy()
    nib = np.stack([b & 0xF, b >> 4], -1).reshape(b.shape[0], -1).astype(np.uint8)
    e = raw[p + ".scale"].view(torch.uint8).numpy().astype(np.int64) - 127
    ref = nib.view(ml_dtypes.float4_e2m1fn).astype(np.float64) * np.ldexp(1.0, np.repeat(e, 32, axis=1))
    assert np.array_equal(w["ffn.experts.5.w1.weight"].double().numpy(), ref)
    # plain tensors are the stored values in fp32
    assert torch.equal(w["attn_norm.weight"], raw["layers.3.attn_norm.weight"].float())
    assert w["hc_attn_fn"].dtype == torch.float32 and torch.equal(w["hc_attn_fn"], raw["layers.3.hc_attn_fn"])


def test_layer_names_and_partial_loads(tiny):
    ck = Checkpoint(tiny)
    w = ck.load_layer(2)
    assert {"attn.wq_a.weight", "attn.compressor.wgate.weight", "attn.indexer.wk.weight", "engram.embed.weight",
            "engram.q_weight", "ffn.gate.bias", "ffn.experts.7.w3.weight", "hc_ffn_scale"} <= set(w)
    assert not any(k.endswith(".scale") for k in w)
    assert w["engram.embed.weight"].shape == (864, 64)
    lean = ck.load_layer(2, experts=False, tables=False)
    assert set(w) - set(lean) == {f"ffn.experts.{e}.{n}.weight" for e in range(8) for n in ("w1", "w2", "w3")} | {
        "engram.embed.weight"}
    assert set(ck.load_top()) == {"embed.weight", "head.weight", "norm.weight"}
    assert "main_proj.weight" in ck.load_mtp(0) and "markov_head.head.weight" in ck.load_mtp(2)
    ex = ck.load_expert(2, 4)
    assert torch.equal(ex["w2"], w["ffn.experts.4.w2.weight"])
    lazy = ck.lazy("layers.2")
    assert set(lazy) == set(w) and torch.equal(lazy["attn.wo_a.weight"], w["attn.wo_a.weight"])
    with pytest.raises(KeyError):
        lazy["attn.nope.weight"]


def test_engram_rows_read_only_requested_rows(tiny):
    ck = Checkpoint(tiny)
    table = ck.load_table("layers.1.engram.embed")
    ids = torch.tensor([[659, 0, 17], [17, 300, 5]])
    rows = Checkpoint(tiny).engram_rows(1, ids)
    assert rows.shape == (2, 3, 64) and torch.equal(rows, table[ids])
    with pytest.raises(IndexError, match=r"\[0, 660\)"):
        ck.engram_rows(1, [660])


def test_realistic_statistics(tiny):  # §20.5
    ck = Checkpoint(tiny)
    top, w = ck.load_top(), ck.load_layer(3)
    assert top["embed.weight"].pow(2).mean().sqrt().item() == pytest.approx(0.12, rel=0.05)
    for name, mean in (("attn_norm.weight", 0.025), ("ffn_norm.weight", 0.2), ("attn.q_norm.weight", 0.97),
                       ("attn.kv_norm.weight", 0.4)):
        assert w[name].mean().item() == pytest.approx(mean, rel=0.05)
        assert w[name].std().item() == pytest.approx(0.1 * mean, rel=0.3)
    for name, gain in (("attn.wq_a.weight", 1.6), ("attn.wo_b.weight", 1.9), ("ffn.shared_experts.w2.weight", 1.05)):
        fan_in = w[name].shape[1]
        assert w[name].pow(2).mean().sqrt().item() == pytest.approx(gain * fan_in**-0.5, rel=0.1)
    # FP4 experts: per-32 scale exponents round(log2(std / 3.2)) jittered by -1/0/+1
    e = {int(b) - 127 for b in ck._official.read(ck._official.infos["layers.3.ffn.experts.0.w1.scale"]).flatten()}
    c = round(np.log2(1.5 * 256**-0.5 / 3.2))
    assert e == {c - 1, c, c + 1}


def test_generator_is_deterministic(tiny, tmp_path):
    again = write_tiny_checkpoint(tmp_path / "again", seed=0)
    other = write_tiny_checkpoint(tmp_path / "other", seed=1)
    for f in sorted(tiny.glob("*")):
        assert (again / f.name).read_bytes() == f.read_bytes(), f.name
    assert (other / "model-00001.safetensors").read_bytes() != (tiny / "model-00001.safetensors").read_bytes()
    with pytest.raises(FileExistsError):
        write_tiny_checkpoint(tmp_path / "again")


def test_larger_variant(tmp_path):
    over = {"dim": 512, "moe_inter_dim": 256, "n_layers": 3, "compress_ratios": [0, 0, 2, 0, 0, 0],
            "kv_source_layers": [2], "index_source_layers": [2], "candidate_source_layer": -1,
            "dspark_target_layer_ids": [0, 1, 2]}
    ck = Checkpoint(write_tiny_checkpoint(tmp_path / "big", seed=3, config_overrides=over))
    assert ck.model_config.dim == 512
    w = ck.load_layer(2)
    assert w["ffn.experts.0.w1.weight"].shape == (256, 512) and w["attn.wo_b.weight"].shape == (512, 128)
    with pytest.raises(ValueError, match="not a multiple of 32"):
        write_tiny_checkpoint(tmp_path / "bad", config_overrides={"q_lora_rank": 48})


# ---------------------------------------------------------------------------------------------------
# validation: one error listing every problem


def test_missing_extra_shape_dtype_reported_together(tiny, tmp_path):
    d = copy(tiny, tmp_path)

    def mutate(t, shard):
        if "layers.0.attn.wq_a.weight" in t:
            del t["layers.0.attn.wq_a.weight"]
        if "layers.0.ffn_norm.weight" in t:
            t["layers.0.ffn_norm.weight"] = torch.zeros(255, dtype=torch.bfloat16)
        if "layers.1.attn_norm.weight" in t:
            t["layers.1.attn_norm.weight"] = t["layers.1.attn_norm.weight"].float()
        if "norm.weight" in t:
            t["layers.0.attn.surprise.weight"] = torch.zeros(3)
    edit_shards(d, mutate)
    probs = problems_of(d)
    text = "\n".join(probs)
    assert len(probs) == 4, text
    assert any("layers.0.ffn_norm.weight: shape [255], expected [256]" in p for p in probs)
    assert any("layers.1.attn_norm.weight: dtype F32, expected BF16" in p for p in probs)
    assert any("extra: layers.0.attn.surprise.weight" in p for p in probs)
    assert any(p.startswith("layers.0.attn.wq_a: no .weight") for p in probs)


def test_missing_linear_entirely(tiny, tmp_path):
    d = copy(tiny, tmp_path)
    edit_shards(d, lambda t, s: [t.pop(k) for k in list(t) if k.startswith("layers.4.ffn.experts.3.w2.")])
    assert problems_of(d) == ["missing: layers.4.ffn.experts.3.w2.weight, layers.4.ffn.experts.3.w2.scale"]


def test_wrong_storage_format(tiny, tmp_path):
    d = copy(tiny, tmp_path)

    def mutate(t, s):
        if "layers.2.attn.wkv.weight" in t:
            t["layers.2.attn.wkv.weight"] = torch.zeros(64, 256, dtype=torch.bfloat16)
            del t["layers.2.attn.wkv.scale"]
    edit_shards(d, mutate)
    [p] = problems_of(d)
    assert "layers.2.attn.wkv" in p and "wrong dtype" in p


def test_block_size_mismatch_with_config(tiny, tmp_path):  # weight-formats.md §4.3, §9.7
    d = copy(tiny, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"weight_block_size": [128, 128]}
    (d / "config.json").write_text(json.dumps(cfg))
    probs = problems_of(d)
    assert any("layers.0.attn.wq_b.scale: grid [16, 2] implies 32x32 blocks, config weight_block_size is [128, 128]"
               in p for p in probs)


def _rchar() -> int:
    return int(next(ln for ln in Path("/proc/self/io").read_text().splitlines() if ln.startswith("rchar:")).split()[1])


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux /proc/self/io")
def test_engram_rows_read_exactly_the_rows_bytes(tiny):
    """The row reader reads each distinct row's bytes (a weight row and its scale row) and nothing else:
    /proc/self/io's rchar counts the bytes every read syscall returned (a whole-table load, a mapped table's
    read-around or a second read of a repeated row would all show)."""
    ck = Checkpoint(tiny)
    ck.engram_rows(1, [1, 2])  # first call: any lazy import's file reads happen here, not below
    spec = ck.inventory.tables["layers.1.engram.embed"]
    ids = torch.tensor([[3, 600, 3], [17, 600, 659]])
    before = _rchar()
    rows = ck.engram_rows(1, ids)
    after = _rchar()
    proc_read = _rchar() - after  # reading /proc/self/io counts too (~120 bytes; its digits may grow by one)
    want = 4 * (spec.width + spec.width // 32)  # 4 distinct rows of 64 e4m3 bytes + 2 scale bytes
    assert 0 <= (after - before - proc_read) - want <= 2, (after - before - proc_read, want)
    assert torch.equal(rows, ck.load_table("layers.1.engram.embed")[ids])


def test_engram_rows_must_match_primes(tiny, tmp_path):
    d = copy(tiny, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["engram_num_embeddings"] = [661, 864]
    (d / "config.json").write_text(json.dumps(cfg))
    text = "\n".join(problems_of(d))
    assert "engram_num_embeddings 661 != sum of primes 660" in text
    assert "layers.1.engram.embed.weight: shape [660, 64], expected [661, 64]" in text


def test_truncated_shard(tiny, tmp_path):
    d = copy(tiny, tmp_path)
    f = d / "model-00002.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    [p] = problems_of(d)
    assert p.startswith("model-00002.safetensors: truncated file")


def test_index_and_shard_disagree(tiny, tmp_path):
    d = copy(tiny, tmp_path)
    idx = json.loads((d / INDEX_NAME).read_text())
    idx["weight_map"]["layers.0.attn.ghost.weight"] = "model-00001.safetensors"
    idx["weight_map"]["norm.weight"] = "model-00009.safetensors"
    (d / INDEX_NAME).write_text(json.dumps(idx))
    text = "\n".join(problems_of(d))
    assert "model-00009.safetensors, which does not exist" in text
    assert "layers.0.attn.ghost.weight: listed in model.safetensors.index.json but absent" in text


def test_non_finite_values(tiny, tmp_path):
    d = copy(tiny, tmp_path)

    def mutate(t, s):
        if "layers.5.attn.wkv.scale" in t:
            sc = t["layers.5.attn.wkv.scale"].view(torch.uint8).clone()
            sc[1, 3] = 255  # e8m0 NaN
            t["layers.5.attn.wkv.scale"] = sc.view(torch.float8_e8m0fnu)
        if "layers.6.ffn_norm.weight" in t:
            t["layers.6.ffn_norm.weight"][7] = float("nan")
    edit_shards(d, mutate)
    ck = Checkpoint(d)  # headers are fine; values are checked when read
    with pytest.raises(CheckpointError, match=r"layers.5.attn.wkv: 1024 non-finite"):
        ck.load_layer(5)
    with pytest.raises(CheckpointError) as e:
        ck.check_values()
    assert len(e.value.problems) == 2 and "layers.6.ffn_norm.weight: 1 non-finite" in e.value.problems[1]
    ck.load_layer(4)  # other layers still load


# ---------------------------------------------------------------------------------------------------
# packs (weight-formats.md §2.4, §2.5, §9 item 26)


def test_pack_manifest(tiny, pack):  # §9.26
    ck = Checkpoint(tiny, pack)
    m = ck.manifest()
    from_pack = {p for p, v in m["linears"].items() if v["source"] == "pack"}
    assert from_pack == {f"layers.2.ffn.experts.{e}.{w}" for e in range(8) for w in ("w1", "w2", "w3")}
    assert all(m["linears"][p]["format"] == "exl3" for p in from_pack)
    assert all(v["source"] == "official" for p, v in m["linears"].items() if p not in from_pack)
    assert all(v["source"] == "official" for v in m["tensors"].values())
    # mixed K per expert, read from each trellis, agreeing with the plan
    plan = parse_moe_plan(json.loads((pack / PLAN_NAME).read_text()))
    ks = [m["linears"][f"layers.2.ffn.experts.{e}.w2"]["K"] for e in range(8)]
    assert ks == [float(k) for k in plan[2]] and len(set(ks)) > 3
    assert {m["linears"][f"layers.2.ffn.experts.{e}.w1"]["codebook"] for e in range(8)} == {"3inst", "mcg", "mul1"}
    # no official expert tensor of layer 2 is part of the build
    assert not any(n.startswith("layers.2.ffn.experts.") and n.endswith(".scale") for n in ck.tensor_names())


def test_pack_weights_are_the_pack_decode(tiny, pack):
    ck, off = Checkpoint(tiny, pack), Checkpoint(tiny)
    w, w0 = ck.load_layer(2), off.load_layer(2)
    raw = load_file(next(pack.glob("*.safetensors")))
    p = "layers.2.ffn.experts.3.w2"
    cb = 1 if p + ".mcg" in raw else 2 if p + ".mul1" in raw else 0
    ref = F.exl3_dequant(raw[p + ".trellis"], raw[p + ".suh"], raw[p + ".svh"], cb)
    assert torch.equal(w["ffn.experts.3.w2.weight"], ref) and ref.shape == (256, 128)
    assert not torch.equal(w["ffn.experts.3.w2.weight"], w0["ffn.experts.3.w2.weight"])
    # realistic magnitude: same order as the official expert
    r = w["ffn.experts.3.w2.weight"].pow(2).mean().sqrt() / w0["ffn.experts.3.w2.weight"].pow(2).mean().sqrt()
    assert 0.5 < r.item() < 2
    for k in w:
        if not k.startswith("ffn.experts."):
            assert torch.equal(w[k], w0[k]), k
    assert torch.equal(ck.load_layer(3)["ffn.experts.3.w2.weight"], off.load_layer(3)["ffn.experts.3.w2.weight"])


def test_plan_disagreement_fails(tiny, pack, tmp_path):
    d = copy(pack, tmp_path)
    plan = json.loads((d / PLAN_NAME).read_text())
    digits = plan["layers"]["2"]
    wrong = int(digits[5]) % 8 + 1
    plan["layers"]["2"] = digits[:5] + str(wrong) + digits[6:]
    (d / PLAN_NAME).write_text(json.dumps(plan))
    assert problems_of(tiny, d) == [
        f"{PLAN_NAME}: layer 2 expert 5 planned at K={wrong}, layers.2.ffn.experts.5.{w}.trellis has "
        f"K={float(digits[5])} (width {16 * int(digits[5])})" for w in ("w1", "w2", "w3")]
    plan["layers"]["2"] = digits[:7]  # one expert short
    (d / PLAN_NAME).write_text(json.dumps(plan))
    assert problems_of(tiny, d) == [f"{PLAN_NAME}: layer 2 has 7 digits, the layer has 8 experts"] + [
        f"{PLAN_NAME}: EXL3 expert layers.2.ffn.experts.7.{w} is not covered by the plan" for w in ("w1", "w2", "w3")]


def test_plan_parsing_is_tolerant_but_strict_about_digits():
    assert parse_moe_plan({"layers.3": "234", "version": 1}) == {3: [2, 3, 4]}
    assert parse_moe_plan({"layers": {"model.layers.0": [8, 8]}}) == {0: [8, 8]}
    assert parse_moe_plan(["12", "34"]) == {0: [1, 2], 1: [3, 4]}
    with pytest.raises(ValueError):
        parse_moe_plan({"layers": {"2": "23x"}})


def test_pack_conflicts_fail(tiny, pack, tmp_path):
    d = copy(pack, tmp_path)

    def mutate(t, s):
        t["layers.2.ffn.experts.0.w1.weight"] = torch.zeros(128, 128, dtype=torch.int8)  # official-style + trellis
        t["layers.2.ffn.experts.1.w2.bias"] = torch.zeros(256, dtype=torch.float16)
        t["layers.2.attn.brand_new"] = torch.zeros(4)
        t["layers.2.attn_norm.weight"] = torch.ones(128, dtype=torch.bfloat16)
    edit_shards(d, mutate)
    text = "\n".join(problems_of(tiny, d))
    assert "layers.2.ffn.experts.0.w1: both EXL3 .trellis and .weight present" in text
    assert "layers.2.ffn.experts.1.w2.bias: DeepSeek linears have no bias" in text
    assert "pack layers.2.attn.brand_new: has no official counterpart" in text
    assert "pack layers.2.attn_norm.weight: shape [128] != official [256]" in text


def test_pack_fp8_and_plain_overrides(tiny, tmp_path):
    """A pack holding FP8 / plain tensors of its own: resolved per prefix / per name."""
    d = tmp_path / "p"
    d.mkdir()
    w = torch.randn(64, 256) * 0.05
    from oracle.dsv41.tiny import quantize_fp8_blocks
    q, s = quantize_fp8_blocks(w, (32, 32))
    norm = torch.full((256,), 2.0, dtype=torch.bfloat16)
    save_file({"layers.1.attn.wq_a.weight": q.view(torch.float8_e4m3fn), "layers.1.attn.wq_a.scale":
               s.view(torch.float8_e8m0fnu), "layers.1.ffn_norm.weight": norm}, d / "model.safetensors")
    ck = Checkpoint(tiny, d)  # no index, no config: inventory from shard headers
    got = ck.load_layer(1)
    assert torch.equal(got["attn.wq_a.weight"], F.fp8_dequant(q, s, (32, 32)))
    assert (got["ffn_norm.weight"] == 2.0).all()
    assert ck.source_of("layers.1.attn.wq_a") == "pack" and ck.source_of("layers.1.attn.wq_b") == "official"
    assert ck.provenance()["pack_prefixes"] == ["layers.1.attn.wq_a", "layers.1.ffn_norm.weight"]


# ---------------------------------------------------------------------------------------------------
# provenance


def test_provenance_hash(tiny, pack, tmp_path):
    a, b = Checkpoint(tiny), Checkpoint(tiny)
    assert a.provenance_hash() == b.provenance_hash()
    a.load_layer(0)
    b.load_layer(0)
    assert a.provenance_hash() == b.provenance_hash()
    assert a.provenance()["loaded"]["layers.0.attn.wq_a.scale"] == b.provenance()["loaded"]["layers.0.attn.wq_a.scale"]
    before = a.provenance_hash()
    a.engram_rows(1, [3, 4])
    assert a.provenance_hash() != before  # it records exactly what was read
    c = Checkpoint(tiny, pack)
    c.load_layer(0)
    assert c.provenance_hash() != b.provenance_hash()
    assert c.provenance()["pack"]["plan_sha256"] is not None
    # location-independent: a copy elsewhere hashes the same
    moved = Checkpoint(copy(tiny, tmp_path, "moved"))
    moved.load_layer(0)
    assert moved.provenance_hash() == b.provenance_hash()
    # a different checkpoint with the same names, shapes and config gives a different hash
    other = tmp_path / "seed1"
    write_tiny_checkpoint(other, seed=1)
    shutil.copy(tiny / "config.json", other / "config.json")  # config differs only by the recorded seed
    d = Checkpoint(other)
    d.load_layer(0)
    assert d.provenance()["inventory_sha256"] == b.provenance()["inventory_sha256"]
    assert d.provenance_hash() != b.provenance_hash()


def test_output_buffers_never_hand_out_an_array_a_tensor_still_uses():
    from oracle.dsv41.checkpoint import OutputBuffers

    pool = OutputBuffers()
    a = pool.take((4, 8))
    addr = a.ctypes.data
    t = torch.from_numpy(a)
    del a
    view = t[1:]
    assert pool.in_use() == 1
    assert pool.reclaim() == 0  # the tensor (and its view) still use it: forgotten, not reused
    del t
    assert pool.take((4, 8)).ctypes.data != addr  # the view still lives there: never handed out again
    del view
    pool.reclaim()

    b = pool.take((4, 8))
    addr = b.ctypes.data
    del b
    assert pool.in_use() == 0 and pool.reclaim() == 1
    assert pool.take((4, 8)).ctypes.data == addr  # reused by the next stage
    pool.reclaim()
    pool.take((2, 2))
    pool.reclaim()  # the free (4, 8) was not taken during that stage: dropped, memory bounded
    assert all(shape != (4, 8) for shape in pool._free)


def test_decoding_into_a_reused_buffer_gives_the_same_weights():
    from oracle.dsv41 import formats as F

    g = torch.Generator().manual_seed(0)
    w8 = torch.randint(0, 256, (64, 96), dtype=torch.uint8, generator=g)
    w8[w8 == 0x7F] = 0  # keep every e4m3 code finite
    w8[w8 == 0xFF] = 0
    s8 = torch.randint(120, 135, (1, 1), dtype=torch.uint8, generator=g)
    w4 = torch.randint(0, 256, (64, 48), dtype=torch.uint8, generator=g)
    s4 = torch.randint(120, 135, (64, 3), dtype=torch.uint8, generator=g)
    dirty = np.full((64, 96), np.nan, dtype=np.float32)  # a stale layer's values must be overwritten
    assert torch.equal(F.fp8_dequant(w8, s8, (128, 128), out=dirty), F.fp8_dequant(w8, s8, (128, 128)))
    dirty[:] = np.nan
    assert torch.equal(F.mxfp4_dequant(w4, s4, out=dirty), F.mxfp4_dequant(w4, s4))
    with pytest.raises(F.FormatError, match=r"output buffer .* shape \[64, 96\]"):
        F.mxfp4_dequant(w4, s4, out=np.empty((64, 95), dtype=np.float32))


def test_loaded_digests_and_byte_ranges_name_exactly_what_a_layer_load_reads(tiny):
    """loaded_digests() is provenance()["loaded"]; each digest is the SHA-256 of the tensor's stored bytes,
    recomputed here from the file at the byte range byte_ranges() gives."""
    import hashlib

    ck = Checkpoint(tiny)
    ranges = ck.byte_ranges("layers.0")
    ck.load_layer(0)
    digests = ck.loaded_digests()
    assert digests == ck.provenance()["loaded"] and digests
    assert all(n.startswith("layers.0.") for n in digests)
    by_range = set()
    for path, begin, end in ranges:
        with open(path, "rb") as f:
            f.seek(begin)
            by_range.add(hashlib.sha256(f.read(end - begin)).hexdigest())
    assert set(digests.values()) <= by_range  # every tensor read lies in a readahead range
    assert len(ranges) == len(digests)  # and nothing else does (no Engram table on layer 0)
    assert not set(ck.byte_ranges("layers.1")) & set(ranges)  # "layers.1" is not a prefix of "layers.10"


# ---------------------------------------------------------------------------------------------------
# compatibility with the reference's model (tenstorrent/tt-metal V41/model.py ModelArgs / Transformer)

# dsv41-architecture.md §2.1: the inference config.json keys, plus the ModelArgs fields that the released JSON
# leaves at their defaults (§2.1, last paragraph). The reference builds ModelArgs(**config): any other key is a
# TypeError there.
_INFERENCE_KEYS = {
    "vocab_size", "dim", "moe_inter_dim", "n_layers", "n_mtp_layers", "n_heads", "head_dim", "rope_head_dim",
    "q_lora_rank", "o_groups", "o_lora_rank", "window_size", "norm_eps", "n_routed_experts", "n_shared_experts",
    "n_activated_experts", "score_func", "route_scale", "swiglu_limit", "compress_ratios", "kv_source_layers",
    "index_source_layers", "candidate_source_layer", "candidate_topk_blocks", "candidate_block_size",
    "index_n_heads", "index_head_dim", "index_topk", "rope_theta", "compress_rope_theta", "original_seq_len",
    "rope_factor", "beta_fast", "beta_slow", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "engram_layer_ids",
    "engram_num_embeddings", "engram_vocab_size", "engram_max_ngram_size", "engram_n_heads", "engram_head_dim",
    "engram_pad_id", "engram_compressed_vocab_size", "dspark_block_size", "dspark_noise_token_id",
    "dspark_target_layer_ids", "dspark_markov_rank", "dspark_n_routed_experts", "dspark_n_activated_experts",
    "dtype", "expert_dtype", "vision_n_layers", "image_token_id",
}
_VISION_SIZE_KEYS = {"vision_dim", "vision_n_heads", "vision_inter_dim", "vision_patch_size",
                     "vision_downsample_ratio", "vision_max_n_token", "vision_min_pixels", "vision_max_wh_ratio",
                     "vision_rope_theta"}
_DEFAULTED_KEYS = {"gate_temp", "norm_topk_prob", "max_batch_size", "max_seq_len", "temperature"}


def _names_by_the_architecture_document(cfg: dict) -> set[str]:
    """Every tensor name of §4.2 / §4.3 for a configuration, by the document's presence rules; gate.bias_vl
    only with the vision path on (the reference's Gate defines it only then)."""
    names = {"embed.weight", "head.weight", "norm.weight"}

    def q(p):  # FP8 / FP4 linears: weight + scale
        return {f"{p}.weight", f"{p}.scale"}

    def block(p, L, backbone):
        n = {f"{p}.hc_{s}_{k}" for s in ("attn", "ffn") for k in ("fn", "base", "scale")}
        n |= {f"{p}.attn_norm.weight", f"{p}.ffn_norm.weight", f"{p}.attn.attn_sink", f"{p}.attn.q_norm.weight",
              f"{p}.attn.kv_norm.weight"}
        for w in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b"):
            n |= q(f"{p}.attn.{w}")
        if backbone and L in cfg["kv_source_layers"]:
            n |= {f"{p}.attn.compressor.wkv.weight", f"{p}.attn.compressor.norm.weight",
                  f"{p}.attn.indexer.wk.weight", f"{p}.attn.indexer.k_norm.weight"}
            if cfg["compress_ratios"][L] == 2:
                n.add(f"{p}.attn.compressor.wgate.weight")
        if backbone and L in cfg["index_source_layers"]:
            n |= q(f"{p}.attn.indexer.wq_b") | {f"{p}.attn.indexer.weights_proj.weight"}
        n |= {f"{p}.ffn.gate.weight", f"{p}.ffn.gate.bias"}
        if cfg["vision_n_layers"] > 0:
            n.add(f"{p}.ffn.gate.bias_vl")
        n_exp = cfg["n_routed_experts"] if backbone else (cfg["dspark_n_routed_experts"] or cfg["n_routed_experts"])
        for e in range(n_exp):
            for w in ("w1", "w2", "w3"):
                n |= q(f"{p}.ffn.experts.{e}.{w}")
        for w in ("w1", "w2", "w3"):
            n |= q(f"{p}.ffn.shared_experts.{w}")
        if backbone and L in cfg["engram_layer_ids"]:
            n |= q(f"{p}.engram.embed") | q(f"{p}.engram.wkv") | {f"{p}.engram.q_weight", f"{p}.engram.k_weight"}
        return n

    for L in range(cfg["n_layers"]):
        names |= block(f"layers.{L}", L, True)
    last = cfg["n_mtp_layers"] - 1
    for S in range(cfg["n_mtp_layers"]):
        names |= block(f"mtp.{S}", cfg["n_layers"] + S, False)
    names |= q("mtp.0.main_proj") | {"mtp.0.main_norm.weight", f"mtp.{last}.norm.weight",
                                     f"mtp.{last}.markov_head.embed.weight", f"mtp.{last}.markov_head.head.weight",
                                     f"mtp.{last}.confidence_head.proj.weight"}
    return names


def _stored_names(folder: Path) -> set[str]:
    return set(json.loads((folder / INDEX_NAME).read_text())["weight_map"])


@pytest.mark.parametrize("overrides", [{}, {"index_topk": 4, "n_mtp_layers": 2, "compress_ratios": [0, 0, 2, 2, 1, 1, 1, 1, 0, 0]}])
def test_tiny_checkpoint_holds_exactly_what_the_reference_model_defines(tmp_path, overrides):
    d = write_tiny_checkpoint(tmp_path / "t", seed=3, config_overrides=overrides)
    cfg = json.loads((d / "config.json").read_text())
    assert set(cfg) <= _INFERENCE_KEYS | _VISION_SIZE_KEYS | _DEFAULTED_KEYS
    assert _INFERENCE_KEYS | _DEFAULTED_KEYS <= set(cfg)
    assert cfg["temperature"] == 0  # the reference samples at any other temperature
    assert cfg["vision_n_layers"] == 0
    assert _stored_names(d) == _names_by_the_architecture_document(cfg)


def test_vision_off_checkpoint_without_bias_vl_loads_and_routes_image_tokens_with_gate_bias(tiny, tmp_path):
    """A vision-off checkpoint written as the reference's model stores it: inference-form config.json (no
    quantization_config, no tiny marker), no gate.bias_vl anywhere."""
    d = copy(tiny, tmp_path)
    (d / "ds41_tiny.json").unlink()
    assert not any(n.endswith("bias_vl") for n in _stored_names(d))
    assert "quantization_config" not in json.loads((d / "config.json").read_text())
    ck = Checkpoint(d)
    assert ck.fp8_block == (32, 32)
    w = ck.load_layer(3)
    assert "ffn.gate.bias_vl" not in w and "ffn.gate.bias" in w
    from oracle.dsv41.moe import MoE
    moe = MoE(ck.model_config, 3).load({f"layers.3.{k}": v for k, v in w.items()}, "layers.3.")
    from oracle.dsv41.numerics import Numerics
    x = torch.randn(1, 5, 256, generator=torch.Generator().manual_seed(0))
    image = torch.tensor([[False, True, True, False, False]])
    assert torch.equal(moe(x, Numerics(), image), moe(x, Numerics(), None))


def test_release_style_bias_vl_is_still_accepted_with_vision_off(tiny, tmp_path):
    d = copy(tiny, tmp_path)

    def add_bias_vl(t, shard):
        for n in [n for n in t if n.endswith("ffn.gate.bias")]:
            t[n + "_vl"] = torch.full_like(t[n], 0.25)
    edit_shards(d, add_bias_vl)
    w = Checkpoint(d).load_layer(0)
    assert torch.equal(w["ffn.gate.bias_vl"], torch.full((8,), 0.25))
