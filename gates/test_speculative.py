"""Gate: speculative decoding, losslessness and acceptance (gates.md §8).

A second server of the profile under test runs with ``--speculative-config`` (vLLM CPU 0.32: n-gram
prompt lookup, N = 3; the only drafter that needs no second model). Per domain, chat-templated
acceptance prompts are decoded greedily with ``ignore_eos`` on both servers:

* L1 losslessness: drafted ids equal plain greedy ids (SHA-256 over the id lists; strict on fp32);
* acceptance from the engine's counters (deltas around each domain on the otherwise idle server):
  α = A/P, τ = 1 + A/D (bonus token included), α_j = A_j/D;
* draft health: NaN/+inf logprobs in drafted output, drafts without tokens, or a drafter that never drafts.

With ``--engine-url`` the spec server cannot be launched here: give its URL in DS41_SPEC_ENGINE_URL.
"""

from __future__ import annotations

import json
import os

import pytest

from core.results import GateEntry, headline
from gates import _engine
from gates.lib import specdec

pytestmark = [pytest.mark.gate, pytest.mark.engine]


@pytest.fixture(scope="module")
def spec_client(request, engine_endpoint, gate_config, launch_engine):
    from engine.endpoint import EngineEndpoint, client_for

    cfg = gate_config.specdec
    json.loads(cfg.speculative_config)  # a malformed config fails here, not in the server log
    url = os.environ.get("DS41_SPEC_ENGINE_URL")
    server = None
    if url:
        ep = EngineEndpoint(url.rstrip("/").removesuffix("/v1"), engine_endpoint.model, "spec (by URL)")
    elif request.config.getoption("--engine-url"):
        pytest.skip("--engine-url given: set DS41_SPEC_ENGINE_URL to the same engine with speculation on")
    else:
        server, ep = launch_engine(engine_endpoint.profile, flags=engine_endpoint.flags,
                                   overrides={"extra_args": ["--speculative-config", cfg.speculative_config]})
    client = client_for(ep, max_concurrency=2)
    try:
        yield client
    finally:
        client.close()
        if server is not None:
            server.stop()


def _prompts(cfg, tok):
    from panels.bench import encode_chat_prompt, load_bench

    bench = load_bench()
    return [(p.id, d, encode_chat_prompt(tok, p.text)) for d in cfg.domains
            for p in bench.acceptance_domain(d)[: cfg.prompts_per_domain]]


def _counters(client) -> specdec.Counters | None:
    snap = client.metrics()
    return specdec.counters_from_samples([s for fam in snap.families.values() for s in fam])


@pytest.fixture(scope="module")
def spec_runs(spec_client, engine_client, gate_config, gate_tokenizer):
    cfg = gate_config.specdec
    n, k = cfg.max_tokens, cfg.k
    checks, acceptance, plain_out = [], [], {}
    by_domain: dict[str, list] = {}
    for pid, domain, ids in _prompts(cfg, gate_tokenizer):
        by_domain.setdefault(domain, []).append((pid, ids))
    for domain, items in by_domain.items():
        before = _counters(spec_client)
        assert before is not None, "the spec server exports no vllm:spec_decode_* counters"
        spec_gens = {pid: _engine.complete(spec_client, ids, n, k, seq_id=pid) for pid, ids in items}
        after = _counters(spec_client)
        acceptance.append(specdec.Acceptance(domain, after - before, cfg.num_speculative_tokens))
        for pid, ids in items:
            plain = _engine.complete(engine_client, ids, n, k, seq_id=pid)
            plain_out[pid] = (ids, plain)
            s = spec_gens[pid]
            checks.append(specdec.lossless(pid, domain, plain.token_ids, plain.positions, s.token_ids, s.positions))
    return {"checks": checks, "acceptance": acceptance, "plain": plain_out}


def test_speculative_decoding(spec_runs, engine_endpoint, gate_run, gate_config):
    cfg = gate_config.specdec
    res = specdec.judge(spec_runs["checks"], spec_runs["acceptance"], strict=cfg.strict)
    gate_run.add(GateEntry("speculative_decoding", res.passed, profile=engine_endpoint.profile,
                           failures=res.failures, metrics=headline(res.summary),
                           evidence={"summary": res.summary, "lossless": res.lossless_rows,
                                     "acceptance": res.acceptance_rows, "config": cfg.model_dump(mode="json")}))
    gate_run.add_section("Speculative decoding: acceptance per domain (gates.md §8)", res.acceptance_rows,
                         f"{engine_endpoint.profile} + {cfg.speculative_config}: L1 identical "
                         f"{res.summary['identical']}; α = accepted/proposed, τ = 1 + accepted/drafts "
                         "(bonus token included), α_j = accepted at position j / drafts")
    gate_run.add_section("Speculative decoding: L1 greedy losslessness", res.lossless_rows,
                         "drafted vs plain greedy ids, SHA-256 of the id lists")
    assert len(spec_runs["checks"]) == len(cfg.domains) * cfg.prompts_per_domain
    assert res.passed, "speculative decoding gate failed:\n" + "\n".join(res.failures)


def test_speculative_detects_mismatch(spec_runs, spec_client, gate_config, gate_run):
    """Violation: drafted output of a different request (another domain's prompt) against a prompt's plain
    greedy output must fail L1; counters that show drafts without draft tokens must fail draft health."""
    cfg = gate_config.specdec
    plain = list(spec_runs["plain"].items())
    (pid_a, (_, plain_a)), (pid_b, (ids_b, _)) = plain[0], plain[-1]
    other = _engine.complete(spec_client, ids_b, cfg.max_tokens, cfg.k, seq_id=pid_b)
    bad = specdec.lossless(pid_a + " vs " + pid_b, "mixed", plain_a.token_ids, plain_a.positions, other.token_ids,
                           other.positions)
    assert not bad.equal and bad.first_divergence is not None
    empty = specdec.Acceptance("synthetic", specdec.Counters(10, 0, 0, (0, 0, 0)), cfg.num_speculative_tokens)
    res = specdec.judge([bad], [empty], strict=True)
    gate_run.add(GateEntry("speculative_decoding_violation", not res.passed, evidence={"caught": res.failures}))
    assert not res.passed
    assert any("differs from plain greedy" in f for f in res.failures)
    assert any("empty drafts" in f for f in res.failures)
