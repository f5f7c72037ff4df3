"""`ds41gate oracle run | merge` on a generated tiny DeepSeek-V4.1 checkpoint (in-process, through the root app)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from ds41gates.cli import app
from core.records import Record
from oracle.dsv41.checkpoint import Checkpoint
from oracle.dsv41.runner import forward_in_memory
from panels import encoded_from_json

runner = CliRunner()
FIELDS = ("seq_offsets", "token_ids", "scored", "pos_seq", "pos_index", "topk_ids", "topk_logprobs", "actual_logprob",
          "actual_rank", "logsumexp")


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint) -> Path:
    return tiny_checkpoint(seed=2)


@pytest.fixture(scope="module")
def panel(tmp_path_factory) -> Path:
    g = torch.Generator().manual_seed(5)
    p = tmp_path_factory.mktemp("p") / "ids.json"
    p.write_text(json.dumps([torch.randint(0, 512, (n,), generator=g).tolist() for n in (25, 12, 31)]))
    return p


def oracle(*args: str):
    return runner.invoke(app, ["oracle", *args])


def same_arrays(a: Record, b: Record) -> bool:
    return a.seq_ids == b.seq_ids and all(np.array_equal(getattr(a, f), getattr(b, f)) for f in FIELDS)


@pytest.fixture(scope="module")
def reference(tiny, panel, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ref") / "ref.safetensors"
    r = oracle("run", "--checkpoint", str(tiny), "--panel", str(panel), "--out", str(out), "--threads", "1")
    assert r.exit_code == 0, r.output
    assert f"wrote {out}: 3 sequences, 65 scored positions" in r.output
    return out


def test_run_writes_an_oracle_record_equal_to_the_in_memory_forward(tiny, panel, reference):
    rec = Record.load(reference)
    pv = rec.provenance
    assert pv.side == "oracle" and pv.precision == "fp32" and rec.k == 256
    assert pv.source["checkpoint_hash"] == Checkpoint(tiny).provenance_hash()
    assert pv.panel_name == "ids" and pv.panel_hash.startswith("sha256:") and pv.tokenizer_hash == "pre-encoded"
    assert rec.logsumexp is not None and rec.full_logprobs is None
    assert not Path(str(reference) + ".work").exists()
    scores, _ = forward_in_memory(Checkpoint(tiny), encoded_from_json(panel), threads=1)
    assert same_arrays(rec, Record.from_sequences(pv, scores, k=256))


def test_a_record_is_a_pre_encoded_panel(tiny, reference, tmp_path):
    """--panel REC.safetensors scores the record's own sequences, keeping its panel identity."""
    out = tmp_path / "again.safetensors"
    r = oracle("run", "--checkpoint", str(tiny), "--panel", str(reference), "--out", str(out), "--threads", "1",
               "--spill", "disk", "--precision", "reference-bf16", "--work", str(tmp_path / "w"), "--keep-work")
    assert r.exit_code == 0, r.output
    a, b = Record.load(reference), Record.load(out)
    a.check_compatible(b)  # same panel hash, tokenizer hash, sequences
    assert b.provenance.precision == "reference-bf16" and not np.array_equal(a.logsumexp, b.logsumexp)
    assert (tmp_path / "w" / "manifest.json").is_file()  # --keep-work


def test_shard_runs_merge_into_the_unsharded_reference(tiny, panel, reference, tmp_path):
    shards = []
    for i in range(2):
        shards.append(tmp_path / f"shard{i}.safetensors")
        r = oracle("run", "--checkpoint", str(tiny), "--panel", str(panel), "--out", str(shards[-1]),
                   "--shard", f"{i}/2", "--threads", "1", "--no-progress")
        assert r.exit_code == 0, r.output
    assert Record.load(shards[0]).n_sequences == 2 and Record.load(shards[1]).n_sequences == 1
    merged = tmp_path / "merged.safetensors"
    r = oracle("merge", str(shards[1]), str(shards[0]), "--out", str(merged))
    assert r.exit_code == 0, r.output
    m, ref = Record.load(merged), Record.load(reference)
    assert same_arrays(m, ref) and m.provenance.source == ref.provenance.source
    r = oracle("merge", str(shards[0]), "--out", str(tmp_path / "bad.safetensors"))
    assert r.exit_code == 2 and "shards [1] of 2 are missing" in r.output
    r = oracle("merge", str(shards[0]), str(reference), "--out", str(tmp_path / "bad.safetensors"))
    assert r.exit_code == 2 and "not a shard record" in r.output


