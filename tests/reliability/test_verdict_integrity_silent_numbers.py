"""Verdict integrity II (issue 35, part C): numbers that cannot be true are named errors, never silent inputs.

* an engine's top-k probability mass above 1 (beyond a float slack) is refused where the record is built and
  where it is loaded, naming the sequence and position;
* a negative KL (a mean KL_part of −0.31 reached a report) is impossible beyond a slack: a named error naming
  the sequence and position, before any summary of it;
* one record = one engine: two engines behind one port (the answers' ``system_fingerprint`` / model / Server
  header change between sequences) are refused naming both, never mixed into one record.

The engines are the reliability suite's canned vLLM-shaped server (the bytes a test scripts).
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from core import metrics
from core.metrics.definition import KL_NEGATIVE_SLACK, refuse_impossible_kl
from core.records import TOPK_MASS_SLACK, Provenance, Record, RecordError, SequenceScores
from engine.client import ClientConfig, EngineClient, EngineSource, score_panel
from engine.errors import EngineIdentityChanged
from panels import EncodedPanel, EncodedSequence
from tests.engine.test_client_malformed import MODEL, VOCAB, vllm_prompt_response
from tests.reliability.helpers import Canned, CannedServer, serve_vllm

IDS = [5, 17, 3, 29, 11, 8]


def _prov(side: str) -> Provenance:
    return Provenance(side=side, panel_name="silent", panel_version="1", panel_hash="sha256:" + "a" * 64,
                      tokenizer_hash="sha256:" + "b" * 64, source={"test": "silent numbers"}, precision="fp64",
                      created=Provenance.now())


def _record(side: str, tokens: list[int], logprobs: np.ndarray, k: int) -> Record:
    """A record of one sequence whose position i has the full distribution logprobs[i] (rows over the vocab)."""
    ids = np.argsort(-logprobs, axis=1, kind="stable")[:, :k]
    lp = np.take_along_axis(logprobs, ids, 1)
    actual = np.asarray(tokens[1:])
    act = logprobs[np.arange(len(actual)), actual]
    ranks = 1 + (logprobs > act[:, None]).sum(axis=1)
    scored = np.ones(len(tokens), dtype=bool)
    scored[0] = False
    return Record.from_sequences(_prov(side), [SequenceScores("s0", "code", np.asarray(tokens), scored, ids, lp,
                                                              act, ranks)], k=k)


def _flat_distribution(rng, n: int, vocab: int = 30) -> np.ndarray:
    logits = rng.normal(size=(n, vocab)) * 0.3      # flat: every p < e^-0.31, so lp + 0.31 is still a logprob
    return logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))


# ==================================================================================== top-k mass above 1
def test_a_record_whose_top_k_mass_exceeds_one_is_refused_naming_the_position():
    rng = np.random.default_rng(0)
    tokens = [1, 4, 2, 7, 3]
    full = _flat_distribution(rng, len(tokens) - 1)
    assert _record("engine", tokens, full, 5).n_positions == 4          # a real distribution: accepted
    inflated = full.copy()
    inflated[2] += 0.31                              # position 3's values sum to e^0.31 = 1.36
    with pytest.raises(RecordError) as exc:
        _record("engine", tokens, inflated, 30)
    msg = str(exc.value)
    assert "'s0'" in msg and "position 3" in msg and "mass 1.36" in msg, msg
    # the top-k alone may stay under 1 while the actual token outside it pushes the mass over
    top = np.argsort(-full[0])[:3]
    over = full.copy()
    over[0, top] = np.log(np.exp(full[0, top]) / np.exp(full[0, top]).sum())   # top-3 sums to 1 …
    outside = next(t for t in range(30) if t not in top)
    toks = [1, outside, 2, 7, 3]                                                  # … and the actual is outside
    with pytest.raises(RecordError, match="position 1: top-k probability mass"):
        _record("engine", toks, over, 3)


def test_float_rounding_of_the_mass_is_not_an_error():
    rng = np.random.default_rng(1)
    tokens = [1, 4, 2, 7, 3]
    full = _flat_distribution(rng, len(tokens) - 1) + TOPK_MASS_SLACK / 4   # mass 1 + 2.5e-5: rounding
    assert _record("engine", tokens, full, 30).n_positions == 4


def test_a_saved_record_edited_to_a_mass_above_one_is_refused_on_load(tmp_path):
    from safetensors.numpy import load_file, save_file
    from safetensors import safe_open

    rng = np.random.default_rng(2)
    tokens = [1, 4, 2, 7, 3]
    rec = _record("engine", tokens, _flat_distribution(rng, 4), 30)
    path = rec.save(tmp_path / "eng.safetensors")
    with safe_open(str(path), "np") as f:
        meta = f.metadata()
    arrays = load_file(str(path))
    arrays["topk_logprobs"] = np.minimum(arrays["topk_logprobs"] + 0.31, 0.0)
    meta = {k: v for k, v in meta.items() if k != "content_sha256"}     # as an old, unhashed record
    save_file(arrays, str(path), metadata=meta)
    with pytest.raises(RecordError) as exc:     # trusted past the content hash, the values themselves refuse
        Record.load(path, trust_unhashed=True)
    assert "sequence 's0'" in str(exc.value), str(exc.value)


def test_an_engine_answering_with_a_mass_above_one_gets_no_record():
    """The issue's case end to end: a vLLM-shaped engine whose prompt logprobs sum above 1 at one position."""
    def inflated(r):
        body = vllm_prompt_response(r.body["prompt"], r.body["prompt_logprobs"], model=MODEL)
        entry = body["choices"][0]["prompt_logprobs"][2]
        for v in entry.values():
            v["logprob"] = min(0.0, v["logprob"] + 2.0)
        return Canned(200, body)

    with CannedServer() as srv:
        serve_vllm(srv, MODEL)
        srv.routes["/v1/completions"] = inflated
        with EngineClient(ClientConfig(srv.url, MODEL, vocab_size=VOCAB)) as client:
            with pytest.raises(RecordError) as exc:
                score_panel(client, _panel(), 3, EngineSource(srv.url, MODEL, "fake"), max_concurrency=1,
                            progress=False)
    assert "position 2" in str(exc.value) and "probability mass" in str(exc.value), str(exc.value)


