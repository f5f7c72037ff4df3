"""llama.cpp adapters.

* llama-cpp-python: against the REAL 0.3.36 server (profile llamacpp-f32, the F32 GGUF) — canary values,
  the one-position echo shift (abetlen/llama-cpp-python#1983), round-trip refusal, panel scoring.
* llama-server: no C++ server binary is built on this machine yet, so the adapter's request/response
  handling is exercised against the fake HTTP server answering in the documented §5 shape (ids in every
  entry, ``tokens_evaluated``, ``completion_probabilities``), values computed from an explicit distribution.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.adapters.llamacpp import LlamaCppPythonAdapter, LlamaServerAdapter
from engine.errors import EngineResponseError, Malformed, TokenRoundTripError
from tests.test_client_malformed import VOCAB, FakeEngine, Reply, client_for, distribution

CANARY = [504, 3575, 282, 4649, 314, 7042]


# ============================================================================================ llama-server (fake, §5 shape)
def llama_server_route(model: str = "fake-model", drop_eval: bool = False, post_sampling: bool = False):
    def handler(body):
        prefix = tuple(body["prompt"])
        lp = distribution(prefix)
        n = body["n_probs"]
        top = [{"id": int(t), "token": "x", "bytes": [120], "logprob": float(lp[t])} for t in np.argsort(-lp)[:n]]
        if post_sampling:
            top = [{"id": e["id"], "token": "x", "bytes": [120], "prob": float(np.exp(e["logprob"]))} for e in top]
        g = top[0]
        return Reply(200, {"model": model, "content": "x", "tokens": [g["id"]], "tokens_predicted": 1,
                           "tokens_evaluated": len(prefix) + (1 if drop_eval else 0), "stop_type": "limit",
                           "completion_probabilities": [dict(g, top_logprobs=top)]})
    return handler


@pytest.fixture()
def fake():
    f = FakeEngine()
    yield f
    f.close()


def test_llama_server_one_request_per_prefix(fake):
    fake.routes["/completion"] = llama_server_route()
    c, _ = client_for(fake, adapter=LlamaServerAdapter(vocab_size=VOCAB))
    ids = [5, 17, 3, 29, 11, 8]
    got = c.prompt_logprobs(ids, 4, seq_id="ls")
    reqs = [b for p, b in fake.requests if p == "/completion"]
    base = [b for b in reqs if b["n_probs"] == 4]
    assert [b["prompt"] for b in base] == [ids[:i] for i in range(1, len(ids))]
    assert all(b["cache_prompt"] is False and b["temperature"] == 0 and b["n_predict"] == 1 for b in base)
    for p in got.positions:
        lp = distribution(tuple(ids[:p.position]))
        assert list(p.top_ids) == list(np.argsort(-lp)[:4])
        assert p.actual_logprob == pytest.approx(lp[ids[p.position]], abs=0)
        assert p.actual_rank == 1 + int((lp > lp[ids[p.position]]).sum())
    # actual tokens outside the top-4 were read from a full-vocabulary request of the same prefix
    outside = [p for p in got.positions if p.actual_id not in p.top_ids]
    assert outside and len([b for b in reqs if b["n_probs"] == VOCAB]) == len(outside)
    assert got.timing.requests == len(reqs)


def test_llama_server_without_vocab_size_cannot_read_actual_outside_topk(fake):
    fake.routes["/completion"] = llama_server_route()
    c, _ = client_for(fake, adapter=LlamaServerAdapter(vocab_size=None))
    with pytest.raises(EngineResponseError) as ei:
        c.prompt_logprobs([5, 17, 3, 29, 11, 8], 1, seq_id="nv")
    assert ei.value.kind == Malformed.ACTUAL_MISSING and ei.value.seq_id == "nv"


@pytest.mark.parametrize("route,kind", [
    (llama_server_route(drop_eval=True), Malformed.PROMPT_IDS_MISMATCH),
    (llama_server_route(post_sampling=True), Malformed.MISSING_FIELD),
    (llama_server_route(model="other"), Malformed.WRONG_MODEL),
], ids=["tokens_evaluated off by one", "post-sampling probs", "wrong model"])
def test_llama_server_malformed(fake, route, kind):
    fake.routes["/completion"] = route
    c, _ = client_for(fake, adapter=LlamaServerAdapter(vocab_size=VOCAB))
    with pytest.raises(EngineResponseError) as ei:
        c.prompt_logprobs([5, 17, 3], 3, seq_id="bad")
    assert ei.value.kind == kind and ei.value.position == 1


def test_llama_server_generation(fake):
    fake.routes["/completion"] = llama_server_route()
    c, _ = client_for(fake, adapter=LlamaServerAdapter(vocab_size=VOCAB))
    g = c.generate([5, 17, 3], 1, 3, seq_id="g")
    lp = distribution((5, 17, 3))
    assert g.token_ids == (int(np.argmax(lp)),) and g.positions[0].position == 3 and g.positions[0].actual_rank == 1


# ============================================================================================ llama-cpp-python (real)
@pytest.fixture(scope="module")
def llama():
    from engine.client import ClientConfig, EngineClient
    from engine.launcher import EngineServer, load_profile

    with EngineServer(load_profile("llamacpp-f32")) as srv:
        c = EngineClient(ClientConfig(srv.base_url, srv.served_model, vocab_size=49152, timeout_s=300),
                         adapter=LlamaCppPythonAdapter(vocab_size=49152))
        yield c
        c.close()


@pytest.mark.engine
def test_llamacpp_python_canary_within_llamacpp_tolerance(llama):
    got = llama.prompt_logprobs(CANARY, 5, seq_id="canary")
    published = [-11.5393, -0.3376, -2.4387, -0.4510, -0.2581]          # engines.md §12.7 fp32 reference
    assert [p.position for p in got.positions] == [1, 2, 3, 4, 5]
    for p, ref in zip(got.positions, published):
        assert abs(p.actual_logprob - ref) <= 2e-3, (p.position, p.actual_logprob, ref)
        assert not p.ambiguous
    assert got.positions[0].top_ids[:4] == (29, 28, 198, 79)            # position 1: from the prefix request
    assert got.positions[2].top_ids == (260, 4649, 7476, 4754, 4617)    # position 3: from echo entry 2
    assert 282 not in got.positions[2].top_ids                          # the shifted previous-token key is dropped
    assert got.keyed_by == "string"


@pytest.mark.engine
def test_llamacpp_python_refuses_ids_that_do_not_round_trip(llama):
    from engine.models import ensure_smollm2
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ensure_smollm2().tokenizer_json))
    split = tok.encode(" cap", add_special_tokens=False).ids + tok.encode("ital", add_special_tokens=False).ids
    ids = [504] + split + [282]
    assert len(split) == 2 and 3575 not in split
    with pytest.raises(TokenRoundTripError) as ei:
        llama.prompt_logprobs(ids, 5, seq_id="split")
    assert ei.value.position == 1 and ei.value.seq_id == "split" and "3575" in str(ei.value)


@pytest.mark.engine
def test_llamacpp_python_panel_record(llama, tmp_path):
    from engine.client import EngineSource, ScoreStats, score_panel
    from engine.models import ensure_smollm2
    from oracle.hf import score_panel_hf
    from panels import EncodedPanel, encode_panel, load_panel

    full = encode_panel(load_panel("default"), "smollm2")
    short = min(full.sequences, key=lambda s: len(s.token_ids))
    panel = EncodedPanel(full.panel_name, full.panel_version, full.panel_hash, full.tokenizer_hash, (short,))
    stats = ScoreStats()
    rec = score_panel(llama, panel, 10, EngineSource(llama.root, "smollm2", "llamacpp-f32", precision="f32"),
                      progress=False, stats=stats)
    ref = score_panel_hf(ensure_smollm2().hf_dir, panel, top_k=32, threads=1)
    rec.check_compatible(ref)
    assert rec.ambiguous is not None and rec.provenance.extra["keyed_by"] == ["string"]
    ok = ~rec.ambiguous
    assert ok.mean() >= 0.9
    delta = np.abs(rec.actual_logprob[ok] - ref.actual_logprob[ok])
    assert np.median(delta) <= 2e-3 and np.max(delta) <= 2e-2
    rec.save(tmp_path / "llama.safetensors")


class _NoCalls:
    """A transport that fails the test if the adapter reaches the engine (keys must map offline)."""

    def post_json(self, *a, **k):
        raise AssertionError("the key map must not re-tokenize through the engine")


def test_string_keys_shared_by_several_ids_are_collisions_not_the_retokenized_id():
    """engines.md §10 rule 2: a key rendered by two ids is ambiguous (its entry dropped); an unknown key too;
    two keys naming one id as well. Unique keys map to their id."""
    vocab = {"a": (5,), " b": (7,), " ": (9, 12), "c": (3,), "c ": (3,)}
    ad = LlamaCppPythonAdapter(vocab_size=20, vocab_strings=vocab)
    mapped, amb = ad._map_keys(_NoCalls(), "s", {"a": -0.1, " b": -2.0})
    assert mapped == {5: -0.1, 7: -2.0} and not amb
    mapped, amb = ad._map_keys(_NoCalls(), "s", {"a": -0.1, " ": -2.0})  # " " is ids 9 and 12
    assert mapped == {5: -0.1} and amb
    mapped, amb = ad._map_keys(_NoCalls(), "s", {"a": -0.1, "zzz": -3.0})  # not any id's string
    assert mapped == {5: -0.1} and amb
    mapped, amb = ad._map_keys(_NoCalls(), "s", {"c": -0.5, "c ": -1.5})  # two keys, one id
    assert mapped == {3: -0.5} and amb


def test_vocab_strings_groups_ids_that_render_alike(tmp_path):
    """The real SmolLM2 tokenizer: every id appears exactly once, and the special tokens (rendered empty
    when skipped) share one key, so a server key "" can never be mistaken for one of them."""
    from engine.endpoint import vocab_strings
    from engine.models import ensure_smollm2
    from tokenizers import Tokenizer

    model_dir = ensure_smollm2().hf_dir
    table = vocab_strings(model_dir)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = sorted(i for group in table.values() for i in group)
    assert ids == list(range(tok.get_vocab_size()))
    special = tok.token_to_id("<|im_start|>")
    assert special in table[""] and len(table[""]) > 1
    assert table[tok.decode([tok.token_to_id("hello")])] == (tok.token_to_id("hello"),)