@pytest.mark.parametrize("args,message", [
    (["--shard", "2/2"], "need 0 <= I < N"),
    (["--shard", "x"], "expected I/N"),
    (["--precision", "bf16"], "precision 'bf16'"),
    (["--device", "tpu"], "device 'tpu'"),
])
def test_bad_options_exit_2_with_a_message(tiny, panel, tmp_path, args, message):
    r = oracle("run", "--checkpoint", str(tiny), "--panel", str(panel), "--out", str(tmp_path / "o.safetensors"), *args)
    assert r.exit_code == 2 and message in r.output, r.output


def test_named_panels_need_a_tokenizer_that_fits_the_checkpoint(tiny, tmp_path):
    out = str(tmp_path / "o.safetensors")
    r = oracle("run", "--checkpoint", str(tiny), "--panel", "default", "--out", out)
    assert r.exit_code == 2 and "has no tokenizer.json; pass --tokenizer" in r.output, r.output
    r = oracle("run", "--checkpoint", str(tiny), "--panel", "default", "--tokenizer", "smollm2", "--out", out)
    assert r.exit_code == 2 and "outside the checkpoint's vocabulary 0..511" in r.output, r.output
    r = oracle("run", "--checkpoint", str(tmp_path / "nope"), "--panel", "default", "--tokenizer", "smollm2", "--out", out)
    assert r.exit_code == 2 and "config.json" in r.output, r.output


def test_cuda_without_a_gpu_is_refused(tiny, panel, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    r = oracle("run", "--checkpoint", str(tiny), "--panel", str(panel), "--out", str(tmp_path / "o.safetensors"),
               "--device", "cuda")
    assert r.exit_code == 2 and "sees no CUDA device" in r.output, r.output


# The generic transformers oracle behind the same command, on the real SmolLM2 fp32 folder; the values are the
# independently published engines.md §12.7 table (4 decimals), not numbers this code produced.
SMOLLM2_CANARY = [504, 3575, 282, 4649, 314, 7042]   # "The capital of France is" + " Paris"
PUBLISHED = {2: (282, -0.3376, 1), 5: (7042, -0.2581, 1)}


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    from engine.models import ensure_smollm2

    return ensure_smollm2().hf_dir


def test_a_transformers_folder_runs_through_the_same_command(smollm2_dir, tmp_path):
    from oracle.kinds import oracle_kind_of

    assert oracle_kind_of(smollm2_dir).name == "transformers"
    panel = tmp_path / "canary.json"
    panel.write_text(json.dumps([SMOLLM2_CANARY]))
    out = tmp_path / "smollm2.safetensors"
    r = oracle("run", "--checkpoint", str(smollm2_dir), "--panel", str(panel), "--out", str(out), "--top-k", "20")
    assert r.exit_code == 0, r.output
    assert f"wrote {out}: 1 sequences, 5 scored positions (transformers fp32" in r.output
    rec = Record.load(out)
    assert rec.provenance.side == "oracle" and rec.provenance.extra["oracle"] == "oracle.hf" and rec.k == 20
    for pos, (actual, logprob, rank) in PUBLISHED.items():
        row = int(np.flatnonzero(rec.pos_index == pos)[0])
        assert int(rec.token_ids[pos]) == actual
        assert round(float(rec.actual_logprob[row]), 4) == logprob and int(rec.actual_rank[row]) == rank
    assert not out.with_name(out.name + ".work").exists()   # per-sequence state removed after success


@pytest.mark.parametrize("args,message", [
    (["--precision", "reference-bf16"], "--precision: DeepSeek-oracle options"),
    (["--shard", "0/2"], "--shard: DeepSeek-oracle options"),
    (["--implementation", "jax"], "--implementation 'jax': must be one of auto, deepseek, transformers"),
])
def test_transformers_folder_refuses_deepseek_only_options(smollm2_dir, tmp_path, args, message):
    panel = tmp_path / "p.json"
    panel.write_text(json.dumps([SMOLLM2_CANARY]))
    r = oracle("run", "--checkpoint", str(smollm2_dir), "--panel", str(panel), "--out", str(tmp_path / "o"), *args)
    assert r.exit_code == 2 and message in r.output, r.output


def test_implementation_detection(tiny, tmp_path):
    from oracle.kinds import oracle_kind_of

    assert oracle_kind_of(tiny).name == "deepseek"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4", "hidden_size": 8}))
    assert oracle_kind_of(tmp_path).name == "deepseek"
    (tmp_path / "config.json").write_text("[1, 2]")
    r = oracle("run", "--checkpoint", str(tmp_path), "--panel", "x.json", "--out", str(tmp_path / "o"))
    assert r.exit_code == 2 and "config.json: the model config must be a JSON object" in r.output
    r = oracle("run", "--checkpoint", str(tmp_path / "none"), "--panel", "x.json", "--out", str(tmp_path / "o"))
    assert r.exit_code == 2 and "no config.json" in r.output
