"""llama.cpp adapters, against the real servers.

* llama-server: the C++ server built by scripts/setup-llama-server.sh (profile llama-server-f32, the F32
  GGUF) — token-id prefixes, ``n_probs``, the ``tokens_evaluated`` alignment self-check, the full-vocabulary
  read of an actual token outside the top-k, generation, panel scoring. The refusals are provoked on the
  real server by editing the request on its way out (a longer prompt, ``post_sampling_probs``, another
  model name), so each one is checked against the server's own answer.
* llama-cpp-python: against the REAL 0.3.36 server (profile llamacpp-f32, the F32 GGUF) — canary values,
  the one-position echo shift (abetlen/llama-cpp-python#1983), round-trip refusal, panel scoring.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.adapters.llamacpp import LlamaCppPythonAdapter, LlamaServerAdapter
from engine.errors import EngineResponseError, Malformed, TokenRoundTripError

CANARY = [504, 3575, 282, 4649, 314, 7042]
PUBLISHED_F32 = [-11.5393, -0.3376, -2.4387, -0.4510, -0.2581]        # engines.md §12.7 fp32 reference
VOCAB_SMOLLM2 = 49152


# ============================================================================================ llama-server (real)
class Rewriting:
    """A transport in front of the real server that edits each request body before it is sent: how the
    tests make the real server answer with the shapes the adapter must refuse."""

    def __init__(self, client, edit):
        self.client, self.edit, self.model = client, edit, client.model
        self.bodies: list[dict] = []

    def post_json(self, path, body, *, seq_id=None):
        body = self.edit(dict(body))
        self.bodies.append(body)
        return self.client.post_json(path, body, seq_id=seq_id)

    def get_json(self, path):
        return self.client.get_json(path)


def _require_llama_server() -> None:
    from core.paths import cache_dir
    from engine.launcher import LLAMA_SERVER_DIR

    if not (cache_dir() / "engines" / LLAMA_SERVER_DIR / ".ds41-ready").exists():
        pytest.skip("llama-server is not built under the cache; run scripts/setup-llama-server.sh")


def test_llama_server_profiles_resolve_to_the_built_binary():
    from engine.launcher import resolve
    from engine.profiles import load_profile

    fake = {name: (lambda n=name: f"<{n}>") for name in ("llama_server", "gguf_f32", "gguf_q4_1", "cache", "stamp")}
    for gguf, name in (("<gguf_f32>", "llama-server-f32"), ("<gguf_q4_1>", "llama-server-q4_1")):
        prof = load_profile(name)
        spec = resolve(prof, providers=fake)
        argv = list(spec.argv)
        assert prof.engine == "llama-server" and argv[0] == "<llama_server>"
        assert argv[argv.index("--model") + 1] == gguf and argv[argv.index("--alias") + 1] == "smollm2"
        assert argv[argv.index("--ctx-size") + 1] == "2048" and argv[argv.index("--parallel") + 1] == "1"
        assert argv[argv.index("--port") + 1] == str(spec.port) and spec.port > 0
        assert spec.health_url == f"http://127.0.0.1:{spec.port}/health"


def test_llama_server_profile_without_a_build_names_the_setup_script(tmp_path, monkeypatch):
    from engine.launcher import resolve
    from engine.profiles import ProfileError, load_profile

    monkeypatch.setenv("DS41_CACHE", str(tmp_path))
    with pytest.raises(ProfileError, match="setup-llama-server.sh"):
        resolve(load_profile("llama-server-f32"))


@pytest.mark.engine
def test_llama_server_setup_is_cached_and_the_binary_runs():
    """A second set-up finds the stamped build (sdist hash + flags) and prints the binary without building."""
    import subprocess
    import time
    from pathlib import Path

    _require_llama_server()
    root = Path(__file__).resolve().parents[2]
    t0 = time.perf_counter()
    out = subprocess.run(["bash", str(root / "scripts" / "setup-llama-server.sh")], capture_output=True, text=True,
                         timeout=60, check=True)
    assert time.perf_counter() - t0 < 10
    binary = Path(out.stdout.strip())
    assert binary.name == "llama-server" and binary.is_file()
    assert (binary.parent.parent / "CMAKE_ARGS").read_text().split().count("-DGGML_NATIVE=OFF") == 1
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    assert version.returncode == 0 and "version:" in version.stdout + version.stderr


@pytest.fixture(scope="module")
def llama_server():
    from engine.client import ClientConfig, EngineClient
    from engine.launcher import EngineServer
    from engine.profiles import load_profile

    _require_llama_server()
    with EngineServer(load_profile("llama-server-f32")) as srv:
        c = EngineClient(ClientConfig(srv.base_url, srv.served_model, vocab_size=VOCAB_SMOLLM2, timeout_s=300),
                         adapter=LlamaServerAdapter(vocab_size=VOCAB_SMOLLM2))
        yield c
        c.close()


@pytest.mark.engine
def test_llama_server_canary_from_token_id_prefixes(llama_server):
    seen = Rewriting(llama_server, lambda b: b)
    got = llama_server.adapter.prompt_logprobs(seen, "canary", CANARY, 5)
    top = [b for b in seen.bodies if b["n_probs"] == 5]
    assert [b["prompt"] for b in top] == [CANARY[:i] for i in range(1, len(CANARY))]
    assert all(b["n_predict"] == 1 and b["temperature"] == 0 for b in seen.bodies)
    # the one-token prefix goes cold (empties the slot), every longer one reuses the previous prefix
    assert [b["cache_prompt"] for b in top] == [False, True, True, True, True]
    # " capital" (position 1) is outside the top-5: the same prefix again, wider
    assert [(b["prompt"], b["n_probs"]) for b in seen.bodies if b["n_probs"] != 5] == \
        [(CANARY[:1], 1024), (CANARY[:1], VOCAB_SMOLLM2)]
    assert got.keyed_by == "id" and got.surface == "llama-server.completion.per-prefix.incremental"
    assert [p.position for p in got.positions] == [1, 2, 3, 4, 5]
    for p, ref in zip(got.positions, PUBLISHED_F32):
        assert abs(p.actual_logprob - ref) <= 2e-3, (p.position, p.actual_logprob, ref)
        assert not p.ambiguous
    assert got.positions[0].top_ids[:4] == (29, 28, 198, 79)
    assert got.positions[2].top_ids == (260, 4649, 7476, 4754, 4617)
    assert [p.actual_rank for p in got.positions[1:]] == [1, 2, 1, 1]


@pytest.mark.engine
def test_llama_server_incremental_values_do_not_depend_on_what_was_served_before(llama_server):
    """Positions scored with prefix reuse are decode steps of the sequence itself: the same values after
    a cold prefill of a longer prompt sharing the prefix (a generation) sat in the slot's cache. Cold
    prefixes (reuse_prefix=False) differ from them only by llama.cpp's batch-shape noise."""
    first = llama_server.prompt_logprobs(CANARY, 5, seq_id="a")
    llama_server.generate(CANARY + [13], 2, 1, seq_id="between")
    again = llama_server.prompt_logprobs(CANARY, 5, seq_id="b")
    assert [(p.actual_logprob, p.top_ids, p.top_logprobs) for p in first.positions] == \
        [(p.actual_logprob, p.top_ids, p.top_logprobs) for p in again.positions]
    cold_adapter = LlamaServerAdapter(vocab_size=VOCAB_SMOLLM2, reuse_prefix=False)
    seen = Rewriting(llama_server, lambda b: b)
    cold = cold_adapter.prompt_logprobs(seen, "cold", CANARY, 5)
    assert all(b["cache_prompt"] is False for b in seen.bodies)
    assert cold.surface == "llama-server.completion.per-prefix.cold"
    assert first.positions[0].actual_logprob == cold.positions[0].actual_logprob   # one token: same computation
    diffs = [abs(a.actual_logprob - b.actual_logprob) for a, b in zip(first.positions, cold.positions)]
    assert max(diffs) <= 2e-3 and [p.top_ids[:3] for p in first.positions] == [p.top_ids[:3] for p in cold.positions]


