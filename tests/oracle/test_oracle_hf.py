"""The generic fp32 transformers oracle on the real SmolLM2 HF fp32 directory (engines.md §12.5, §12.7).

Reference values are the independently published §12.7 table (4 decimals), not numbers this code produced.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from core.records import Record
from engine.models import ensure_smollm2
from oracle.hf import HFOracle, OracleError, model_hash, score_panel_hf
from panels import EncodedPanel, EncodedSequence

CANARY = (504, 3575, 282, 4649, 314)
PARIS = 7042


def _panel(*seqs: tuple[str, tuple[int, ...]]) -> EncodedPanel:
    return EncodedPanel("oracle-unit", 1, "a" * 64, "b" * 64, tuple(
        EncodedSequence(sid, "prose", ids, (False,) + (True,) * (len(ids) - 1)) for sid, ids in seqs))


@pytest.fixture(scope="module")
def hf_dir():
    return ensure_smollm2().hf_dir


@pytest.fixture(scope="module")
def oracle(hf_dir):
    return HFOracle.load(hf_dir, threads=2)


@pytest.fixture(scope="module")
def canary_record(hf_dir, oracle) -> Record:
    return score_panel_hf(hf_dir, _panel(("canary", CANARY + (PARIS,))), top_k=256, full_vocab=True, oracle=oracle)


def _row(rec: Record, pos: int) -> int:
    return int(np.flatnonzero(rec.pos_index == pos)[0])


@pytest.mark.parametrize("pos,actual,logprob,rank", [
    (1, 3575, -11.5393, 2923),   # " capital"
    (2, 282, -0.3376, 1),        # " of"
    (3, 4649, -2.4387, 2),       # " France"
    (4, 314, -0.4510, 1),        # " is"
    (5, PARIS, -0.2581, 1),      # next token " Paris"
])
def test_published_reference_values(canary_record, pos, actual, logprob, rank):
    r = _row(canary_record, pos)
    assert canary_record.actual_ids()[r] == actual
    assert abs(canary_record.actual_logprob[r] - logprob) <= 1e-4
    assert canary_record.actual_rank[r] == rank


@pytest.mark.parametrize("pos,top", [
    (1, [(29, -0.8655), (28, -2.6533), (198, -3.1515), (79, -3.3041)]),
    (3, [(260, -2.1845), (4649, -2.4387), (7476, -3.4855)]),
    (5, [(PARIS, -0.2581), (260, -2.7407), (4528, -4.3844), (2250, -4.6199), (1315, -4.6778)]),
])
def test_published_top_entries(canary_record, pos, top):
    r = _row(canary_record, pos)
    ids = [int(x) for x in canary_record.topk_ids[r, :len(top)]]
    assert ids == [t for t, _ in top]
    assert np.allclose(canary_record.topk_logprobs[r, :len(top)], [v for _, v in top], atol=1e-4, rtol=0)


def test_record_is_internally_consistent(canary_record):
    rec = canary_record
    assert rec.k == 256 and rec.provenance.side == "oracle" and rec.provenance.precision == "fp32"
    full = rec.full_logprobs.astype(np.float64)
    assert full.shape == (5, 49152)
    # full row normalises; top-K is the sorted head of the full row; actual value and rank agree with it
    assert np.allclose(np.logaddexp.reduce(full, axis=1), 0.0, atol=1e-5)
    for r in range(rec.n_positions):
        order = np.argsort(-full[r], kind="stable")[:256]
        assert np.array_equal(np.sort(order[:200]), np.sort(rec.topk_ids[r, :200]))
        a = rec.actual_ids()[r]
        assert abs(full[r, a] - rec.actual_logprob[r]) < 1e-5
        assert rec.actual_rank[r] == 1 + int((rec.topk_logprobs[r] > rec.actual_logprob[r]).sum()) \
            or rec.actual_rank[r] > 256
        assert np.all(np.diff(rec.topk_logprobs[r]) <= 0)
    assert rec.logsumexp is not None and np.all(np.isfinite(rec.logsumexp))


def test_deterministic_bitwise(oracle):
    seq = _panel(("d", CANARY)).sequences[0]
    a = oracle.score_sequence(seq, top_k=64)
    b = oracle.score_sequence(seq, top_k=64)
    assert np.array_equal(a.topk_logprobs, b.topk_logprobs) and np.array_equal(a.topk_ids, b.topk_ids)
    assert np.array_equal(a.actual_logprob, b.actual_logprob) and np.array_equal(a.logsumexp, b.logsumexp)


def test_provenance_names_the_weights(canary_record, hf_dir):
    src = canary_record.provenance.source
    inner = hashlib.sha256((hf_dir / "model.safetensors").read_bytes()).hexdigest()
    expect = hashlib.sha256(b"model.safetensors\0" + inner.encode() + b"\n").hexdigest()
    assert src["model_hash"] == expect == model_hash(hf_dir)
    assert src["model_dir"] == str(hf_dir.resolve())
    assert canary_record.provenance.panel_hash == "a" * 64 and canary_record.provenance.tokenizer_hash == "b" * 64
    assert canary_record.provenance.extra["log_softmax_dtype"] == "float64"
    # the vocabulary travels with the record (config.json's vocab_size, read here independently), so a loaded
    # record with an id outside it is refused
    assert canary_record.vocab_size() == json.loads((hf_dir / "config.json").read_text())["vocab_size"]


def test_checkpoints_resume_and_ignore_stale(hf_dir, oracle, tmp_path):
    panel = _panel(("x", CANARY), ("y", (1, 504, 3575)))
    first = score_panel_hf(hf_dir, panel, top_k=16, oracle=oracle, checkpoint_dir=tmp_path)
    assert first.provenance.extra["resumed_sequences"] == 0 and len(list(tmp_path.glob("*.safetensors"))) == 2
    again = score_panel_hf(hf_dir, panel, top_k=16, oracle=oracle, checkpoint_dir=tmp_path)
    assert again.provenance.extra["resumed_sequences"] == 2
    assert np.array_equal(first.topk_logprobs, again.topk_logprobs)
    changed = _panel(("x", CANARY[:4] + (282,)), ("y", (1, 504, 3575)))
    third = score_panel_hf(hf_dir, changed, top_k=16, oracle=oracle, checkpoint_dir=tmp_path)
    assert third.provenance.extra["resumed_sequences"] == 1   # x's checkpoint holds other tokens


def test_scores_only_masked_positions(hf_dir, oracle):
    seq = EncodedSequence("m", "prose", CANARY, (False, False, True, False, True))
    rec = score_panel_hf(hf_dir, EncodedPanel("m", 1, "c" * 64, "d" * 64, (seq,)), top_k=8, oracle=oracle)
    assert list(rec.pos_index) == [2, 4]
    assert abs(rec.actual_logprob[0] + 0.3376) < 1e-4 and abs(rec.actual_logprob[1] + 0.4510) < 1e-4


def test_errors_name_sequence_and_position(hf_dir, oracle):
    with pytest.raises(OracleError, match=r"sequence 'bad' position 2: id 99999"):
        score_panel_hf(hf_dir, _panel(("bad", (504, 3575, 99999))), top_k=8, oracle=oracle)
    with pytest.raises(OracleError, match="no config.json"):
        HFOracle.load(hf_dir.parent)


def test_the_oracle_seam_rescores_the_panel_a_record_was_made_from(hf_dir, oracle, canary_record):
    """oracle.seam.Oracle: HFPanelOracle.score(panel) on the panel recovered from a record reproduces it."""
    from oracle import Oracle
    from oracle.hf import HFPanelOracle
    from panels import encoded_from_record

    seam = HFPanelOracle(hf_dir, top_k=256, full_vocab=True, oracle=oracle)
    assert isinstance(seam, Oracle)
    again = seam.score(encoded_from_record(canary_record))
    for name in ("token_ids", "scored", "topk_ids", "topk_logprobs", "actual_logprob", "actual_rank", "logsumexp",
                 "full_logprobs"):
        assert np.array_equal(getattr(again, name), getattr(canary_record, name)), name
    for k in ("side", "panel_name", "panel_version", "panel_hash", "tokenizer_hash", "source", "precision"):
        assert getattr(again.provenance, k) == getattr(canary_record.provenance, k), k
