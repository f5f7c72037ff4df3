"""The exllamav3 front (engine/exllamav3_server.py, engine/exllamav3_api.py) on the CPU: a stand-in backend
behind the real HTTP front, read by the real client and vLLM adapter the gates use. exllamav3 itself runs only
on the GPU (tests marked gpu: tests/engine/test_exllamav3_gpu.py)."""

from __future__ import annotations

import threading
import uuid

import pytest
import torch

from engine import exllamav3_api as api
from engine.exllamav3_server import Front, StepEvent, serve

V = 97


class BigramBackend:
    """Logits depend on the previous id only (a fixed random table), so decode and prefill agree exactly;
    generation emits one token per step for every live job (a batching generator in miniature); prefix reuse
    is page-hash based with the salt as the chain root, like exllamav3's."""

    vocab_size = V
    prefix_caching = True

    def __init__(self, page: int = 4):
        g = torch.Generator().manual_seed(0)
        self.table = torch.randn(V, V, generator=g) * 3
        self.jobs: dict[str, dict] = {}
        self.pages: set[bytes] = set()
        self.page = page

    def _hashes(self, ids, salt):
        import hashlib

        h, out = api.salt_root(salt), []
        for i in range(len(ids) // self.page):
            m = hashlib.blake2b(digest_size=16)
            if h is not None:
                m.update(h)
            m.update(bytes(str(ids[i * self.page:(i + 1) * self.page]), "ascii"))
            h = m.digest()
            out.append(h)
        return out

    def score(self, ids):
        return self.table[torch.tensor(ids)]

    def start(self, ident, ids, max_tokens, ignore_eos, salt):
        hs = self._hashes(ids[:-1], salt)
        hit = 0
        for h in hs:
            if h not in self.pages:
                break
            hit += 1
        self.pages |= set(hs)
        self.jobs[ident] = {"last": ids[-1], "left": max_tokens, "cached": hit * self.page}

    def busy(self):
        return bool(self.jobs)

    def step(self):
        out = []
        for ident, j in list(self.jobs.items()):
            logits = self.table[j["last"]]
            t = int(torch.argmax(logits))
            j["last"] = t
            j["left"] -= 1
            done = j["left"] == 0
            out.append(StepEvent(ident, [t], logits[None], f"<{t}>", done, "length" if done else None,
                                 j["cached"] if done else None))
            if done:
                del self.jobs[ident]
        return out

    def piece(self, tid):
        return f"<{tid}>"


@pytest.fixture()
def served():
    from engine.client import ClientConfig, EngineClient

    front = Front(BigramBackend(), "fake-exl3", max_model_len=512)
    server = serve(front, "127.0.0.1", 0)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    client = EngineClient(ClientConfig(url, "fake-exl3", vocab_size=V, max_concurrency=4))
    try:
        yield front, client
    finally:
        client.close()
        server.shutdown()
        front.close()


def test_prompt_logprobs_through_the_vllm_adapter_are_the_backends_log_softmax(served):
    front, client = served
    ids = [5, 17, 3, 3, 90, 41, 0]
    got = client.prompt_logprobs(ids, 5, seq_id="s")
    lp = torch.log_softmax(front.backend.table.double(), -1)
    assert [p.position for p in got.positions] == list(range(1, len(ids)))
    for p in got.positions:
        row = lp[ids[p.position - 1]]
        assert p.actual_id == ids[p.position]
        assert p.actual_logprob == pytest.approx(float(row[p.actual_id]), abs=1e-12)
        top = torch.argsort(row, descending=True)[:5].tolist()
        assert list(p.top_ids) == top
        assert p.actual_rank == int((row > row[p.actual_id]).sum()) + 1
    assert got.cached_tokens == 0


def test_greedy_generation_and_decode_equals_prefill(served):
    _, client = served
    from gates import _engine

    prompt = [7, 8, 9]
    g = _engine.complete(client, prompt, 6, 4, seq_id="g")
    assert len(g.token_ids) == 6 and g.finish_reason == "length"
    again = client.prompt_logprobs(list(prompt) + list(g.token_ids), 4)
    dec = [p.actual_logprob for p in g.positions]
    pre = [p.actual_logprob for p in again.positions[len(prompt) - 1:]]
    assert dec == pytest.approx(pre, abs=1e-12)


def test_concurrent_requests_and_stream_match_solo(served):
    _, client = served
    from gates import _engine

    solo = _engine.complete(client, [1, 2, 3], 5, 3)
    burst = _engine.together([lambda: _engine.complete(client, [1, 2, 3], 5, 3) for _ in range(3)])
    assert all(b.token_ids == solo.token_ids for b in burst)
    seen = []
    st = _engine.stream(client, [1, 2, 3], 5, 3, on_tokens=seen.append)
    assert st.generation.token_ids == solo.token_ids and seen[-1] == 5


def test_cache_salt_decides_prefix_hits(served):
    _, client = served
    from gates import _engine

    ids = list(range(10, 30))
    salt = uuid.uuid4().hex
    assert _engine.complete(client, ids, 2, 1, salt=salt).cached_tokens == 0
    assert _engine.complete(client, ids, 2, 1, salt=salt).cached_tokens == 16    # pages of 4: 19 ids → 4 full
    assert _engine.complete(client, ids, 2, 1).cached_tokens == 0                # fresh salt: nothing shared
    snap = client.metrics()
    assert snap.value("vllm:cache_config_info", block_size=str(api.PAGE_SIZE)) == 1.0


def test_refusals_are_http_400_with_the_field():
    with pytest.raises(api.RequestError, match="temperature"):
        api.parse_completion({"prompt": [1], "temperature": 0.7}, "m", V, 100)
    with pytest.raises(api.RequestError, match="outside the vocabulary"):
        api.parse_completion({"prompt": [V]}, "m", V, 100)
    with pytest.raises(api.RequestError, match="token ids"):
        api.parse_completion({"prompt": "text"}, "m", V, 100)
    with pytest.raises(api.RequestError, match="max_model_len"):
        api.parse_completion({"prompt": [1] * 90, "max_tokens": 20}, "m", V, 100)
    with pytest.raises(api.RequestError, match="not served"):
        api.parse_completion({"prompt": [1], "model": "other"}, "m", V, 100)


class DraftingBackend(BigramBackend):
    """As BigramBackend, but as exllamav3 with a drafter reports it: every step a verification round emitting
    `per_round` tokens (per_round - 1 accepted drafts plus the target's own), and the job's accepted / rejected
    draft-token totals on its last event (the drafter proposed `proposed` tokens per round)."""

    info = {"draft": "mtp"}

    def __init__(self, per_round: int = 3, proposed: int = 4):
        super().__init__()
        self.per_round, self.proposed = per_round, proposed

    def step(self):
        out = []
        for ident, j in list(self.jobs.items()):
            ids, rows = [], []
            for _ in range(min(self.per_round, j["left"])):
                logits = self.table[j["last"]]
                j["last"] = int(torch.argmax(logits))
                ids.append(j["last"])
                rows.append(logits)
                j["left"] -= 1
            j.setdefault("rounds", []).append(len(ids) - 1)
            done = j["left"] == 0
            acc = sum(j["rounds"]) if done else None
            rej = sum(self.proposed - a for a in j["rounds"]) if done else None
            out.append(StepEvent(ident, ids, torch.stack(rows), "", done, "length" if done else None,
                                 j["cached"] if done else None, acc, rej))
            if done:
                del self.jobs[ident]
        return out


def test_spec_decode_counters_as_the_speculative_gate_reads_them():
    """The front's vllm:spec_decode_* counters, parsed by the gate's own reader (gates/lib/specdec.py):
    9 tokens in rounds of 3 = 3 drafts, 6 accepted of 12 proposed, tau = 3; none without a drafter."""
    from engine.client import ClientConfig, EngineClient
    from gates import _engine
    from gates.lib import specdec

    for backend, want in ((DraftingBackend(), specdec.Counters(3.0, 12.0, 6.0)), (BigramBackend(), None)):
        front = Front(backend, "fake-exl3", max_model_len=512)
        server = serve(front, "127.0.0.1", 0)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        client = EngineClient(ClientConfig(f"http://127.0.0.1:{server.server_address[1]}", "fake-exl3",
                                           vocab_size=V, max_concurrency=2))
        try:
            got = _engine.complete(client, list(range(10, 20)), 9, 1)
            assert len(got.token_ids) == 9
            snap = client.metrics()
            counters = specdec.counters_from_samples([s for fam in snap.families.values() for s in fam])
            assert counters == want
            if want is not None:
                assert specdec.Acceptance("code", counters, 4).tau == 3.0
        finally:
            client.close()
            server.shutdown()
            front.close()


def test_speculative_config_as_the_front_reads_it():
    spec = api.parse_speculative_config('{"method": "mtp", "num_speculative_tokens": 4, "model": "dsv4-tiny-bf16-dspark"}')
    assert spec == api.SpeculativeConfig(4, "dsv4-tiny-bf16-dspark")
    assert api.parse_speculative_config('{"method": "mtp"}') == api.SpeculativeConfig(None, None)
    for text, msg in (('{"method": "ngram"}', "method 'ngram'"), ('{"method": "mtp", "x": 1}', r"keys \['x'\]"),
                      ('{"method": "mtp", "num_speculative_tokens": 0}', "positive integer"), ("[1]", "JSON object"),
                      ("{", "not JSON")):
        with pytest.raises(ValueError, match=msg):
            api.parse_speculative_config(text)
