"""Depth buckets, the mechanism bitmask and its summary, and the record's optional `mechanisms` array (issue 39)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from core.coverage import (MECHANISM_NAMES, Coverage, CoverageError, Mechanism, coverage_of, coverage_of_record,
                           decode, encode, live)
from core.depth import (BUCKET_LABELS, DEPTH_LABELS, DepthError, bucket_members, bucket_of, bucket_range,
                        buckets_of, depth_indices, labels_reached)
from core.records import Record, RecordError
from tests.core.recordkit import provenance, random_logprobs, sequence_from_full


def test_bucket_labels_and_edges():
    assert DEPTH_LABELS == ("d0-128", "d128-2K", "d2K-8K", "d8K-32K", "d32K-128K", "d128K+")
    assert BUCKET_LABELS[-1] == "last256"
    cases = {0: "d0-128", 127: "d0-128", 128: "d128-2K", 2047: "d128-2K", 2048: "d2K-8K", 8191: "d2K-8K",
             8192: "d8K-32K", 32768: "d32K-128K", 131071: "d32K-128K", 131072: "d128K+", 999_999: "d128K+"}
    for pos, label in cases.items():
        assert bucket_of(pos, 1_000_000) == label, pos
    assert list(depth_indices(np.array(list(cases)))) == [DEPTH_LABELS.index(v) for v in cases.values()]
    assert bucket_range("d2K-8K") == (2048, 8192) and bucket_range("d128K+") == (131072, None)


def test_tail_overlay_and_errors():
    assert buckets_of(3839, 4096) == ("d2K-8K",)
    assert buckets_of(3840, 4096) == ("d2K-8K", "last256")
    assert buckets_of(10, 50) == ("d0-128", "last256")
    members = bucket_members(np.array([5, 3840, 4095, 200]), np.array([4096, 4096, 4096, 300]))
    assert members["last256"].tolist() == [False, True, True, True]
    assert members["d128-2K"].tolist() == [False, False, False, True]
    assert labels_reached(3000) == ("d0-128", "d128-2K", "d2K-8K", "last256")
    with pytest.raises(DepthError, match="position 4096 is outside a sequence of 4096"):
        bucket_of(4096, 4096)
    with pytest.raises(DepthError, match="unknown depth bucket 'd9'"):
        bucket_range("d9")


def test_mask_encoding_round_trips_by_name():
    mask = encode([Mechanism.COMPRESSED_R4, "indexer_pruning"])
    assert mask == (1 << 1) | (1 << 3)
    assert decode(mask) == {Mechanism.COMPRESSED_R4, Mechanism.INDEXER_PRUNING}
    # a record may name its bits in another order: decoding goes by its names
    reordered = list(reversed(MECHANISM_NAMES))
    assert decode(1, reordered) == {Mechanism.ENGRAM_LOOKUP}
    assert live(np.array([1, 2]), "engram_lookup", reordered).tolist() == [True, False]
    assert live(np.array([1, 2]), "dspark_taps", ["window_full_evicting"]).tolist() == [False, False]
    with pytest.raises(CoverageError, match="unknown mechanism 'flash'"):
        encode(["flash"])
    with pytest.raises(CoverageError, match="sets bits outside"):
        decode(1 << 6)


def test_coverage_counts_per_bucket():
    w, r4, idx = (encode([m]) for m in ("window_full_evicting", "compressed_r4", "indexer_pruning"))
    positions = np.array([50, 200, 1000, 2100, 3000, 4000])
    masks = np.array([0, w, w | r4, w | r4 | idx, w | r4 | idx, w | r4 | idx], dtype=np.int64)
    cov = coverage_of(masks, positions, np.full(6, 4096))
    assert cov.total_scored == 6
    assert cov.scored["d0-128"] == 1 and cov.scored["d128-2K"] == 2 and cov.scored["d2K-8K"] == 3
    assert cov.scored["last256"] == 1
    assert cov.live["indexer_pruning"] == {**{b: 0 for b in BUCKET_LABELS}, "d2K-8K": 3, "last256": 1}
    assert cov.total_live["window_full_evicting"] == 5
    assert cov.exercised("compressed_r4") and not cov.exercised(Mechanism.COMPRESSED_R128)
    assert cov.not_exercised(["compressed_r128", "indexer_pruning", "engram_lookup"]) == [
        "compressed_r128", "engram_lookup"]
    assert Coverage.from_dict(json.loads(json.dumps(cov.to_dict()))) == cov
    with pytest.raises(CoverageError, match="unknown key 'd3'"):
        Coverage.from_dict({**cov.to_dict(), "scored": {"d3": 1}})


def _record_with_mechanisms(masks):
    rng = np.random.default_rng(0)
    seq = sequence_from_full("s0", "code", rng.integers(0, 16, size=5), random_logprobs(rng, 4, 16), k=3)
    seq.mechanisms = np.asarray(masks, dtype=np.int64)
    return Record.from_sequences(provenance(), [seq])


def test_record_carries_mechanisms_through_save_and_load(tmp_path):
    rec = _record_with_mechanisms([0, 1, 3, 8])
    assert rec.mechanism_names == list(MECHANISM_NAMES)
    path = rec.save(tmp_path / "r.safetensors")
    back = Record.load(path)
    assert back.mechanisms.tolist() == [0, 1, 3, 8] and back.mechanism_names == list(MECHANISM_NAMES)
    assert back.subset(["s0"]).mechanisms.tolist() == [0, 1, 3, 8]
    cov = coverage_of_record(back)
    assert cov.total_live["window_full_evicting"] == 2 and cov.total_live["indexer_pruning"] == 1
    # without mechanisms a record neither stores the array nor the names, and its hash is as before
    plain = _record_with_mechanisms([0, 0, 0, 0])
    plain.mechanisms, plain.mechanism_names = None, None
    plain.save(tmp_path / "p.safetensors")
    with safe_open(str(tmp_path / "p.safetensors"), framework="numpy") as f:
        assert "mechanism_names" not in f.metadata() and "mechanisms" not in f.keys()
    assert coverage_of_record(Record.load(tmp_path / "p.safetensors")) is None


def test_record_refuses_bad_mechanisms(tmp_path):
    with pytest.raises(RecordError, match="mechanisms has shape"):
        _record_with_mechanisms([0, 1])
    rec = _record_with_mechanisms([0, 1, 3, 8])
    rec.mechanisms = np.array([0, 1, 3, 1 << 7], dtype=np.int64)
    with pytest.raises(RecordError, match="sets bits outside the 6 named"):
        rec.save(tmp_path / "bad.safetensors")
    good = _record_with_mechanisms([0, 1, 3, 8]).save(tmp_path / "good.safetensors")
    # a file whose names were dropped (or renamed) after writing is refused: the names are hashed
    with safe_open(str(good), framework="numpy") as f:
        meta = dict(f.metadata())
    arrays = load_file(str(good))
    meta["mechanism_names"] = json.dumps(list(reversed(MECHANISM_NAMES)))
    save_file(arrays, str(tmp_path / "edited.safetensors"), metadata=meta)
    with pytest.raises(RecordError, match="do not match its content_sha256"):
        Record.load(tmp_path / "edited.safetensors")
    del meta["mechanism_names"]
    save_file(arrays, str(tmp_path / "nameless.safetensors"), metadata=meta)
    with pytest.raises(RecordError):
        Record.load(tmp_path / "nameless.safetensors")
    meta["mechanism_names"] = json.dumps(["window_full_evicting", "warp"])
    save_file(arrays, str(tmp_path / "unknown.safetensors"), metadata=meta)
    with pytest.raises(RecordError):
        Record.load(tmp_path / "unknown.safetensors")