@pytest.mark.engine
def test_llama_server_actual_outside_topk_read_from_wider_lists(llama_server):
    """Position 1's actual token (" capital", rank ~2923 under the reference) is far outside the top-3:
    the adapter re-asks the same prefix with n_probs = 1024, then the whole vocabulary, and reads its value
    and rank there; a token inside the 1024 list needs no full-vocabulary request."""
    seen = Rewriting(llama_server, lambda b: b)
    got = llama_server.adapter.prompt_logprobs(seen, "full", CANARY[:3], 3)
    wide = [(b["prompt"], b["n_probs"]) for b in seen.bodies if b["n_probs"] > 3]
    assert wide == [(CANARY[:1], 1024), (CANARY[:1], VOCAB_SMOLLM2)]
    first = got.positions[0]
    assert first.actual_id == 3575 and first.actual_id not in first.top_ids
    assert abs(first.actual_logprob - PUBLISHED_F32[0]) <= 2e-3
    assert abs(first.actual_rank - 2923) <= 5                 # the fp32 reference's rank (vLLM, engines.md §12.7)
    # the same server, the same prefix, asked directly for the whole distribution: the rank is recomputed
    reply = llama_server.post_json("/completion", {"prompt": CANARY[:1], "n_predict": 1, "n_probs": VOCAB_SMOLLM2,
                                                   "temperature": 0, "cache_prompt": False})
    entries = reply.data["completion_probabilities"][0]["top_logprobs"]
    assert len(entries) == VOCAB_SMOLLM2 and len({e["id"] for e in entries}) == VOCAB_SMOLLM2
    value = {e["id"]: e["logprob"] for e in entries}
    assert first.actual_logprob == value[3575]
    assert first.actual_rank == 1 + sum(v > value[3575] for v in value.values())
    # " France" at position 3 is rank 2: outside a top-1, inside the 1024 list
    seen = Rewriting(llama_server, lambda b: b)
    got = llama_server.adapter.prompt_logprobs(seen, "wide", CANARY[:4], 1)
    assert [b["n_probs"] for b in seen.bodies if b["prompt"] == CANARY[:3]] == [1, 1024]
    assert got.positions[2].actual_rank == 2 and got.positions[2].top_ids == (260,)
    with pytest.raises(EngineResponseError) as ei:
        LlamaServerAdapter(vocab_size=None, wide_k=8).prompt_logprobs(llama_server, "nv", CANARY[:3], 3)
    assert ei.value.kind == Malformed.ACTUAL_MISSING and ei.value.seq_id == "nv" and ei.value.position == 1


