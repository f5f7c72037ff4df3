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
