"""Reliability: malformed engine responses through the panel-scoring path, and the kinds' documentation.

tests/engine/test_client_malformed.py provokes every ``engine.errors.Malformed`` kind against a local fake server
(one request at a time). Here the same case tables go through ``score_panel`` — the path every gate takes —
with the malformed answer given to the middle sequence of three: the error must name its kind and that
sequence, no record may come out, and the sequence after it must never be sent. docs/RELIABILITY.md must list
every kind.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest

from engine.client import EngineSource, score_panel
from engine.errors import EngineResponseError, Malformed
from panels import EncodedPanel, EncodedSequence
from tests.engine.test_client_malformed import (
    IDS, PROMPT_CASES, RAW_CASES, FakeEngine, Reply, client_for, vllm_prompt_response,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "RELIABILITY.md"
OK_IDS, LATER_IDS = [1, 2, 3, 4], [9, 8, 7, 6, 5]


def _panel() -> EncodedPanel:
    seqs = [("first", OK_IDS), ("bad-seq", IDS), ("later", LATER_IDS)]
    return EncodedPanel("rel", 1, "p" * 64, "t" * 64, tuple(
        EncodedSequence(sid, "code", tuple(ids), (False,) + (True,) * (len(ids) - 1)) for sid, ids in seqs))


def _run(bad_reply):
    fake = FakeEngine()
    try:
        def handler(body):
            if body["prompt"] == IDS:
                return bad_reply
            return Reply(200, vllm_prompt_response(body["prompt"], body["prompt_logprobs"]))
        fake.routes["/v1/completions"] = handler
        c, _ = client_for(fake)
        with pytest.raises(EngineResponseError) as ei:
            score_panel(c, _panel(), 3, EngineSource(fake.url, "fake-model", "fake"), max_concurrency=1,
                        progress=False)
        sent = [b["prompt"] for p, b in fake.requests if p == "/v1/completions"]
        return ei.value, sent
    finally:
        fake.close()


def _mutated(mutate) -> Reply:
    resp = vllm_prompt_response(IDS, 3)
    mutate(resp)
    return Reply(200, copy.deepcopy(resp))


CASES = [(f"prompt: {c[0]}", lambda m=c[1]: _mutated(m), c[2]) for c in PROMPT_CASES
         if c[0] != "actual outside top-k but above k-th"]          # that one depends on the fixture's values
CASES += [(f"body: {c[0]}", lambda b=c[1]: Reply(200, b), c[2]) for c in RAW_CASES]


@pytest.mark.parametrize("make,kind", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_malformed_answer_through_score_panel(make, kind):
    err, sent = _run(make())
    assert err.kind == kind, str(err)
    assert err.seq_id == "bad-seq" and "'bad-seq'" in str(err)
    assert sent == [OK_IDS, IDS]                  # not retried, and the later sequence never sent


def test_every_kind_is_documented():
    text = DOC.read_text(encoding="utf-8")
    table = re.findall(r"^\| `([a-z0-9_]+)` \|", text, flags=re.M)
    assert len(Malformed) >= 20
    assert sorted(set(table) & {k.value for k in Malformed}) == sorted(k.value for k in Malformed), (
        sorted({k.value for k in Malformed} - set(table)))
    provoked = {c[2] for c in CASES}
    assert len(provoked) >= 20, len(provoked)       # distinct kinds provoked through score_panel alone
