"""Gate: DeepSeek attention at depth (issue 39) — decode after a long prefill against the engine's own one-pass
prefill of the same tokens, where the tiny V4's sliding window (128) is full and evicting, the ratio-128
compressor has emitted entries and, past 2,048 tokens, the indexer (top-512 of the ratio-4 entries) prunes.

The rule is the self-consistency gate's (gates.md §4, gates/lib/selfconsistency.py): two greedy decodes with top-k
logprobs after the prompt, two prefills of prompt + decode 1's ids, KL_part(prefill ‖ decode) per region against a
band from the engine's own run-to-run spread (the profile's self-consistency floors). The prompts are the bench
set's real prose filler cut to an exact token count (panels.bench.prefill_prompt: a salted system turn, so no two
requests share a cache block). Lengths per profile in the ``[long_context]`` sizes table: ``ci_lengths`` run in CI
(on vllm-cpu-dsv4 one prompt past 2,048 tokens), ``long_lengths`` (4K, 16K) carry the ``long`` marker and run in
the nightly. KL / top-1 per depth bucket against the oracle's long-context reference of long@1 (``kl_lengths``,
``long_kl_lengths``) is ``long`` too: its reference costs minutes per item. A profile with no lengths, or whose ``max_model_len`` cannot hold them, is not applicable here
(recorded as such, xfail), never a PASS.
"""

from __future__ import annotations

import time

import pytest

from core.results import GateEntry, headline
from gates import _engine
from gates.lib import selfconsistency as sc

pytestmark = [pytest.mark.gate, pytest.mark.engine]


def _prompt(tok, n_tokens: int) -> tuple[int, ...]:
    from panels.bench import prefill_prompt

    chat = not tok.missing_markers()   # DeepSeek-V4 has no system-turn marker: the raw form, salt after BOS
    return tuple(int(t) for t in prefill_prompt(tok, n_tokens, salt=f"longctx{n_tokens:06d}", chat=chat).token_ids)


def _band(gate_config, profile: str, flags: tuple[str, ...]) -> sc.Band:
    cfg = gate_config.selfconsistency
    floors = cfg.floors
    key = "+".join([profile, *sorted(flags)])
    mean, worst = floors.get(key, floors.get(profile, (cfg.floor_mean, cfg.floor_worst)))
    return sc.Band(cfg.spread_factor, float(mean), float(worst), cfg.top1_decided_min, cfg.min_positions)


def _run_lengths(lengths, gate_name, engine_client, engine_facts, engine_endpoint, gate_config, gate_tokenizer,
                 gate_run):
    cfg = gate_config.long_context
    n, k = cfg.max_tokens, cfg.k
    profile = engine_endpoint.profile
    limit = engine_facts["max_model_len"]
    if not lengths or limit is None or max(lengths) + n > limit:
        why = (f"no long-context lengths configured for profile {profile!r} ([long_context] of its sizes file)"
               if not lengths else f"max_model_len {limit} cannot hold {max(lengths)} + {n} tokens")
        gate_run.add(GateEntry(gate_name, None, profile=profile, failures=(why,),
                               evidence={"config": cfg.model_dump(mode="json")}))
        pytest.xfail(f"{gate_name} not applicable: {why}")
    runs, seconds = [], {}
    for length in lengths:
        ids = _prompt(gate_tokenizer, length)
        assert len(ids) <= length and len(ids) > 0.95 * length, (len(ids), length)
        t0 = time.perf_counter()
        d1 = _engine.complete(engine_client, ids, n, k, seq_id=f"long-{length}-d1")
        d2 = _engine.complete(engine_client, ids, n, k, seq_id=f"long-{length}-d2")
        t1 = time.perf_counter()
        rows = []
        for rep in (1, 2):
            got = engine_client.prompt_logprobs(list(ids) + list(d1.token_ids), k, seq_id=f"long-{length}-p{rep}")
            rows.append(tuple(got.positions[len(ids) - 1:]))   # rows are positions 1..n-1
        seconds[str(length)] = {"two_decodes_s": round(t1 - t0, 1), "two_prefills_s": round(time.perf_counter() - t1, 1)}
        assert len(d1.positions) == n, f"{length}: decode gave {len(d1.positions)} steps, asked {n}"
        runs.append(sc.PromptRuns(f"prose-{len(ids)}", "prose", len(ids), (d1.positions, d2.positions),
                                  (rows[0], rows[1])))
    res = sc.judge(runs, _band(gate_config, profile, engine_endpoint.flags), block=engine_facts["block_size"])
    gate_run.add(GateEntry(gate_name, res.passed, profile=profile, failures=res.failures,
                           metrics=headline(res.summary),
                           evidence={"summary": res.summary, "regions": res.rows, "prompts": res.prompts,
                                     "seconds": seconds, "max_model_len": limit,
                                     "config": cfg.model_dump(mode="json")}))
    rows = [{k: r[k] for k in ("region", "positions", "kl_part_mean", "kl_part_max", "top1_decided",
                              "spread_mean", "band", "pass")} for r in res.rows]
    gate_run.add_section(f"Long context: decode after a long prefill vs one-pass prefill ({gate_name})", rows,
                         f"{profile}: prompts of {[r.prompt_len for r in runs]} tokens, {n} generated tokens "
                         f"each; worst prompt mean {res.summary.get('worst_prompt_mean', float('nan')):.3g} "
                         f"(band {res.summary.get('band_worst', float('nan')):.3g}); seconds {seconds}")
    assert res.summary["positions"] == n * len(runs)
    assert res.passed, f"{gate_name} failed:\n" + "\n".join(res.failures)


