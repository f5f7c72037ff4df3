"""Reliability: malformed inputs are refused with the reason, before any number is produced.

* DeepSeek-V4.1 checkpoints (oracle/dsv41/checkpoint.py on write_tiny_checkpoint): missing / extra tensor,
  wrong dtype, wrong shape, NaN weights, truncated shard, unreadable config;
* HF model folders for oracle/hf.py (a tiny random Llama written here): missing / extra tensor, wrong shape,
  NaN weights, truncated safetensors, no / unreadable config, config disagreeing with the weights;
* panels (panels/store.py): a line that is not JSON, a duplicate id, an unknown domain, an item of the wrong
  shape, a published panel edited in place;
* references (core/records.py, ds41gates/pipeline.py): built from another panel, tokenizer, token ids or
  format version; a truncated record file; a cached reference that belongs to another panel.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from core.records import Record, RecordError, RecordMismatch
from oracle.dsv41.checkpoint import INDEX_NAME, Checkpoint, CheckpointError
from oracle.hf import HFOracle, OracleError
from panels import load_panel
from panels.model import PanelError, PanelHashMismatch
from panels.store import content_hash, parse_jsonl
from tests.core.recordkit import pair_of_records


# ============================================================================================ DSv4.1 checkpoints
@pytest.fixture(scope="module")
def tiny(tiny_checkpoint) -> Path:
    return tiny_checkpoint(seed=0)


def _edit_shards(folder: Path, fn) -> None:
    index = json.loads((folder / INDEX_NAME).read_text())
    wm = {}
    for shard in sorted(set(index["weight_map"].values())):
        t = load_file(folder / shard)
        fn(t)
        save_file(t, folder / shard)
        wm.update({k: shard for k in t})
    index["weight_map"] = wm
    (folder / INDEX_NAME).write_text(json.dumps(index))


def _only(name, fn):
    return lambda t: fn(t) if name in t else None


def _trunc(folder: Path) -> None:
    f = folder / "model-00002.safetensors"
    f.write_bytes(f.read_bytes()[:-777])


DSV41_CASES = [
    ("missing tensor", lambda d: _edit_shards(d, _only("layers.0.ffn_norm.weight", lambda t: t.pop("layers.0.ffn_norm.weight"))),
     "missing: layers.0.ffn_norm.weight"),
    ("extra tensor", lambda d: _edit_shards(d, _only("norm.weight", lambda t: t.__setitem__("layers.0.attn.extra.weight", torch.zeros(4)))),
     "extra: layers.0.attn.extra.weight"),
    ("wrong dtype", lambda d: _edit_shards(d, _only("layers.1.attn_norm.weight", lambda t: t.__setitem__(
        "layers.1.attn_norm.weight", t["layers.1.attn_norm.weight"].float()))),
     "layers.1.attn_norm.weight: dtype F32, expected BF16 (wrong dtype)"),
    ("wrong shape", lambda d: _edit_shards(d, _only("layers.2.ffn_norm.weight", lambda t: t.__setitem__(
        "layers.2.ffn_norm.weight", torch.ones(255, dtype=torch.bfloat16)))),
     "layers.2.ffn_norm.weight: shape [255], expected [256] (wrong shape)"),
    ("truncated shard", _trunc, "model-00002.safetensors: truncated file"),
    ("unreadable config", lambda d: (d / "config.json").write_text('{"dim": 256, '), "config.json"),
]


@pytest.mark.parametrize("mutate,reason", [c[1:] for c in DSV41_CASES], ids=[c[0] for c in DSV41_CASES])
def test_dsv41_checkpoint_refused_with_the_reason(tiny, tmp_path, mutate, reason):
    d = Path(shutil.copytree(tiny, tmp_path / "ckpt"))
    mutate(d)
    with pytest.raises(CheckpointError) as ei:
        Checkpoint(d)                      # validation happens before any compute
    assert any(reason in p for p in ei.value.problems), ei.value.problems
    assert len(ei.value.problems) == 1, ei.value.problems        # only the planted problem


def test_dsv41_nan_weights_refused_when_read(tiny, tmp_path):
    d = Path(shutil.copytree(tiny, tmp_path / "ckpt"))

    def poison(t):
        if "layers.3.ffn_norm.weight" in t:
            t["layers.3.ffn_norm.weight"][5] = float("nan")
    _edit_shards(d, poison)
    ck = Checkpoint(d)                     # headers are valid; values are checked when the layer is read
    ck.load_layer(2)
    with pytest.raises(CheckpointError, match=r"layers.3.ffn_norm.weight: 1 non-finite value"):
        ck.load_layer(3)
    with pytest.raises(CheckpointError, match=r"layers.3.ffn_norm.weight: 1 non-finite"):
        ck.check_values()


# ============================================================================================ HF model folders
@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True)
    d = tmp_path_factory.mktemp("hf") / "tiny-llama"
    LlamaForCausalLM(cfg).save_pretrained(d, safe_serialization=True)
    return d


def _hf_edit(fn):
    def mutate(d: Path):
        t = load_file(d / "model.safetensors")
        fn(t)
        save_file(t, d / "model.safetensors", metadata={"format": "pt"})
    return mutate


def _nan(t):
    t["model.layers.0.mlp.up_proj.weight"][0, 0] = float("nan")


def _config_vocab(d: Path):
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "vocab_size": 100}))


HF_CASES = [
    # transformers itself only warns here and fills the tensor with random values: oracle/hf.py refuses
    ("missing tensor", _hf_edit(lambda t: t.pop("model.layers.1.mlp.down_proj.weight")),
     "weights do not match the configuration: missing ['model.layers.1.mlp.down_proj.weight']"),
    ("extra tensor", _hf_edit(lambda t: t.__setitem__("model.layers.1.mlp.extra.weight", torch.zeros(3))),
     "weights do not match the configuration: unexpected ['model.layers.1.mlp.extra.weight']"),
    ("wrong shape", _hf_edit(lambda t: t.__setitem__("model.layers.0.input_layernorm.weight", torch.ones(31))),
     "cannot load the model: RuntimeError"),
    ("truncated safetensors", lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:-500]),
     "cannot load the model: SafetensorError"),
    ("no config.json", lambda d: (d / "config.json").unlink(), "not an HF model directory (no config.json)"),
    ("unreadable config.json", lambda d: (d / "config.json").write_text('{"model_type": "llama", '),
     "cannot load the model: OSError"),
    ("config vocab disagrees with weights", _config_vocab, "cannot load the model: RuntimeError"),
    ("no weight files", lambda d: (d / "model.safetensors").unlink(), "no weight files"),
]


@pytest.mark.parametrize("mutate,reason", [c[1:] for c in HF_CASES], ids=[c[0] for c in HF_CASES])
def test_hf_model_dir_refused_with_the_reason(hf_tiny, tmp_path, mutate, reason):
    d = Path(shutil.copytree(hf_tiny, tmp_path / "model"))
    HFOracle.load(d, threads=1)            # the unmodified copy loads
    mutate(d)
    with pytest.raises(OracleError) as ei:
        HFOracle.load(d, threads=1)
    assert reason in str(ei.value) and str(d) in str(ei.value), str(ei.value)


def test_hf_nan_weights_refused_at_the_first_logits(hf_tiny, tmp_path):
    d = Path(shutil.copytree(hf_tiny, tmp_path / "model"))
    _hf_edit(_nan)(d)
    orc = HFOracle.load(d, threads=1)
    with pytest.raises(OracleError, match=r"sequence 'adhoc' position 1: non-finite logits"):
        orc.logits([1, 2, 3, 4])


# ============================================================================================ panels
GOOD = [{"id": "a-1", "domain": "code", "kind": "raw", "score": "all", "text": "def f(x):\n    return x\n"},
        {"id": "b-2", "domain": "chat", "kind": "raw", "score": "all", "text": "Hello there."}]


def _panel_files(tmp_path: Path, lines: list[str], name="rel") -> Path:
    items = tmp_path / f"{name}-1.jsonl"
    items.write_text("\n".join(lines) + "\n")
    try:
        digest = content_hash(parse_jsonl(items))
    except PanelError:
        digest = "sha256:" + "0" * 64
    manifest = tmp_path / f"{name}-1.manifest.json"
    manifest.write_text(json.dumps({"name": name, "version": 1, "file": items.name, "content_hash": digest}))
    return manifest


PANEL_CASES = [
    ("line is not JSON", [json.dumps(GOOD[0]), '{"id": "b-2", "domain": '], r"rel-1.jsonl:2: invalid JSON"),
    ("duplicate id", [json.dumps(GOOD[0]), json.dumps({**GOOD[1], "id": "a-1"})], r"rel-1.jsonl:2: duplicate id 'a-1'"),
    ("unknown domain", [json.dumps({**GOOD[0], "domain": "poetry"})], r"rel-1.jsonl:1.*unknown domain 'poetry'"),
    ("item is not an object", [json.dumps(GOOD[0]), "[1, 2]"], r"rel-1.jsonl:2: an item must be a JSON object"),
    ("unknown field", [json.dumps({**GOOD[0], "extra": 1})], r"unknown field\(s\) \['extra'\]"),
]


@pytest.mark.parametrize("lines,match", [c[1:] for c in PANEL_CASES], ids=[c[0] for c in PANEL_CASES])
def test_panel_bad_line_refused_with_file_and_line(tmp_path, lines, match):
    manifest = _panel_files(tmp_path, lines)
    with pytest.raises(PanelError, match=match):
        load_panel(manifest)


def test_published_panel_edited_in_place_is_refused(tmp_path):
    manifest = _panel_files(tmp_path, [json.dumps(g) for g in GOOD])
    assert len(load_panel(manifest).items) == 2
    items = tmp_path / "rel-1.jsonl"
    items.write_text(items.read_text().replace("Hello there.", "Hello there!"))
    with pytest.raises(PanelHashMismatch, match="does not match the published hash"):
        load_panel(manifest)


# ============================================================================================ references
@pytest.fixture()
def records():
    return pair_of_records(np.random.default_rng(3), n_seq=3, length=8, vocab=30, k_ref=30, k_eng=5)[:2]


def _with(rec: Record, **prov) -> Record:
    return dataclasses.replace(rec, provenance=dataclasses.replace(rec.provenance, **prov))


@pytest.mark.parametrize("change,match", [
    ({"panel_name": "other"}, r"panel unit@1 vs other@1"),
    ({"panel_version": "2"}, r"panel unit@1 vs unit@2"),
    ({"panel_hash": "q" * 64}, r"panel hash p{16} vs q{16}"),
    ({"tokenizer_hash": "u" * 64}, r"tokenizer hash t{16} vs u{16}"),
], ids=["other panel", "other panel version", "other panel content", "other tokenizer"])
def test_reference_of_another_panel_or_tokenizer_is_refused(records, change, match):
    ref, eng = records
    with pytest.raises(RecordMismatch, match=match):
        ref.check_compatible(_with(eng, **change))
    from core import metrics
    with pytest.raises(RecordMismatch):                    # the metrics refuse it too: no number comes out
        metrics.panel_metrics(ref, _with(eng, **change))


def test_reference_with_other_token_ids_names_sequence_and_position(records):
    ref, eng = records
    tok = eng.token_ids.copy()
    tok[int(eng.seq_offsets[1]) + 4] += 1
    with pytest.raises(RecordMismatch, match=r"sequence 's1' position 4: token ids differ"):
        ref.check_compatible(dataclasses.replace(eng, token_ids=tok))


def test_reference_of_another_format_version_is_refused(records, tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import load_file as np_load, save_file as np_save

    path = records[0].save(tmp_path / "ref.safetensors")
    with safe_open(str(path), framework="numpy") as f:
        meta = dict(f.metadata())
    np_save(np_load(str(path)), str(tmp_path / "v2.safetensors"), metadata={**meta, "format": "ds41-record/2"})
    with pytest.raises(RecordMismatch, match=r"record format 'ds41-record/2', this harness reads 'ds41-record/1'"):
        Record.load(tmp_path / "v2.safetensors")


@pytest.mark.parametrize("cut", [10, 200, -50], ids=["header cut", "metadata cut", "data cut"])
def test_truncated_record_file_is_refused(records, tmp_path, cut):
    path = records[0].save(tmp_path / "ref.safetensors")
    data = path.read_bytes()
    path.write_bytes(data[:cut] if cut > 0 else data[:cut])
    with pytest.raises(RecordError, match="not a readable record file"):
        Record.load(path)


def test_cached_reference_of_another_panel_is_refused(records, tmp_path, monkeypatch):
    """ensure_reference never hands a gate a cached reference built from other panel content."""
    from ds41gates import pipeline
    from panels import EncodedPanel, EncodedSequence

    monkeypatch.setenv("DS41_CACHE", str(tmp_path / "cache"))
    import oracle.hf
    monkeypatch.setattr(oracle.hf, "model_hash", lambda d: "m" * 64)
    ref = records[0]
    enc = EncodedPanel("unit", 1, "p" * 64, "t" * 64, tuple(EncodedSequence(
        sid, ref.domains[i], tuple(int(x) for x in ref.sequence_tokens(i)), tuple(bool(b) for b in ref.scored[
            ref.seq_offsets[i]:ref.seq_offsets[i + 1]])) for i, sid in enumerate(ref.seq_ids)))
    path = pipeline.reference_path(enc, "m" * 64)
    assert str(tmp_path / "cache") in str(path)
    _with(ref, panel_hash="p" * 63 + "x").save(path)          # same file name, other panel content
    with pytest.raises(RecordMismatch, match="cached reference does not match panel/tokenizer"):
        pipeline.ensure_reference(enc, tmp_path)
