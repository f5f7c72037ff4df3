"""Gate: self-consistency, decode vs prefill (gates.md §4).

Greedy generation with top-k logprobs (the decode path), then the same ids re-scored in one prefill
(``prompt_logprobs``); KL_part(prefill ‖ decode) per region. The band comes from the engine's own
run-to-run spread, measured here (two decodes, two prefills per prompt; rule in gates/lib/selfconsistency.py).
Fresh salt on every request, so the re-score never reads KV written while decoding.
"""

from __future__ import annotations

import pytest

from core.results import GateEntry, headline
from gates import _engine
from gates.lib import selfconsistency as sc

pytestmark = [pytest.mark.gate, pytest.mark.engine]


def _prompts(cfg, tok):
    from panels.bench import encode_chat_prompt, load_bench

    bench = load_bench()
    out = []
    for domain in cfg.domains:
        for p in bench.acceptance_domain(domain)[: cfg.prompts_per_domain]:
            out.append((p.id, domain, encode_chat_prompt(tok, p.text)))
    return out


def _prefill_steps(client, prompt_ids, gen_ids, k):
    got = client.prompt_logprobs(list(prompt_ids) + list(gen_ids), k, seq_id="sc-prefill")
    return tuple(got.positions[len(prompt_ids) - 1:])   # rows are positions 1..n-1


@pytest.fixture(scope="module")
def sc_runs(engine_client, gate_config, gate_tokenizer):
    cfg = gate_config.selfconsistency
    n, k = cfg.max_tokens, cfg.k
    runs = []
    for pid, domain, ids in _prompts(cfg, gate_tokenizer):
        d1 = _engine.complete(engine_client, ids, n, k, seq_id=pid)
        d2 = _engine.complete(engine_client, ids, n, k, seq_id=pid)
        f1 = _prefill_steps(engine_client, ids, d1.token_ids, k)
        f2 = _prefill_steps(engine_client, ids, d1.token_ids, k)
        runs.append(sc.PromptRuns(pid, domain, len(ids), (d1.positions, d2.positions), (f1, f2)))
    return runs


def _band(cfg, profile: str = "", flags: tuple[str, ...] = ()) -> sc.Band:
    """The floor of ``profile+flag+...`` (flags sorted) when the config names one, else the profile's, else the
    default: a flag can change the kernels decode and prefill run (gates/config-vllm-cpu-dsv4.toml)."""
    floors = cfg.floors
    key = "+".join([profile, *sorted(flags)])
    mean, worst = floors.get(key, floors.get(profile, (cfg.floor_mean, cfg.floor_worst)))
    return sc.Band(cfg.spread_factor, float(mean), float(worst), cfg.top1_decided_min, cfg.min_positions)


def test_self_consistency(sc_runs, gate_config, engine_facts, engine_endpoint, gate_run):
    cfg = gate_config.selfconsistency
    res = sc.judge(sc_runs, _band(cfg, engine_endpoint.profile, engine_endpoint.flags), block=engine_facts["block_size"])
    gate_run.add(GateEntry("self_consistency", res.passed, profile=engine_endpoint.profile,
                           failures=res.failures, metrics=headline(res.summary),
                           evidence={"summary": res.summary, "regions": res.rows, "prompts": res.prompts,
                                     "config": cfg.model_dump(mode="json")}))
    rows = [{k: r[k] for k in ("region", "positions", "kl_part_mean", "kl_part_median", "kl_part_max", "top1_decided",
                              "max_abs_dlogprob_decided", "spread_mean", "band", "pass")} for r in res.rows]
    gate_run.add_section("Self-consistency: decode vs prefill (gates.md §4)", rows,
                         f"{engine_endpoint.profile}: {res.summary['prompts']} prompts, {res.summary['positions']} "
                         f"generated positions; worst prompt mean {res.summary['worst_prompt_mean']:.3g} "
                         f"(band {res.summary['band_worst']:.3g}); {res.summary['band_rule']}")
    assert res.summary["positions"] == sum(len(r.decode[0]) for r in sc_runs) > 0
    assert res.passed, "self-consistency gate failed:\n" + "\n".join(res.failures)


def test_self_consistency_detects_wrong_context(sc_runs, engine_client, engine_endpoint, gate_config, gate_tokenizer,
                                                gate_run):
    """Violation: the decode steps of prompt A against a prefill that scores the same generated ids after
    another prompt's context (what a decode path reading the wrong KV looks like). The gate must fail."""
    cfg = gate_config.selfconsistency
    prompts = _prompts(cfg, gate_tokenizer)
    a, other = sc_runs[0], prompts[-1]
    assert other[0] != a.prompt_id
    gen_ids = [s.actual_id for s in a.decode[0]]
    wrong = _prefill_steps(engine_client, other[2], gen_ids, cfg.k)
    bad = sc.PromptRuns(a.prompt_id + "+wrong-context", a.domain, a.prompt_len, a.decode, (wrong, wrong))
    res = sc.judge([bad], _band(cfg, engine_endpoint.profile, engine_endpoint.flags))
    gate_run.add(GateEntry("self_consistency_violation", not res.passed,
                           evidence={"case": bad.prompt_id, "caught": res.failures, "summary": res.summary}))
    assert not res.passed
    assert any("mean KL_part" in f for f in res.failures), res.failures
