import os

import numpy as np
import pytest

from core.records import FORMAT_VERSION, Record, RecordError, RecordMismatch
from tests.core.recordkit import pair_of_records, provenance


def test_roundtrip_preserves_every_array_and_provenance(tmp_path):
    ref, _, _ = pair_of_records(np.random.default_rng(0), ref_full=True)
    path = ref.save(tmp_path / "ref.safetensors")
    back = Record.load(path)
    assert back.provenance == ref.provenance
    assert back.seq_ids == ref.seq_ids and back.domains == ref.domains and back.k == ref.k
    for name in ("seq_offsets", "token_ids", "scored", "pos_seq", "pos_index", "topk_ids", "topk_logprobs",
                 "actual_logprob", "actual_rank", "full_logprobs"):
        np.testing.assert_array_equal(getattr(back, name), getattr(ref, name))


def test_to_frame_has_one_row_per_scored_position():
    ref, _, _ = pair_of_records(np.random.default_rng(0), n_seq=3, length=9)
    frame = ref.to_frame()
    assert len(frame) == 3 * 8
    assert set(frame["domain"]) == {"a", "b"}
    row = frame.iloc[9]  # sequence 1, position 2
    assert row["seq_id"] == "s1" and row["position"] == 2
    assert row["actual_id"] == ref.sequence_tokens(1)[2]


def test_save_is_atomic_and_leaves_no_partial_file(tmp_path, monkeypatch):
    ref, _, _ = pair_of_records(np.random.default_rng(0))
    target = tmp_path / "ref.safetensors"
    ref.save(target)
    before = target.read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        ref.save(target)
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["ref.safetensors"]


def test_truncated_file_gives_a_clear_error(tmp_path):
    ref, _, _ = pair_of_records(np.random.default_rng(0))
    path = ref.save(tmp_path / "ref.safetensors")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(RecordError, match="not a readable record file"):
        Record.load(path)


def test_other_format_version_is_refused(tmp_path):
    from safetensors.numpy import save_file

    ref, _, _ = pair_of_records(np.random.default_rng(0))
    path = tmp_path / "old.safetensors"
    save_file({"token_ids": ref.token_ids}, str(path), metadata={"format": "ds41-record/0"})
    with pytest.raises(RecordMismatch, match=f"this harness reads '{FORMAT_VERSION}'"):
        Record.load(path)


@pytest.mark.parametrize("field,value,match", [
    ("panel_hash", "x" * 64, "panel hash"),
    ("tokenizer_hash", "y" * 64, "tokenizer hash"),
])
def test_records_of_another_panel_or_tokenizer_are_refused(field, value, match):
    ref, _, _ = pair_of_records(np.random.default_rng(0))
    _, eng, _ = pair_of_records(np.random.default_rng(0))
    eng.provenance = provenance("engine", **{field: value})
    with pytest.raises(RecordMismatch, match=match):
        ref.check_compatible(eng)


def test_position_zero_cannot_be_scored():
    from core.records import SequenceScores

    with pytest.raises(RecordError, match="position 0"):
        Record.from_sequences(provenance(), [SequenceScores(
            "z", "d", np.array([1, 2]), np.array([True, True]), np.zeros((2, 1), int), np.zeros((2, 1)),
            np.zeros(2), np.ones(2, int))])


def test_clamped_engine_values_are_stored_as_minus_infinity():
    from core.records import SequenceScores

    rec = Record.from_sequences(provenance("engine"), [SequenceScores(
        "c", "d", np.array([1, 2]), np.array([False, True]), np.array([[2, 3]]), np.array([[-0.01, -9999.0]]),
        np.array([-0.01]), np.array([1]))])
    assert rec.topk_logprobs[0, 1] == -np.inf


def test_subset_equals_a_record_built_from_those_sequences_only():
    from tests.core.recordkit import sequence_from_full, random_logprobs

    rng = np.random.default_rng(3)
    seqs = []
    for s in range(4):
        tokens = rng.integers(0, 30, size=5 + s)
        seqs.append(sequence_from_full(f"s{s}", "ab"[s % 2], tokens, random_logprobs(rng, 4 + s, 30), 6))
    whole = Record.from_sequences(provenance(), seqs)
    direct = Record.from_sequences(provenance(), [seqs[1], seqs[3]])
    sub = whole.subset(["s3", "s1"])
    assert sub.seq_ids == ["s1", "s3"] and sub.domains == direct.domains
    for name in ("seq_offsets", "token_ids", "scored", "pos_seq", "pos_index", "topk_ids", "topk_logprobs",
                 "actual_logprob", "actual_rank"):
        np.testing.assert_array_equal(getattr(sub, name), getattr(direct, name))
    with pytest.raises(RecordError, match="s9"):
        whole.subset(["s9"])