# ==================================================================================== negative KL
def test_a_negative_kl_is_a_named_error_before_any_summary():
    """Records as the old checks let them through (no mass check): the KL they give is about −0.31, and it is
    refused naming where, by both metric backends."""
    rng = np.random.default_rng(3)
    tokens = [1, 4, 2, 7, 3, 9, 5]
    full = _flat_distribution(rng, len(tokens) - 1)
    ref = _record("oracle", tokens, full, 30)
    eng = _record("engine", tokens, full, 30)
    pm = metrics.position_metrics(ref, eng)
    assert abs(pm.kl_part).max() < 1e-12
    bent = pm.kl_part.copy()
    bent[4] = -0.31
    forged = type(pm)(**{**pm.__dict__, "kl_part": bent})
    with pytest.raises(RecordError) as exc:
        refuse_impossible_kl(forged, ref)
    msg = str(exc.value)
    assert "kl_part -0.31" in msg and "'s0'" in msg and "position 5" in msg, msg
    slight = pm.kl_part - KL_NEGATIVE_SLACK / 2                # rounding-sized: accepted
    assert refuse_impossible_kl(type(pm)(**{**pm.__dict__, "kl_part": slight}), ref) is not None


@pytest.mark.parametrize("backend", ["numba", "definition"])
def test_records_with_an_inflated_engine_never_reach_a_kl_mean(monkeypatch, backend):
    """The −0.31 mean of the issue came from an engine with mass above 1: no backend computes a mean of it."""
    monkeypatch.setenv("DS41_METRICS_BACKEND", backend)
    rng = np.random.default_rng(4)
    tokens = [1, 4, 2, 7, 3, 9, 5]
    full = _flat_distribution(rng, len(tokens) - 1)
    ref = _record("oracle", tokens, full, 30)
    with pytest.raises(RecordError):
        eng = _record("engine", tokens, full + 0.31, 30)
        metrics.score_pair(ref, "engine", eng, n_boot=10)


