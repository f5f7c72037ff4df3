"""SGLang adapter against JSON fixtures built to engines.md §4's documented /generate format.

The fixtures are NOT recordings of a live server (SGLang does not run on CPU); see
tests/data/sglang/README.md. Values are the §12.7 published SmolLM2 fp32 values.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest

from engine.adapters import sglang
from engine.adapters.sglang import SglangAdapter
from engine.errors import EngineResponseError, Malformed
from tests.engine.test_client_malformed import FakeEngine, Reply, client_for

DATA = Path(__file__).parents[1] / "data" / "sglang"
CANARY = [504, 3575, 282, 4649, 314]
MODEL = "fake-model"


def load(name: str):
    return json.loads((DATA / name).read_text())


@pytest.mark.parametrize("name", ["generate_prompt_canary_k3.json", "generate_prompt_canary_k3_text.json",
                                  "generate_prompt_canary_k3_batch.json"])
def test_prompt_positions_parse_to_the_published_values(name):
    rows = sglang.parse_prompt_logprobs(load(name), CANARY, 3, "canary", vocab_size=49152)
    assert [r.position for r in rows] == [1, 2, 3, 4]
    cap, of, france, is_ = rows
    assert cap.actual_id == 3575 and cap.actual_logprob == -11.5393
    assert cap.actual_rank == 0                 # outside the top-3 and SGLang gives no rank
    assert cap.top_ids == (29, 28, 198) and cap.top_logprobs == (-0.8655, -2.6533, -3.1515)
    assert of.actual_rank == 1 and of.top_ids[0] == 282
    assert france.actual_rank == 2 and france.actual_logprob == -2.4387 and france.top_ids == (260, 4649, 7476)
    assert is_.actual_rank == 1 and is_.top_ids == (314, 28, 5721)


def test_generated_positions_parse():
    g = sglang.parse_generation(load("generate_output_only_k3.json"), CANARY, 3, "g", vocab_size=49152)
    assert g.token_ids == (7042,) and g.text == " Paris" and g.finish_reason == "length"
    (p,) = g.positions
    assert p.position == 5 and p.actual_logprob == -0.2581 and p.actual_rank == 1
    assert p.top_ids == (7042, 260, 4528) and g.cached_tokens == 0 and g.prompt_tokens == 5


def test_adapter_through_the_client_sends_the_documented_request():
    fake = FakeEngine()
    try:
        body = (DATA / "generate_prompt_canary_k3.json").read_bytes()
        fake.routes["/generate"] = lambda b: Reply(200, body)
        c, _ = client_for(fake, adapter=SglangAdapter(vocab_size=49152))
        got = c.prompt_logprobs(CANARY, 3, seq_id="canary")
        assert got.keyed_by == "id" and got.surface == "sglang.generate.input_logprobs"
        assert got.positions[2].actual_logprob == -2.4387 and got.cached_tokens == 0
        path, req = fake.requests[-1]
        assert path == "/generate"
        assert req["input_ids"] == CANARY and req["return_logprob"] is True
        assert req["logprob_start_len"] == 0 and req["top_logprobs_num"] == 3
        assert req["sampling_params"]["temperature"] == 0      # SGLang logprobs are temperature-scaled otherwise
    finally:
        fake.close()


def _meta(r):
    return r["meta_info"]


CASES = [
    ("scored id differs from the id sent", lambda r: _meta(r)["input_token_logprobs"][2].__setitem__(1, 283),
     Malformed.PROMPT_IDS_MISMATCH, 2),
    ("position 0 carries a logprob", lambda r: _meta(r)["input_token_logprobs"][0].__setitem__(0, -1.0),
     Malformed.POSITION0_NOT_NULL, 0),
    ("null logprob at position 3", lambda r: _meta(r)["input_token_logprobs"][3].__setitem__(0, None),
     Malformed.NULL_ENTRY, 3),
    ("top list null at position 1", lambda r: _meta(r)["input_top_logprobs"].__setitem__(1, None),
     Malformed.NULL_ENTRY, 1),
    ("input lists shorter than the prompt", lambda r: _meta(r)["input_top_logprobs"].pop(),
     Malformed.LENGTH_MISMATCH, None),
    ("top list shorter than k", lambda r: _meta(r)["input_top_logprobs"][2].pop(), Malformed.TOO_FEW_ENTRIES, 2),
    ("top list longer than k", lambda r: _meta(r)["input_top_logprobs"][2].append([-9.0, 77, None]),
     Malformed.TOO_MANY_ENTRIES, 2),
    ("pair instead of triple", lambda r: _meta(r)["input_top_logprobs"][4].__setitem__(1, [-2.4385, 28]),
     Malformed.WRONG_TYPE, 4),
    ("top list out of order", lambda r: _meta(r)["input_top_logprobs"][1].reverse(), Malformed.RANK_ORDER, 1),
    ("actual value differs from its top entry", lambda r: _meta(r)["input_token_logprobs"][3].__setitem__(0, -2.5),
     Malformed.ACTUAL_INCONSISTENT, 3),
    ("actual outside top-k yet above the k-th", lambda r: _meta(r)["input_token_logprobs"][1].__setitem__(0, -0.1),
     Malformed.ACTUAL_INCONSISTENT, 1),
    ("duplicate id in a top list", lambda r: _meta(r)["input_top_logprobs"][1][2].__setitem__(1, 28),
     Malformed.DUPLICATE_ID, 1),
    ("positive logprob", lambda r: _meta(r)["input_top_logprobs"][2][0].__setitem__(0, 0.3),
     Malformed.POSITIVE_LOGPROB, 2),
    ("no input logprobs (logprob_start_len ignored)", lambda r: _meta(r).pop("input_top_logprobs"),
     Malformed.MISSING_LOGPROBS, None),
    ("prompt_tokens disagrees", lambda r: _meta(r).__setitem__("prompt_tokens", 6), Malformed.PROMPT_IDS_MISMATCH, None),
    ("id beyond the vocabulary", lambda r: _meta(r)["input_top_logprobs"][3][2].__setitem__(1, 60000),
     Malformed.ID_OUT_OF_RANGE, 3),
]


@pytest.mark.parametrize("mutate,kind,position", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_malformed_fixture_variants(mutate, kind, position):
    resp = copy.deepcopy(load("generate_prompt_canary_k3.json"))
    mutate(resp)
    with pytest.raises(EngineResponseError) as ei:
        sglang.parse_prompt_logprobs(resp, CANARY, 3, "sg", vocab_size=49152)
    assert ei.value.kind == kind, str(ei.value)
    assert ei.value.seq_id == "sg"
    if position is not None:
        assert ei.value.position == position


def test_batch_of_two_for_one_request_is_refused():
    resp = load("generate_prompt_canary_k3_batch.json") * 2
    with pytest.raises(EngineResponseError) as ei:
        sglang.parse_prompt_logprobs(resp, CANARY, 3, "sg")
    assert ei.value.kind == Malformed.NO_CHOICES


def test_output_ids_must_match_output_logprobs():
    resp = load("generate_output_only_k3.json")
    resp["output_ids"] = [7043]
    with pytest.raises(EngineResponseError) as ei:
        sglang.parse_generation(resp, CANARY, 3, "g")
    assert ei.value.kind == Malformed.GENERATED_MISMATCH


def test_clamped_value_is_minus_infinity():
    resp = load("generate_prompt_canary_k3.json")
    _meta(resp)["input_token_logprobs"][1][0] = -9999.0
    rows = sglang.parse_prompt_logprobs(resp, CANARY, 3, "sg")
    assert rows[0].actual_logprob == -math.inf