def test_long_prefill_self_consistency(engine_client, engine_facts, engine_endpoint, gate_config, gate_tokenizer,
                                       gate_run):
    """CI: the profile's ci_lengths (vllm-cpu-dsv4: one prompt past 2,048 tokens, so the indexer prunes)."""
    _run_lengths(gate_config.long_context.ci_lengths, "long_self_consistency", engine_client, engine_facts,
                 engine_endpoint, gate_config, gate_tokenizer, gate_run)


@pytest.mark.long
def test_long_prefill_self_consistency_deep(engine_client, engine_facts, engine_endpoint, gate_config,
                                            gate_tokenizer, gate_run):
    """Nightly: the profile's long_lengths (vllm-cpu-dsv4: 4K and 16K)."""
    _run_lengths(gate_config.long_context.long_lengths, "long_self_consistency_deep", engine_client,
                 engine_facts, engine_endpoint, gate_config, gate_tokenizer, gate_run)


# --------------------------------------------------------------------------------------------------- KL at depth

def _kl_by_depth(lengths, gate_name, engine_endpoint, engine_facts, gate_target, gate_config, long_reference,
                 gate_run):
    """The engine against the oracle's long-context reference of long@1's items of ``lengths`` tokens, judged per
    depth bucket (core.metrics.by_depth, the profile's [depth] bands); the reference's mechanism masks join the
    session's coverage (gate_run.add_coverage), and the per-bucket KL table and the coverage table go to the
    report."""
    from engine.endpoint import DEFAULT_ENGINE_K, score_engine
    from gates.lib.depth import judge_at_depth, long_items, not_applicable

    profile = engine_endpoint.profile
    why = not_applicable(lengths, engine_facts["max_model_len"], profile)
    if why:
        gate_run.add(GateEntry(gate_name, None, profile=profile, failures=(why,)))
        pytest.xfail(f"{gate_name} not applicable: {why}")
    encoded = long_items(lengths, gate_config.long_context.kl_domains, gate_target.tokenizer)
    t0 = time.perf_counter()
    ref = long_reference(encoded)
    t1 = time.perf_counter()
    eng = score_engine(engine_endpoint, encoded, DEFAULT_ENGINE_K)
    t2 = time.perf_counter()
    gate_run.add_coverage(ref, lengths=lengths)
    verdict = judge_at_depth(ref, eng, gate_target.bands, profile)
    gate_run.add(GateEntry(gate_name, verdict.passed, profile=profile, failures=verdict.failures,
                           metrics=verdict.metrics(),
                           evidence={"buckets": list(verdict.rows), "lengths": list(lengths),
                                     "seconds": {"reference": round(t1 - t0, 1), "engine": round(t2 - t1, 1)}}))
    gate_run.add_section(f"Long context: KL / top-1 per depth bucket against the oracle ({gate_name})",
                         list(verdict.rows),
                         f"{profile} vs the {gate_target.oracle} oracle ({gate_target.precision}) on long@1 items "
                         f"of {list(lengths)} tokens; bands per bucket: [depth.{profile}] in {gate_target.bands}")
    assert verdict.passed, f"{gate_name} failed:\n" + "\n".join(verdict.failures)


@pytest.mark.long
def test_long_kl_by_depth(engine_endpoint, engine_facts, gate_target, gate_config, long_reference, gate_run):
    """long@1's items of the profile's kl_lengths (vllm-cpu-dsv4: 2,560 tokens, past the indexer's 2,048). Marked
    long: the oracle's reference of the five 2,560-token items took ~11 min per item on this loaded 2-core box (it
    is cached after; docs/DSV4_ENGINE.md §9), beyond CI's budget on a fresh machine."""
    _kl_by_depth(gate_config.long_context.kl_lengths, "long_kl_by_depth", engine_endpoint, engine_facts,
                 gate_target, gate_config, long_reference, gate_run)


@pytest.mark.long
def test_long_kl_by_depth_deep(engine_endpoint, engine_facts, gate_target, gate_config, long_reference,
                               gate_run):
    """Nightly: long@1's items of the profile's long_kl_lengths (vllm-cpu-dsv4: 16K)."""
    _kl_by_depth(gate_config.long_context.long_kl_lengths, "long_kl_by_depth_deep", engine_endpoint,
                 engine_facts, gate_target, gate_config, long_reference, gate_run)
