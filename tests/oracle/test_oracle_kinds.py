"""oracle.kinds: each oracle kind registered once; names, precisions, detection and floors asked of it."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest

from core.errors import UserError
from oracle.kinds import DEEPSEEK, ORACLE_KINDS, TRANSFORMERS, OracleKindError, oracle_kind, oracle_kind_of


def test_importing_the_registries_loads_no_oracle_and_no_adapter():
    # the profile parser validates against both at parse time; neither may pull torch or an adapter in
    code = ("import sys, oracle.kinds, engine.adapters; "
            "print(sorted(m for m in ('torch', 'transformers', 'oracle.hf', 'oracle.dsv41', 'engine.adapters.vllm', "
            "'engine.adapters.llamacpp', 'engine.adapters.sglang') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_each_kind_is_registered_once_under_its_name():
    assert sorted(ORACLE_KINDS) == ["deepseek", "transformers"]
    assert all(kind.name == name for name, kind in ORACLE_KINDS.items())
    assert oracle_kind("deepseek") is DEEPSEEK and oracle_kind("transformers") is TRANSFORMERS
    # a gate reference is fp32 only; the DeepSeek oracle also runs (and captures) in the reference's bf16 order
    assert TRANSFORMERS.gate_precisions == DEEPSEEK.gate_precisions == ("fp32",)
    assert DEEPSEEK.run_precisions == ("fp32", "reference-bf16") and TRANSFORMERS.run_precisions == ("fp32",)
    assert (TRANSFORMERS.identity_field, DEEPSEEK.identity_field) == ("model_hash", "checkpoint_hash")


def test_an_unknown_kind_is_one_line_naming_where_and_the_kinds():
    with pytest.raises(OracleKindError) as exc:
        oracle_kind("deepsek", "profiles/x.toml [gate]: oracle")
    assert isinstance(exc.value, UserError) and isinstance(exc.value, ValueError)
    assert str(exc.value) == "profiles/x.toml [gate]: oracle 'deepsek': expected one of ['deepseek', 'transformers']"
    with pytest.raises(OracleKindError, match="oracle None"):
        oracle_kind(None)


def test_precisions_outside_a_kind_are_refused_by_name():
    with pytest.raises(OracleKindError, match="precision 'bf16': the deepseek oracle's gate reference is built in"):
        DEEPSEEK.check_gate_precision("bf16")
    with pytest.raises(OracleKindError, match="capture precision 'fp64': the deepseek oracle computes in"):
        DEEPSEEK.capturer("/nowhere", "fp64")
    with pytest.raises(OracleKindError, match="capture precision 'reference-bf16': the transformers oracle"):
        TRANSFORMERS.capturer("/nowhere", "reference-bf16")


def test_the_floor_precision_follows_the_kind_and_the_engine_dtype():
    assert [TRANSFORMERS.floor_precision(d) for d in ("float32", "fp32", "bfloat16", "float16")] == \
        ["fp64", "fp64", "bf16", "bf16"]
    assert {DEEPSEEK.floor_precision(d) for d in ("float32", "bfloat16")} == {"reference-bf16"}
    for kind in ORACLE_KINDS.values():   # the floor is a run the kind can capture
        assert {kind.floor_precision(d) for d in ("float32", "bfloat16")} <= set(kind.capture_precisions)


@pytest.mark.parametrize("config, kind", [
    ({"vocab_size": 129280, "dim": 4096}, "deepseek"),          # DeepSeek's inference config: no model_type
    ({"model_type": "deepseek_v4"}, "deepseek"),
    ({"model_type": "DeepSeek_V3"}, "deepseek"),
    ({"model_type": "llama"}, "transformers"),
    ({"model_type": "idefics3"}, "transformers"),
])
def test_a_model_folder_goes_to_the_kind_its_config_names(tmp_path, config, kind):
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert oracle_kind_of(tmp_path).name == kind


def test_a_folder_without_a_usable_config_is_a_named_error(tmp_path):
    with pytest.raises(OracleKindError, match="config.json: no config.json: --checkpoint must be a model folder"):
        oracle_kind_of(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(OracleKindError, match="the model config must be a JSON object"):
        oracle_kind_of(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(OracleKindError, match="cannot read the model config"):
        oracle_kind_of(tmp_path)


def test_the_transformers_identity_is_the_hash_over_its_weight_files(tmp_path):
    (tmp_path / "b.safetensors").write_bytes(b"second")
    (tmp_path / "a.safetensors").write_bytes(b"first")
    (tmp_path / "notes.txt").write_bytes(b"not a weight")
    expected = hashlib.sha256(b"".join(
        name.encode() + b"\0" + hashlib.sha256(data).hexdigest().encode() + b"\n"
        for name, data in (("a.safetensors", b"first"), ("b.safetensors", b"second")))).hexdigest()
    ident = TRANSFORMERS.identity(tmp_path)
    assert (ident.kind, ident.value, ident.loaded) == ("transformers", expected, None)


def test_the_deepseek_identity_is_the_checkpoint_hash_its_records_carry(tmp_path):
    """The identity names the reference file; it must be what the runner writes as provenance checkpoint_hash,
    and the Oracle the kind builds must score with the precision and top-k asked."""
    from oracle.dsv41.tiny import write_tiny_checkpoint
    from panels.pre_encoded import encoded_from_json

    ck_dir = write_tiny_checkpoint(tmp_path / "ck", seed=0)
    ident = DEEPSEEK.identity(ck_dir)
    vocab = ident.loaded.model_config.vocab_size
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps({"panel_name": "unit", "sequences": [
        {"seq_id": "s0", "token_ids": [i % vocab for i in range(1, 12)]}]}))
    rec = DEEPSEEK.oracle(ident, ck_dir, tmp_path / "work", precision="reference-bf16", top_k=8).score(
        encoded_from_json(ids))
    assert rec.provenance.source["checkpoint_hash"] == ident.value
    assert rec.provenance.precision == "reference-bf16" and rec.k == 8


def test_the_floor_capturer_copies_the_fp32_load_and_computes_in_its_own_precision(monkeypatch):
    """The localizer's two oracle runs of a transformers model: fp32, then the floor from a copy of that load
    (the weights neither read nor hashed again), each in its own dtype."""
    import torch

    from engine.models import ensure_smollm2
    from oracle.hf import HFOracle

    model_dir = ensure_smollm2().hf_dir
    ids = [504, 3575, 282, 4649, 314]
    fp32 = TRANSFORMERS.capturer(model_dir, "fp32")
    a = fp32.capture(ids)
    monkeypatch.setattr(HFOracle, "load", classmethod(lambda *a, **k: pytest.fail("loaded again")))
    floor = TRANSFORMERS.capturer(model_dir, TRANSFORMERS.floor_precision("float32"), base=fp32)
    b = floor.capture(ids)
    assert (fp32.info["dtype"], floor.info["dtype"]) == ("float32", "float64")
    assert a.keys() == b.keys() and "logits" in a
    assert not torch.equal(a["logits"], b["logits"])                       # a different rounding ...
    assert torch.allclose(a["logits"], b["logits"], rtol=0, atol=1e-3)    # ... of the same model
    assert fp32.load_s > 0 and fp32.forward_s > 0 and floor.forward_s > 0
    assert torch.equal(fp32.capture(ids)["logits"], a["logits"])   # the copy left the fp32 load as it was