# ==================================================================================== one record, one engine
def _panel() -> EncodedPanel:
    seqs = [(f"s{i}", [(i * 7 + j * 3 + 1) % VOCAB for j in range(6)]) for i in range(4)]
    return EncodedPanel("unit-panel", 1, "p" * 64, "t" * 64, tuple(
        EncodedSequence(sid, "code", tuple(ids), (False,) + (True,) * (len(ids) - 1)) for sid, ids in seqs))


def _fingerprinted(fingerprints):
    turn = itertools.cycle(fingerprints)

    def answer(r):
        body = vllm_prompt_response(r.body["prompt"], r.body["prompt_logprobs"], model=MODEL)
        fingerprint = next(turn)
        if fingerprint is not None:
            body["system_fingerprint"] = fingerprint
        return Canned(200, body)

    return answer


def test_two_engines_behind_one_port_are_refused_naming_both():
    with CannedServer() as srv:
        serve_vllm(srv, MODEL)
        srv.routes["/v1/completions"] = _fingerprinted(["fp-engine-A", "fp-engine-B"])
        with EngineClient(ClientConfig(srv.url, MODEL, vocab_size=VOCAB)) as client:
            with pytest.raises(EngineIdentityChanged) as exc:
                score_panel(client, _panel(), 3, EngineSource(srv.url, MODEL, "fake"), max_concurrency=1,
                            progress=False)
    msg = str(exc.value)
    assert "system_fingerprint='fp-engine-A'" in msg and "system_fingerprint='fp-engine-B'" in msg, msg
    assert "'s0'" in msg and "'s1'" in msg, msg


def test_an_answer_that_leaves_a_field_out_is_no_other_engine():
    """llama-server's native endpoints answer without ``model``: only a field present in two answers with two
    values is a change (the first version of this check refused a real llama-server KL gate)."""
    with CannedServer() as srv:
        serve_vllm(srv, MODEL)
        srv.routes["/v1/completions"] = _fingerprinted(["fp-engine-A", None])
        with EngineClient(ClientConfig(srv.url, MODEL, vocab_size=VOCAB)) as client:
            rec = score_panel(client, _panel(), 3, EngineSource(srv.url, MODEL, "fake"), max_concurrency=1,
                              progress=False)
    assert rec.provenance.extra["answered_as"]["system_fingerprint"] == "fp-engine-A"


def test_one_engine_is_recorded_with_the_identity_it_answered_as():
    with CannedServer() as srv:
        serve_vllm(srv, MODEL)
        srv.routes["/v1/completions"] = _fingerprinted(["fp-engine-A"])
        with EngineClient(ClientConfig(srv.url, MODEL, vocab_size=VOCAB)) as client:
            rec = score_panel(client, _panel(), 3, EngineSource(srv.url, MODEL, "fake"), progress=False)
            # a second record from the same client is judged on its own answers: a new engine there is fine
            srv.routes["/v1/completions"] = _fingerprinted(["fp-engine-B"])
            again = score_panel(client, _panel(), 3, EngineSource(srv.url, MODEL, "fake"), progress=False)
    ident = rec.provenance.extra["answered_as"]
    assert ident["model"] == MODEL and ident["system_fingerprint"] == "fp-engine-A" and ident["server"], ident
    assert again.provenance.extra["answered_as"]["system_fingerprint"] == "fp-engine-B"
    assert json.loads(rec.provenance.to_json())["extra"]["answered_as"] == ident
