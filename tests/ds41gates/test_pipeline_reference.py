"""pipeline.ensure_reference: the reference is saved once, under the identity of the oracle that wrote it
(oracle name + what it loads + precision), never under another oracle's hash."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from ds41gates import pipeline

ENC = SimpleNamespace(panel_name="unit", panel_version=1, panel_hash="sha256:" + "a" * 64,
                      tokenizer_hash="sha256:" + "b" * 64, sequences=(object(),) * 3)


class _Built:
    """Stands in for the oracle's record: counts where it is saved."""

    def __init__(self):
        self.saved: list[Path] = []

    def save(self, path):
        self.saved.append(Path(path))
        Path(path).parent.mkdir(parents=True, exist_ok=True)   # as Record.save does
        Path(path).write_bytes(b"record")


def test_the_transformers_reference_is_saved_once_under_its_weights_hash(tmp_path, monkeypatch):
    import oracle.hf

    monkeypatch.setenv("DS41_CACHE", str(tmp_path / "cache"))
    built = _Built()
    calls = []

    def score(self, encoded):   # the Oracle seam of the transformers kind, as the registry built it
        calls.append((self.model_dir, self.threads, self.top_k, self.checkpoint_dir, encoded))
        return built

    monkeypatch.setattr(oracle.hf, "model_hash", lambda d: "f" * 64)
    monkeypatch.setattr(oracle.hf.HFPanelOracle, "score", score)
    ref, path = pipeline.ensure_reference(ENC, tmp_path / "model")
    assert ref is built and built.saved == [path]
    assert calls == [(tmp_path / "model", 1, pipeline.ORACLE_TOP_K, path.with_suffix(".partial.d"), ENC)]
    assert path.name == "unit@1-aaaaaaaaaaaa-tokbbbbbbbbbbbb-transformers-ffffffffffff-fp32-k256.safetensors"


def test_the_deepseek_reference_is_saved_once_under_the_checkpoint_identity(tmp_path, monkeypatch):
    from engine.dsv4_model import ensure_dsv4_tiny
    from oracle.dsv41 import runner
    from oracle.dsv41.checkpoint import Checkpoint
    from oracle.hf import model_hash

    model_dir = Path(ensure_dsv4_tiny())
    monkeypatch.setenv("DS41_CACHE", str(tmp_path / "cache"))
    built, calls = _Built(), []

    def run_panel(ck, encoded, work, opts, token_map=None):
        calls.append((ck.dir, opts.precision, opts.threads, opts.top_k))
        (work / "layer-activations").mkdir(parents=True)   # what the runner leaves for resuming
        return built

    monkeypatch.setattr(runner, "run_panel", run_panel)
    _, path = pipeline.ensure_reference(ENC, model_dir, oracle="deepseek")
    identity = runner.checkpoint_identity(Checkpoint(model_dir))   # the provenance's checkpoint_hash
    assert built.saved == [path] and calls == [(model_dir, "fp32", 1, pipeline.ORACLE_TOP_K)]
    assert path.name == f"unit@1-aaaaaaaaaaaa-tokbbbbbbbbbbbb-deepseek-{identity[:12]}-fp32-k256.safetensors"
    assert model_hash(model_dir)[:12] not in path.name           # not the transformers oracle's identity
    assert not path.with_suffix(".partial.d").exists()           # activations dropped once the record is saved


def test_an_unknown_oracle_or_precision_is_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="oracle 'jax'"):
        pipeline.ensure_reference(ENC, tmp_path, oracle="jax")
    with pytest.raises(ValueError, match="precision 'bf16'"):
        pipeline.ensure_reference(ENC, tmp_path, oracle="deepseek", precision="bf16")
    with pytest.raises(ValueError, match="precision 'reference-bf16'"):   # runs in it, but no gate reference
        pipeline.ensure_reference(ENC, tmp_path, oracle="deepseek", precision="reference-bf16")


def test_the_long_context_reference_is_refused_for_a_kind_without_one(tmp_path):
    with pytest.raises(ValueError, match="long-context reference needs an oracle that has one \\(\\['deepseek'\\]\\); "
                                         "this target uses 'transformers'"):
        pipeline.ensure_long_reference(ENC, tmp_path, oracle="transformers")
