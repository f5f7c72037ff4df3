"""Pre-encoded panels: the EncodedPanel a record was scored on (panels.encoded_from_record), and JSON files of
token ids (panels.encoded_from_json)."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from core.records import Record, SequenceScores
from panels import EncodedPanel, PanelError, encoded_from_json, encoded_from_record
from tests.core.recordkit import provenance


def _scores(seq_id: str, domain: str, tokens: list[int], scored: list[bool], k: int = 3) -> SequenceScores:
    n = sum(scored)
    rng = np.random.default_rng(len(tokens))
    share = np.log(k + 1)     # each of the k + 1 values at most 1/(k+1): a part of one distribution (mass <= 1)
    return SequenceScores(seq_id, domain, np.asarray(tokens, np.int64), np.asarray(scored, bool),
                          rng.integers(0, 50, (n, k)), -np.sort(rng.random((n, k)), axis=1) - share,
                          -rng.random(n) - share, np.ones(n, np.int64))


def test_a_record_gives_back_the_ids_masks_and_identity_it_was_scored_on(tmp_path):
    seqs = [("a", "code", [5, 6, 7, 8, 9], [False, False, True, False, True]),
            ("b", "chat", [1, 2], [False, True]),
            ("c", "code", [3, 3, 3, 3], [False, True, True, True])]
    rec = Record.from_sequences(provenance(panel_hash="p" * 64, tokenizer_hash="t" * 64),
                                [_scores(*s) for s in seqs], k=3)
    back = encoded_from_record(Record.load(rec.save(tmp_path / "r.safetensors")))
    assert isinstance(back, EncodedPanel)
    assert (back.panel_name, back.panel_version, back.panel_hash, back.tokenizer_hash) == ("unit", 1, "p" * 64, "t" * 64)
    assert [(s.seq_id, s.domain, list(s.token_ids), list(s.scored_mask)) for s in back.sequences] == \
        [(sid, dom, ids, mask) for sid, dom, ids, mask in seqs]
    assert all(type(t) is int for s in back.sequences for t in s.token_ids)  # plain ints, not numpy scalars


def test_json_panels_default_masks_and_hash_over_the_sequences(tmp_path):
    p = tmp_path / "ids.json"
    p.write_text(json.dumps([[4, 5, 6], [7, 8]]))
    panel = encoded_from_json(p)
    assert [s.seq_id for s in panel.sequences] == ["s00000", "s00001"]
    assert [s.scored_mask for s in panel.sequences] == [(False, True, True), (False, True)]
    body = [["s00000", "pre-encoded", [4, 5, 6], [0, 1, 1]], ["s00001", "pre-encoded", [7, 8], [0, 1]]]
    expected = "sha256:" + hashlib.sha256(json.dumps(body, separators=(",", ":")).encode()).hexdigest()
    assert panel.panel_hash == expected and panel.panel_name == "ids" and panel.tokenizer_hash == "pre-encoded"
    p.write_text(json.dumps({"sequences": [{"token_ids": [4, 5, 6], "scored_mask": [False, False, True]}, [7, 8]]}))
    assert encoded_from_json(p).panel_hash != expected  # the scored mask is part of the identity


@pytest.mark.parametrize("body,message", [
    ({"sequences": [{"token_ids": [1, 2], "scored_mask": [True, True]}]}, "scores position 0"),
    ({"sequences": [{"token_ids": [1, 2], "scored_mask": [False]}]}, "2 ids but 1 mask entries"),
    ({"sequences": [[1, "x"]]}, "sequence 0 is not a list of integer token ids"),
    ({"sequences": [[]]}, "has no tokens"),
    ({"sequences": [{"seq_id": "a", "token_ids": [1, 2]}, {"seq_id": "a", "token_ids": [3, 4]}]}, "duplicate seq_id"),
    ({"sequences": []}, "non-empty list"),
])
def test_bad_json_panels_name_the_file_and_the_problem(tmp_path, body, message):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(body))
    with pytest.raises(PanelError, match=message) as err:
        encoded_from_json(p)
    assert str(p) in str(err.value)