# "Modular arithmetic works with remainders. We write a ≡ b (mod m) when m divides a": after it the greedy
# token is 21004, " " plus the first two bytes of "≡", whose text the server cannot send yet
MID_CHARACTER = [4828, 755, 20270, 1806, 351, 2612, 11503, 30, 1046, 2965, 253, 21004, 111, 278, 365, 2172, 283, 25,
                 645, 283, 20751, 253]
# a chat turn in Chinese ending in "绿": ten single- and double-byte tokens lead the next position
MID_CHARACTER_ZH = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
                    8182, 2, 198, 1, 4093, 198, 20887, 140]


@pytest.mark.engine
@pytest.mark.parametrize("prefix,greedy", [(MID_CHARACTER, 21004), (MID_CHARACTER_ZH, 177)], ids=["en", "zh"])
def test_llama_server_greedy_token_ending_mid_character_is_asked_again(llama_server, prefix, greedy):
    raw = llama_server.post_json("/completion", {"prompt": prefix, "n_predict": 1, "n_probs": 5,
                                                 "temperature": 0, "cache_prompt": False, "return_tokens": True})
    assert raw.data["tokens"] == [greedy] and "completion_probabilities" not in raw.data   # withheld
    period = llama_server.post_json("/tokenize", {"content": ".", "with_pieces": True}).data["tokens"][0]["id"]
    seen = Rewriting(llama_server, lambda b: b)
    cold = LlamaServerAdapter(vocab_size=VOCAB_SMOLLM2, reuse_prefix=False)   # compared with cold requests below
    ids, lps, timing = cold._prefix_dist(seen, "mid", prefix, 5, len(prefix))
    assert [b.get("logit_bias") for b in seen.bodies if "prompt" in b] == [None, [[period, 1e6]]]
    assert timing.requests == 2
    assert ids[0] == greedy and len(ids) == 5           # the withheld token reported, first, with its value
    # the values do not depend on where the sampler is pushed: the same prefix, pushed onto ","
    comma = llama_server.post_json("/tokenize", {"content": ","}).data["tokens"][0]
    other = llama_server.post_json("/completion", {"prompt": prefix, "n_predict": 1, "n_probs": 5,
                                                   "temperature": 0, "cache_prompt": False, "return_tokens": True,
                                                   "logit_bias": [[comma, 1e6]]})
    top = other.data["completion_probabilities"][0]["top_logprobs"]
    assert other.data["tokens"] == [comma] != [period]
    assert [e["id"] for e in top] == ids and [e["logprob"] for e in top] == lps


