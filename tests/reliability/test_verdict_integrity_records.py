"""Verdict integrity, records side (issue 27): records are whole or refused.

* a record without ``content_sha256`` is refused on load, the message naming the explicit way to re-hash a
  trusted file (``ds41gate rehash PATH``; ``Record.load(..., trust_unhashed=True)``) — before,
  any edit of such a file gave a silent, different number;
* arrays of another dtype than the format's (float16 logprobs, int32 ids) are refused — before, only the
  dtype kind was checked;
* an engine record's ids are checked against the reference's vocabulary (an id of 10^9 was scored) and two
  records whose vocabulary sizes disagree are not compared.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from core import metrics
from core.records import Provenance, Record, RecordError, RecordMismatch, _content_sha256
from tests.core.recordkit import pair_of_records

REPO = Path(__file__).resolve().parents[2]
VOCAB = 50


def _pair(tmp_path: Path, **kw):
    ref, eng, _ = pair_of_records(np.random.default_rng(7), n_seq=3, length=9, vocab=VOCAB, k_ref=VOCAB, k_eng=5,
                                  ref_full=True, **kw)
    return ref.save(tmp_path / "ref.safetensors"), eng.save(tmp_path / "eng.safetensors")


def _rewrite(path: Path, arrays=None, drop_meta=(), meta_update=None, rehash=False) -> Path:
    """Write ``path`` again with arrays / metadata changed (what an edit by another tool does)."""
    with safe_open(str(path), framework="numpy") as f:
        meta = dict(f.metadata())
    tensors = load_file(str(path))
    tensors.update(arrays or {})
    for key in drop_meta:
        meta.pop(key, None)
    meta.update(meta_update or {})
    if rehash:
        meta["content_sha256"] = _content_sha256(tensors, json.loads(meta["seq_ids"]), json.loads(meta["domains"]),
                                                 int(meta["k"]))
    save_file(tensors, str(path), metadata=meta)
    return path


def _kl(ref_path: Path, eng_path: Path) -> np.ndarray:
    return metrics.position_metrics(Record.load(ref_path), Record.load(eng_path)).kl_part


# ============================================================================================ content_sha256
def test_record_without_content_sha256_is_refused_with_the_rehash_command(tmp_path):
    ref_path, eng_path = _pair(tmp_path)
    _rewrite(eng_path, drop_meta=["content_sha256"])
    with pytest.raises(RecordError) as ei:
        Record.load(eng_path)
    msg = str(ei.value)
    assert str(eng_path) in msg and "content_sha256" in msg and "\n" not in msg
    assert f"ds41gate rehash {eng_path}" in msg and "trust_unhashed=True" in msg


def test_an_edit_of_an_unhashed_record_gives_no_number(tmp_path):
    """The attack: drop the hash, edit a logprob. Before, the edit was scored as a valid, different number."""
    ref_path, eng_path = _pair(tmp_path)
    before = _kl(ref_path, eng_path)
    lp = load_file(str(eng_path))["actual_logprob"].copy()
    lp[3] -= 0.25
    _rewrite(eng_path, arrays={"actual_logprob": lp}, drop_meta=["content_sha256"])
    with pytest.raises(RecordError, match="no content_sha256"):
        _kl(ref_path, eng_path)
    # the explicit option reads it (the user vouched for the file) and the number is the edited one
    trusted = Record.load(eng_path, trust_unhashed=True)
    assert not np.array_equal(metrics.position_metrics(Record.load(ref_path), trusted).kl_part, before)


def test_rehash_command_makes_a_trusted_old_record_loadable(tmp_path):
    ref_path, eng_path = _pair(tmp_path)
    original = Record.load(eng_path)
    _rewrite(eng_path, drop_meta=["content_sha256"])
    out = subprocess.run([sys.executable, "-m", "ds41gates.cli", "rehash", str(eng_path)], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert str(eng_path) in out.stdout
    back = Record.load(eng_path)
    assert back.provenance == original.provenance
    np.testing.assert_array_equal(back.topk_logprobs, original.topk_logprobs)


def test_rehash_refuses_a_record_that_is_not_whole(tmp_path):
    """Re-hashing vouches only for a record that passes every other check: a bad value stays refused."""
    _, eng_path = _pair(tmp_path)
    lp = load_file(str(eng_path))["actual_logprob"].copy()
    lp[0] = 0.5
    _rewrite(eng_path, arrays={"actual_logprob": lp}, drop_meta=["content_sha256"])
    out = subprocess.run([sys.executable, "-m", "ds41gates.cli", "rehash", str(eng_path)], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.startswith("error: ") and "not a valid logprob" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    with pytest.raises(RecordError, match="no content_sha256"):
        Record.load(eng_path)


# ============================================================================================ exact dtypes
@pytest.mark.parametrize("name,dtype", [
    ("topk_logprobs", np.float16), ("actual_logprob", np.float16), ("topk_logprobs", np.float32),
    ("full_logprobs", np.float16), ("token_ids", np.int32), ("topk_ids", np.uint64), ("actual_rank", np.int16),
])
def test_arrays_of_another_dtype_are_refused(tmp_path, name, dtype):
    ref_path, eng_path = _pair(tmp_path)
    path = ref_path if name == "full_logprobs" else eng_path
    arr = load_file(str(path))[name]
    _rewrite(path, arrays={name: arr.astype(dtype)}, rehash=True)     # whole: the hash matches the edit
    with pytest.raises(RecordError) as ei:
        Record.load(path)
    msg = str(ei.value)
    assert name in msg and np.dtype(dtype).name in msg and "\n" not in msg, msg


# ============================================================================================ vocabulary
def _engine_with(eng: Record, **extra) -> Record:
    p = eng.provenance
    eng.provenance = Provenance(**{**p.__dict__, "extra": {**p.extra, **extra}})
    return eng


def test_engine_id_outside_the_reference_vocabulary_is_refused(tmp_path):
    ref_path, eng_path = _pair(tmp_path)
    eng = Record.load(eng_path)
    eng.topk_ids = eng.topk_ids.copy()
    eng.topk_ids[4, 2] = 10 ** 9
    eng.save(eng_path)                                         # a whole record: the engine side names no vocabulary
    eng = Record.load(eng_path)
    with pytest.raises(RecordError) as ei:
        metrics.position_metrics(Record.load(ref_path), eng)
    msg = str(ei.value)
    assert "1000000000" in msg and f"vocabulary (size {VOCAB})" in msg and "engine" in msg, msg


def test_engine_id_at_the_vocabulary_size_is_refused_with_a_provenance_vocabulary(tmp_path):
    """The reference knows its vocabulary from provenance (what every oracle writes), not from full logprobs."""
    ref, eng, _ = pair_of_records(np.random.default_rng(7), n_seq=2, length=9, vocab=VOCAB, k_ref=20, k_eng=5)
    p = ref.provenance
    ref.provenance = Provenance(**{**p.__dict__, "source": {"vocab_size": VOCAB}})
    eng.topk_ids = eng.topk_ids.copy()
    eng.topk_ids[0, 4] = VOCAB
    with pytest.raises(RecordError, match=f"top-k id {VOCAB} is outside the reference's vocabulary"):
        metrics.position_metrics(ref, eng)


def test_records_whose_vocabularies_differ_are_not_compared(tmp_path):
    ref_path, eng_path = _pair(tmp_path)
    eng = _engine_with(Record.load(eng_path), vocab_size=VOCAB + 10)
    with pytest.raises(RecordMismatch) as ei:
        metrics.position_metrics(Record.load(ref_path), eng)
    msg = str(ei.value)
    assert f"{VOCAB}" in msg and f"{VOCAB + 10}" in msg and "vocabular" in msg, msg
    # the same size compares
    same = _engine_with(Record.load(eng_path), vocab_size=VOCAB)
    assert np.array_equal(metrics.position_metrics(Record.load(ref_path), same).kl_part, _kl(ref_path, eng_path))
