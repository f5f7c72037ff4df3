"""Engine client and vLLM adapter against a REAL vLLM CPU server (profile vllm-cpu-fp32, SmolLM2 fp32).

Started through the launcher (``engine.launcher.EngineServer``) once for this module, or taken from
``--engine-url`` when given. Reference values: engines.md §12.7 (published) and the fp32 HF oracle.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from engine.client import ClientConfig, EngineClient, EngineSource, ScoreStats, score_panel
from engine.errors import EngineRequestRejected

pytestmark = pytest.mark.engine

CANARY = [504, 3575, 282, 4649, 314]
PARIS = 7042
VOCAB = 49152


@pytest.fixture(scope="module")
def server(request):
    url = request.config.getoption("--engine-url")
    if url:
        yield url.rstrip("/"), None
        return
    if request.config.getoption("--engine-profile") in (None, "vllm-cpu-fp32"):
        # the session's vllm-cpu-fp32 server (the plugin's engine_endpoint), shared with the evals tests and
        # the gate suite: one launch fewer in CI
        yield request.getfixturevalue("engine_endpoint").base_url, None
        return
    from engine.launcher import EngineServer
    from engine.profiles import load_profile

    with EngineServer(load_profile("vllm-cpu-fp32")) as srv:
        yield srv.base_url, srv


@pytest.fixture(scope="module")
def client(server):
    url, srv = server
    c = EngineClient(ClientConfig(url, "smollm2", vocab_size=VOCAB, timeout_s=300))
    yield c
    c.close()


@pytest.fixture(scope="module")
def oracle():
    from engine.models import ensure_smollm2
    from oracle.hf import HFOracle

    return HFOracle.load(ensure_smollm2().hf_dir, threads=1)


def test_models_lists_the_served_name(client):
    assert client.models() == ["smollm2"]


def test_canary_matches_published_values(client):
    got = client.prompt_logprobs(CANARY, 5, seq_id="canary")
    cap, of, france, is_ = got.positions
    assert cap.actual_id == 3575 and abs(cap.actual_logprob - (-11.5393)) <= 1e-4 and cap.actual_rank == 2923
    assert cap.top_ids[:4] == (29, 28, 198, 79)                       # actual outside the top-5: not a member
    assert france.actual_rank == 2 and abs(france.actual_logprob - (-2.4387)) <= 1e-4
    assert france.top_ids[:3] == (260, 4649, 7476)
    assert of.actual_rank == 1 and is_.actual_rank == 1


def test_canary_matches_the_fp32_oracle(client, oracle):
    from panels import EncodedSequence

    seq = EncodedSequence("canary", "prose", tuple(CANARY + [PARIS]), (False,) + (True,) * 5)
    ref = oracle.score_sequence(seq, top_k=20)
    got = client.prompt_logprobs(list(seq.token_ids), 20, seq_id="canary")
    eng_actual = np.array([p.actual_logprob for p in got.positions])
    assert np.max(np.abs(eng_actual - ref.actual_logprob)) <= 1e-4
    assert [p.actual_rank for p in got.positions] == list(ref.actual_rank)
    for r, p in enumerate(got.positions):
        oracle_lp = dict(zip(ref.topk_ids[r].tolist(), ref.topk_logprobs[r].tolist()))
        assert list(p.top_ids[:10]) == ref.topk_ids[r, :10].tolist()
        common = [t for t in p.top_ids if t in oracle_lp]
        assert len(common) >= 18
        assert max(abs(lp - oracle_lp[t]) for t, lp in zip(p.top_ids, p.top_logprobs) if t in oracle_lp) <= 1e-4


def test_greedy_generation_with_ids_and_topk(client):
    g = client.generate(CANARY, 3, 5, seq_id="gen")
    assert g.token_ids[0] == PARIS and g.text.startswith(" Paris")
    first = g.positions[0]
    assert first.position == 5 and abs(first.actual_logprob - (-0.2581)) <= 1e-4
    assert first.top_ids == (PARIS, 260, 4528, 2250, 1315)
    assert all(p.actual_rank == 1 for p in g.positions)      # greedy picks the argmax
    assert g.prompt_tokens == 5


def test_stream_matches_non_streamed_and_times_chunks(client):
    plain = client.generate(CANARY, 6, 3, seq_id="plain")
    s = client.stream(CANARY, 6, 3, seq_id="stream")
    assert s.generation.token_ids == plain.token_ids
    assert [p.top_ids for p in s.generation.positions] == [p.top_ids for p in plain.positions]
    assert s.ttft_s is not None and s.ttft_s > 0
    assert len(s.inter_token_s) == len(plain.token_ids) - 1 and all(d >= 0 for d in s.inter_token_s)
    assert isinstance(s.generation.cached_tokens, int)   # the profile enables prompt token details


def test_tokenize_detokenize_round_trip(client):
    assert client.tokenize("The capital of France is") == CANARY
    assert client.detokenize(CANARY) == "The capital of France is"


def test_over_the_cap_is_rejected_with_the_engine_message(client):
    with pytest.raises(EngineRequestRejected) as ei:
        client.prompt_logprobs(CANARY, 100_000, seq_id="cap")
    assert ei.value.status == 400 and "logprobs" in ei.value.message.lower()


def test_cache_salt_controls_prefix_cache_hits(client):
    """Same salt → prefix-cache hit (whole 128-token CPU blocks); fresh salt → cold. vLLM never *reads* the
    prefix cache for prompt_logprobs requests, so prompt scoring is a cold prefill whatever the salt."""
    ids = client.tokenize("A long and winding sentence about rivers, mountains and the sea, " * 30)[:300]
    from engine.adapters.base import GenerateOptions

    salt = "ds41-test-" + uuid.uuid4().hex
    gen = client.adapter.generate
    assert gen(client, "warm", ids, 1, 1, GenerateOptions(cache_salt=salt)).cached_tokens == 0
    assert gen(client, "hit", ids, 1, 1, GenerateOptions(cache_salt=salt)).cached_tokens == 256
    assert gen(client, "cold", ids, 1, 1).cached_tokens == 0                  # fresh random salt
    assert client.prompt_logprobs(ids, 1, seq_id="plp", cache_salt=salt).cached_tokens == 0


def test_metrics_count_prompt_tokens(client):
    before = client.metrics().value("vllm:prompt_tokens_total")
    client.prompt_logprobs(CANARY, 1, seq_id="m")
    after = client.metrics().value("vllm:prompt_tokens_total")
    assert after - before == len(CANARY)


def test_score_panel_against_the_oracle(client, oracle, server, tmp_path):
    from panels import EncodedPanel, encode_panel, load_panel
    from oracle.hf import score_panel_hf

    full = encode_panel(load_panel("default"), "smollm2")
    short = sorted(full.sequences, key=lambda s: len(s.token_ids))[:3]
    panel = EncodedPanel(full.panel_name, full.panel_version, full.panel_hash, full.tokenizer_hash, tuple(short))
    stats = ScoreStats()
    src = EngineSource(url=server[0], model="smollm2", profile="vllm-cpu-fp32", flags={}, precision="fp32")
    eng = score_panel(client, panel, 20, src, progress=False, stats=stats)
    ref = score_panel_hf(oracle.model_dir, panel, top_k=64, oracle=oracle)
    eng.check_compatible(ref)
    assert eng.provenance.side == "engine" and eng.provenance.panel_hash == full.panel_hash
    assert stats.requests == 3 and eng.n_positions == ref.n_positions
    delta = np.abs(eng.actual_logprob - ref.actual_logprob)
    assert np.max(delta) <= 2e-3, f"max |Δ| {np.max(delta):.2e} at row {int(np.argmax(delta))}"
    assert np.median(delta) <= 1e-4
    assert np.mean(eng.topk_ids[:, 0] == ref.topk_ids[:, 0]) >= 0.99
    eng.save(tmp_path / "engine.safetensors")