@pytest.mark.engine
def test_llama_server_minus_flt_max_reads_as_minus_infinity(llama_server):
    """llama-server writes a probability of 0 as float lowest() (-FLT_MAX). SmolLM2's logits never spread
    far enough for a float32 softmax to underflow (the smallest full-vocabulary logprob on the canary is
    about -28), so the real server cannot be made to write it here: this takes a real response and puts
    the value its `logarithm(0)` writes into the last entry (a recorded shape with one edited value)."""
    from engine.adapters.llamacpp import parse_completion_probs

    reply = llama_server.post_json("/completion", {"prompt": CANARY[:5], "n_predict": 1, "n_probs": 5,
                                                   "temperature": 0, "cache_prompt": False})
    data = reply.data
    assert min(e["logprob"] for e in data["completion_probabilities"][0]["top_logprobs"]) > -100
    data["completion_probabilities"][0]["top_logprobs"][-1]["logprob"] = -3.4028234663852886e38
    (gid, glp, ids, lps), = parse_completion_probs(data, 5, 1, 5, "smollm2", "flt", VOCAB_SMOLLM2, 5)
    assert gid == 7042 and ids[0] == 7042 and lps[-1] == float("-inf") and all(np.isfinite(lps[:-1]))


@pytest.mark.engine
def test_llama_server_evaluates_exactly_the_ids_sent(llama_server):
    """tokens_evaluated is the alignment self-check: the real server adds no BOS to an id prompt, and a
    prompt that reaches it longer than the prefix the adapter meant is refused at that position."""
    reply = llama_server.post_json("/completion", {"prompt": CANARY[:4], "n_predict": 1, "n_probs": 1,
                                                   "temperature": 0, "cache_prompt": False})
    assert reply.data["tokens_evaluated"] == 4
    grown = Rewriting(llama_server, lambda b: {**b, "prompt": [CANARY[0]] + b["prompt"]})
    with pytest.raises(EngineResponseError) as ei:
        llama_server.adapter.prompt_logprobs(grown, "grown", CANARY, 5)
    assert ei.value.kind == Malformed.PROMPT_IDS_MISMATCH and ei.value.position == 1
    assert "evaluated 2 prompt tokens, 1 sent" in str(ei.value)
    # one token short (cut from a longer prefix): refused at the position whose prefix it was
    short = Rewriting(llama_server, lambda b: {**b, "prompt": b["prompt"][:-1] or b["prompt"]})
    with pytest.raises(EngineResponseError) as ei:
        llama_server.adapter.prompt_logprobs(short, "short", CANARY, 5)
    assert ei.value.kind == Malformed.PROMPT_IDS_MISMATCH and ei.value.position == 2


@pytest.mark.engine
def test_llama_server_refuses_post_sampling_probabilities_and_another_model(llama_server):
    post = Rewriting(llama_server, lambda b: {**b, "post_sampling_probs": True})
    with pytest.raises(EngineResponseError) as ei:
        llama_server.adapter.prompt_logprobs(post, "post", CANARY[:3], 3)
    assert ei.value.kind == Malformed.MISSING_FIELD and ei.value.position == 1 and "'prob'" in str(ei.value)
    other = Rewriting(llama_server, lambda b: b)
    other.model = "another-model"
    with pytest.raises(EngineResponseError) as ei:
        llama_server.adapter.prompt_logprobs(other, "other", CANARY[:3], 3)
    assert ei.value.kind == Malformed.WRONG_MODEL


@pytest.mark.engine
def test_llama_server_generation_has_ids(llama_server):
    g = llama_server.generate(CANARY[:5], 1, 5, seq_id="g")
    assert g.token_ids == (7042,) and g.positions[0].position == 5    # " Paris"
    assert g.positions[0].actual_rank == 1 and abs(g.positions[0].actual_logprob - (-0.2581)) <= 2e-3


@pytest.mark.engine
def test_llama_server_gate_surfaces_on_the_real_server(llama_server):
    """The behaviour gates' seam on the real server: its context from /props (the profile's --ctx-size 2048),
    ignore_eos generating exactly max_tokens, and a clear refusal for what llama-server does not offer."""
    from engine.adapters.base import GenerateOptions
    from engine.errors import UnsupportedSurface
    from gates import _engine

    assert _engine.max_model_len(llama_server) == 2048
    g = _engine.complete(llama_server, CANARY, 6, 1, seq_id="fixed")       # ignore_eos=True, the gates' default
    assert len(g.token_ids) == 6
    with pytest.raises(UnsupportedSurface, match="not supported by this engine"):
        llama_server.generate(CANARY, 2, 1, options=GenerateOptions(cache_salt="s"))
    with pytest.raises(UnsupportedSurface, match="not supported by this engine"):
        _engine.cache_config(llama_server)


