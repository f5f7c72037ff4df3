"""The divergence localizer on DeepSeek-V4 (vllm-cpu-dsv4: the tiny V4, unquantized form, bf16, AVX512-BF16 CPUs).

A/B mode, the engine against itself: faults planted in the weights through the runner's test-only ``tweak`` (not
engine/vllm_perturb's output scale), each where the old localizer said "no site diverged" or blamed the wrong
site: a hyper-connection POST mix of layer 2's attention (the streams between attention and MoE move, the
attention's input and output do not), a hyper-connection PRE mix of layer 1's MoE (its input moves), a router bias
on one expert of layer 3 (the experts it chooses change, its input does not), the final norm, one embedding row. Each must be named exactly (layer and site); the clean control
names nothing. Oracle mode on the same cases (against the DeepSeek oracle and its reference-bf16 floor): the rule
— a case whose greedy output differs from the oracle's is never "clean"; a fault far above the bf16 floor (the
final norm negated) is named there too.

Two DeepSeek-V4 engine processes and two oracle loads on top of CI's own: marker `long`, the nightly job runs it."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.long]

PROFILE = "vllm-cpu-dsv4"
ITEM = "knowledge-01-water"


def _cases(ids: list[int]) -> list[dict]:
    return [
        {"name": "clean", "perturb": None},
        {"name": "hc_post_L2", "perturb": None,
         "tweak": [{"param": "model.layers.2.hc_attn_base", "index": 5, "add": 1.0}]},      # post mix (4..7)
        {"name": "hc_pre_L1_ffn", "perturb": None,
         "tweak": [{"param": "model.layers.1.hc_ffn_base", "index": 1, "add": 1.0}]},       # pre mix (0..3)
        {"name": "router_bias_L3", "perturb": None,
         "tweak": [{"param": "model.layers.3.ffn.gate.e_score_correction_bias", "index": 7, "add": 10.0}]},
        {"name": "final_norm", "perturb": None, "tweak": [{"param": "model.norm.weight", "index": 7, "scale": 1.01}]},
        {"name": "embed", "perturb": None,
         "tweak": [{"param": "model.embed_tokens.weight", "index": ids[5], "scale": 1.01}]},
    ]


WANT = {"hc_post_L2": ("L2.attn_stream", 2, "attn_stream"), "hc_pre_L1_ffn": ("L1.ffn_in", 1, "ffn_in"),
        "router_bias_L3": ("L3.router", 3, "router"), "final_norm": ("final_norm", None, "final_norm"),
        "embed": ("embed", None, "embed")}


@pytest.fixture(scope="module")
def prompt():
    from ds41gates.localize import prompt_ids

    return prompt_ids(PROFILE, panel_item=ITEM)


def test_planted_faults_on_deepseek_v4_are_named_exactly_against_the_engine_itself(prompt, tmp_path):
    from ds41gates.localize import run_ab

    ids, source = prompt
    recs = run_ab(PROFILE, ids, source, tmp_path, cases=_cases(ids), oracle_context=False)
    v = recs["clean"].verdict
    assert (v.status, v.diverged_sites) == ("clean", 0)
    names = {s.name for s in recs["clean"].sites}
    assert {"L2.attn_stream", "L1.ffn_in", "L0.attn_in", "L1.indexer", "L3.router", "embed", "final_norm",
            "logits"} <= names
    for name, (site, layer, module) in WANT.items():
        v = recs[name].verdict
        assert (v.status, v.site, v.first_divergent_layer, v.first_divergent_module) == \
            ("named", site, layer, module), (name, v)
        assert v.ratio_before in (None, 0.0), name          # bit-exact before it: the floor is zero
    assert recs["embed"].verdict.onset_position == ids.index(ids[5])


def test_in_oracle_mode_an_output_that_differs_is_never_clean(prompt, tmp_path):
    from ds41gates.localize import run_localize

    ids, source = prompt
    cases = _cases(ids) + [{"name": "final_norm_negated", "perturb": None,
                            "tweak": [{"param": "model.norm.weight", "index": None, "scale": -1.0}]}]
    recs = run_localize(PROFILE, ids, source, tmp_path, cases=cases)
    assert recs["clean"].floor["precision"] == "reference-bf16" and recs["clean"].oracle["oracle"] == "oracle.dsv41"
    assert recs["clean"].verdict.status != "named"               # the clean engine leaves no site of its floor
    for name, rec in recs.items():
        v = rec.verdict
        if v.output_differs:
            assert v.status in ("named", "floor_too_wide"), (name, v)
        if v.status == "floor_too_wide":
            assert "narrower" in v.explanation
    v = recs["final_norm_negated"].verdict
    assert v.site in ("final_norm", "logits") and v.output_differs


LONG_TOKENS = 136   # past 128: the ratio-128 compressor (layer 2) completes its first entry at position 127


def test_the_compressors_entries_and_the_routing_weights_are_sites_of_their_own(tmp_path):
    """The compressed KV entries per ratio (layer 1: ratio 4, layer 3: ratio 4, layer 2: ratio 128) and the
    router's weights beside its chosen experts, each named by a fault planted in the weights (A/B mode, one engine
    process): a compressor's position bias (``ape``, slot 0) moves only the entries it pools, from the first
    entry its ratio completes (position 3 at ratio 4, 127 at ratio 128); a gate scaled on a hash-routed layer
    (layer 1: the experts are chosen by token id) keeps every chosen set and moves only the weights, so
    ``L1.router`` stays equal and ``L1.router_weights`` names it. The clean control names nothing."""
    from pathlib import Path

    from ds41gates.localize import prompt_ids, run_ab

    text = (Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "localize_prompt.txt").read_text()
    ids, source = prompt_ids(PROFILE, prompt=text, max_tokens=LONG_TOKENS)
    cases = [
        {"name": "clean", "perturb": None},
        {"name": "compressor_r4_L1", "perturb": None,
         "tweak": [{"param": "model.layers.1.attn.compressor.ape", "index": 0, "add": 1.0}]},
        {"name": "compressor_r128_L2", "perturb": None,
         "tweak": [{"param": "model.layers.2.attn.compressor.ape", "index": 0, "add": 1.0}]},
        {"name": "router_weights_L1", "perturb": None,
         # vLLM CPU packs the gate's weight into its GEMM and drops it: the whole matrix x 1.05 is its GEMM's
         # output x 1.05 (no bias); on a hash-routed layer the chosen experts cannot move
         "tweak": [{"packed_linear": "model.layers.1.ffn.gate", "scale": 1.05}]},
    ]
    recs = run_ab(PROFILE, ids, source, tmp_path, cases=cases, oracle_context=False)
    clean = recs["clean"]
    assert (clean.verdict.status, clean.verdict.diverged_sites) == ("clean", 0)
    names = {s.name for s in clean.sites}
    assert {"L1.compressor", "L2.compressor", "L3.compressor", "L1.router_weights", "L3.router_weights"} <= names
    assert "L0.compressor" not in names                          # layer 0 is sliding-window only: no compressor
    assert clean.engine["model"]["site_modules"]["compress_ratios"] == {"0": 1, "1": 4, "2": 128, "3": 4}
    # the entries read from the engine's cache sit where vLLM's compressed slot mapping put them: one per
    # completed group, at its last token
    from engine.localize import LazyCaptures

    raw = LazyCaptures(tmp_path / "a" / "captures" / "clean.safetensors")
    for layer, ratio in ((1, 4), (2, 128), (3, 4)):
        rows = raw[f"prefill/L{layer}.compressor"]
        assert rows.shape == (LONG_TOKENS, 512)
        filled = [p for p in range(LONG_TOKENS) if rows[p].abs().sum() > 0]
        assert filled == [p for p in range(LONG_TOKENS) if (p + 1) % ratio == 0], (layer, filled[:8])
        assert bool(rows.isfinite().all())
    want = {"compressor_r4_L1": ("L1.compressor", 1, "compressor", 3),
            "compressor_r128_L2": ("L2.compressor", 2, "compressor", 127),
            "router_weights_L1": ("L1.router_weights", 1, "router_weights", 0)}
    for name, (site, layer, module, onset) in want.items():
        rec = recs[name]
        assert rec.engine["tweak"]["edits"][0]["changed"] > 0, name
        v = rec.verdict
        assert (v.status, v.site, v.first_divergent_layer, v.first_divergent_module, v.phase) == \
            ("named", site, layer, module, "prefill"), (name, v)
        assert v.onset_position == onset, (name, v.onset_position)
        assert v.ratio_before in (None, 0.0), name
    by_key = {s.key: s for s in recs["router_weights_L1"].sites}
    assert by_key["prefill/L1.router"].worst == 0.0 and by_key["prefill/L1.router_weights"].worst > 0
    # a compressor's entries only exist where a group completes: every other row is equal (both zero)
    comp = {s.key: s for s in recs["compressor_r128_L2"].sites}["prefill/L2.compressor"]
    assert comp.departed == 1 and comp.worst_position == 127


INDEXER_TOKENS = 2300   # past 2,051: a ratio-4 query sees more than index_topk = 512 compressed blocks


def test_an_indexer_selection_fault_is_named_past_the_top_k(tmp_path):
    """The indexer-selection fault (issue 36 "Left"). Below 2,048 tokens the tiny V4's indexer keeps every
    compressed block (fewer than its top-k of 512), so no weight can change what it selects; at 2,300 tokens a
    query at position p sees (p + 1) // 4 blocks and keeps 512 of them from position 2,051 on. The indexer's own
    compressor's position bias (``ape``, slot 0) of layer 1 moves its keys, hence its scores, hence which blocks
    it keeps: named ``L1.indexer`` (sets, 1 − Jaccard), not before position 2,048, with the attention's own
    compressed entries (``L1.compressor``, before it in the layer) equal. A/B mode, no oracle context (the
    comparison reads the logits in row chunks: the harness stays within a few GB at this length)."""
    import resource

    from ds41gates.localize import oracle_for, run_ab
    from panels import load_tokenizer
    from panels.bench import prefill_prompt

    tok = load_tokenizer(oracle_for(PROFILE)[2])
    ids = [int(t) for t in prefill_prompt(tok, INDEXER_TOKENS + 200, salt="localize-indexer",
                                          chat=False).token_ids][:INDEXER_TOKENS]
    assert len(ids) == INDEXER_TOKENS
    source = {"kind": "prompt", "text": "panels.bench.prefill_prompt(salt=localize-indexer)"}
    cases = [{"name": "clean", "perturb": None},
             {"name": "indexer_L1", "perturb": None,
              "tweak": [{"param": "model.layers.1.attn.indexer.compressor.ape", "index": 0, "add": 1.0}]}]
    recs = run_ab(PROFILE, ids, source, tmp_path, cases=cases, oracle_context=False, decode=False)
    assert recs["clean"].verdict.status == "clean"
    v = recs["indexer_L1"].verdict
    assert (v.status, v.site, v.first_divergent_layer, v.first_divergent_module) == \
        ("named", "L1.indexer", 1, "indexer"), v
    assert v.onset_position >= 2048 and v.ratio_before in (None, 0.0)
    by_key = {s.key: s for s in recs["indexer_L1"].sites}
    assert by_key["prefill/L1.compressor"].worst == 0.0 and 0 < by_key["prefill/L1.indexer"].worst < 1
    print(f"harness peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB; runner "
          f"{recs['clean'].engine['base_runner_max_rss_mb']} MB; timings {recs['indexer_L1'].timings}")
