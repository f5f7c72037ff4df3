"""The localizer's A/B mode on the real engine (vLLM CPU, SmolLM2, vllm-cpu-fp32): the engine against itself.
Faults are planted in the WEIGHTS through the runner's test-only ``tweak`` (a parameter slice scaled, as a
changed checkpoint would do it; not engine/vllm_perturb's output scale), each one where the old localizer was
blind or wrong: the final norm (after the last layer), one embedding row (before layer 0), a norm inside a layer
(its attention / MLP input). Each must be named exactly, with its onset; the clean control and a flag of the perf class run in their
own engine process (kv_cache_2g: a memory budget, every bit unchanged) name nothing.

Cost: the base arm and every tweak in ONE engine process, the flag arm in a second, 48 prompt tokens + one
decode step, the oracle (fp32 transformers) once for context: 350 s on the 2-core box at load ~30, so marker
`long` (the A/B maths and verdict are CI's in tests/core/test_localize.py)."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.long]   # two engine launches: the nightly job runs it

PROFILE = "vllm-cpu-fp32"
ITEM, TOKENS = "knowledge-02-printing", 48
SCALE = 1.001      # 1e-3 of one weight slice


def _first_new_token(ids: list[int], at_least: int) -> tuple[int, int]:
    """(position, token) of the first token at or after ``at_least`` that does not occur before it."""
    for p in range(at_least, len(ids)):
        if ids[p] not in ids[:p]:
            return p, ids[p]
    raise AssertionError("no new token in the prompt")


@pytest.fixture(scope="module")
def ab(tmp_path_factory):
    from ds41gates.localize import prompt_ids, run_ab

    ids, source = prompt_ids(PROFILE, panel_item=ITEM, max_tokens=TOKENS)
    onset, tok = _first_new_token(ids, 9)
    work = tmp_path_factory.mktemp("ab")
    cases = [
        {"name": "clean", "perturb": None},
        {"name": "final_norm", "perturb": None,
         "tweak": [{"param": "model.norm.weight", "index": 7, "scale": SCALE}]},
        {"name": "embed", "perturb": None,
         "tweak": [{"param": "model.embed_tokens.weight", "index": tok, "scale": SCALE}]},
        {"name": "L7.attn", "perturb": None,
         "tweak": [{"param": "model.layers.7.input_layernorm.weight", "index": 3, "scale": SCALE}]},
        {"name": "L20.mlp", "perturb": None,
         "tweak": [{"param": "model.layers.20.post_attention_layernorm.weight", "index": 3, "scale": SCALE}]},
    ]
    recs = run_ab(PROFILE, ids, source, work, flags=["kv_cache_2g"], cases=cases)
    return recs, ids, onset


def test_each_planted_weight_fault_is_named_exactly_with_its_onset(ab):
    recs, ids, onset = ab
    want = {"final_norm": ("final_norm", None, "final_norm"), "embed": ("embed", None, "embed"),
            "L7.attn": ("L7.attn", 7, "attn"), "L20.mlp": ("L20.mlp", 20, "mlp")}
    for name, (site, layer, module) in want.items():
        v = recs[name].verdict
        assert recs[name].engine["tweak"]["edits"][0]["changed"] > 0, name
        assert (v.status, v.site, v.first_divergent_layer, v.first_divergent_module, v.phase) == \
            ("named", site, layer, module, "prefill"), (name, v)
        # against a deterministic engine's zero floor everything before the named site is equal, bit for bit
        assert v.ratio_before in (None, 0.0), (name, v.ratio_before)
    # onset: the embedding row of a token first used at position `onset` departs there and not before
    assert recs["embed"].verdict.onset_position == onset
    assert all(p.token_id == ids[onset] for p in recs["embed"].verdict.positions)
    # a norm weight reaches every position from position 0
    assert recs["final_norm"].verdict.onset_position == 0 and recs["final_norm"].verdict.onset_step == 1


def test_the_clean_controls_name_nothing_and_the_floor_is_the_engine_itself(ab):
    recs = ab[0]
    for name in ("clean", "flag"):
        rec = recs[name]
        v = rec.verdict
        assert (v.status, v.site, v.diverged_sites, v.output_differs) == ("clean", None, 0, ()), (name, v)
        assert rec.mode == "ab" and rec.floor["precision"] == "engine run-to-run"
        assert all(s.threshold == 0.0 and s.worst == 0.0 for s in rec.sites), name   # deterministic, bit for bit
    assert recs["flag"].engine["flags"] == ["kv_cache_2g"] and recs["flag"].engine["env"]["VLLM_CPU_KVCACHE_SPACE"] == "2"
    # sites from the embedding to the logits, both phases
    names = {s.name for s in recs["clean"].sites}
    assert {"embed", "final_norm", "logits", "L0.attn", "L29.resid"} <= names and len(names) == 3 + 30 * 3
    # the oracle beside the arms for context: the base arm's distance to it per site, small and nonzero
    ctx = recs["clean"].context
    assert set(ctx) == {s.key for s in recs["clean"].sites} and 0 < ctx["prefill/L15.resid"] < 1e-3


def test_outputs_that_differ_are_never_reported_clean(ab):
    for name, rec in ab[0].items():
        if rec.engine["generated_ids"] != rec.engine["base_generated_ids"]:
            assert rec.verdict.status != "clean" and rec.verdict.output_differs, name