@pytest.mark.engine
def test_llama_server_ids_only_generation_gives_the_same_ids(llama_server):
    with_probs = llama_server.generate(CANARY, 12, 1, seq_id="ids-k1")
    ids_only = llama_server.generate(CANARY, 12, LlamaServerAdapter.ids_only_k, seq_id="ids-k0")
    assert ids_only.token_ids == with_probs.token_ids and len(ids_only.token_ids) == 12
    assert ids_only.positions == () and ids_only.k == 0


class _Reply:
    """The shape llama-server 0.3.36 answered with for IFEval prompt 1217 on Q4_1 (seen in the full eval run):
    three byte-fallback tokens of one emoji folded into ONE completion_probabilities entry."""

    def __init__(self):
        self.data = {"tokens_predicted": 3, "tokens_evaluated": 4, "tokens": [10813, 232, 118], "content": "🎨",
                     "stop_type": "limit", "model": "smollm2",
                     "completion_probabilities": [{"id": 118, "token": "🎨", "logprob": -0.1, "bytes": [240, 159, 142, 168],
                                                   "top_logprobs": [{"id": 118, "token": "🎨", "logprob": -0.1}]}]}
        self.url, self.elapsed_s = "http://fake/completion", 0.01


class _OneReply:
    model = "smollm2"

    def post_json(self, path, body, *, seq_id=None):
        return _Reply()


def test_folded_utf8_tokens_are_a_named_mismatch_with_logprobs_and_fine_ids_only():
    from engine.errors import EngineResponseError

    adapter = LlamaServerAdapter(vocab_size=VOCAB_SMOLLM2, check_model_name=False)
    with pytest.raises(EngineResponseError, match="completion_probabilities has 1 entries, expected 3"):
        adapter.generate(_OneReply(), "emoji", [1, 2, 3, 4], 3, 1)
    got = adapter.generate(_OneReply(), "emoji", [1, 2, 3, 4], 3, adapter.ids_only_k)
    assert got.token_ids == (10813, 232, 118) and got.text == "🎨" and got.positions == ()


@pytest.mark.engine
def test_llama_server_panel_record_every_position_scored(llama_server):
    """A real panel sequence: every position scored with ids (no ambiguity exists), values on the fp32
    reference's within llama.cpp's F32 tolerance."""
    from engine.client import EngineSource, ScoreStats, score_panel
    from engine.models import ensure_smollm2
    from oracle.hf import score_panel_hf
    from panels import EncodedPanel, encode_panel, load_panel

    full = encode_panel(load_panel("default"), "smollm2")
    short = min(full.sequences, key=lambda s: len(s.token_ids))
    panel = EncodedPanel(full.panel_name, full.panel_version, full.panel_hash, full.tokenizer_hash, (short,))
    stats = ScoreStats()
    rec = score_panel(llama_server, panel, 10,
                      EngineSource(llama_server.root, "smollm2", "llama-server-f32", precision="f32"),
                      progress=False, stats=stats)
    ref = score_panel_hf(ensure_smollm2().hf_dir, panel, top_k=32, threads=1)
    rec.check_compatible(ref)
    assert rec.provenance.extra["keyed_by"] == ["id"] and rec.ambiguous is None and stats.ambiguous == 0
    assert rec.n_positions == len(short.token_ids) - 1 == ref.n_positions
    delta = np.abs(rec.actual_logprob - ref.actual_logprob)
    assert np.median(delta) <= 2e-3 and np.max(delta) <= 2e-2
    assert (rec.topk_ids[:, 0] == ref.topk_ids[:, 0]).mean() >= 0.98


# ============================================================================================ llama-cpp-python (real)
@pytest.fixture(scope="module")
def llama():
    from engine.client import ClientConfig, EngineClient
    from engine.launcher import EngineServer
    from engine.profiles import load_profile

    with EngineServer(load_profile("llamacpp-f32")) as srv:
        c = EngineClient(ClientConfig(srv.base_url, srv.served_model, vocab_size=49152, timeout_s=300),
                         adapter=LlamaCppPythonAdapter(vocab_size=49152))
        yield c
        c.close()


@pytest.mark.engine
def test_llamacpp_python_canary_within_llamacpp_tolerance(llama):
    got = llama.prompt_logprobs(CANARY, 5, seq_id="canary")
    assert [p.position for p in got.positions] == [1, 2, 3, 4, 5]
    for p, ref in zip(got.positions, PUBLISHED_F32):
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
