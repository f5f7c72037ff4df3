"""The divergence localizer's can-fail on the real engine (vLLM CPU, SmolLM2, vllm-cpu-fp32): the fault-injection
plugin scales one module of one layer by 1e-3 and the localizer must name exactly that layer and module, for the
first, a middle and the last layer, attention and MLP; with the fault off it names nothing.

Cost on the shared 2-core box: every case shares ONE engine process and one oracle + floor capture on a 48-token
prompt. That process is started the way `ds41gate localize --engine-env` starts it, with DS41_PERTURB_LAYER=7 /
DS41_PERTURB_MODULE=attn in its environment, so the plugin's own load-time path (vLLM's general-plugin entry point
wrapping the model loader) is what the first case ("env") sees; the later cases move the fault through
LLM.apply_model. The CLI's own wiring (options -> run_localize -> localize.json / png / md) is then checked on that
session's record, without a second engine start."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

PROFILE = "vllm-cpu-fp32"
ITEM, TOKENS = "knowledge-02-printing", 48
REPO = Path(__file__).resolve().parents[2]
ENV_FAULT = {"DS41_PERTURB_LAYER": "7", "DS41_PERTURB_MODULE": "attn"}


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    from ds41gates.localize import n_decoder_layers, planted_cases, prompt_ids, run_localize

    ids, source = prompt_ids(PROFILE, panel_item=ITEM, max_tokens=TOKENS)
    cases = planted_cases(n_decoder_layers(PROFILE))
    t0 = time.perf_counter()
    work = tmp_path_factory.mktemp("localize")
    recs = run_localize(PROFILE, ids, source, work,
                        cases=[{"name": "env", "perturb": "env"}] + cases, engine_env=ENV_FAULT)
    return recs, cases, ids, time.perf_counter() - t0, work


def test_every_planted_fault_is_named_exactly_and_the_clean_engine_names_none(planted):
    from ds41gates.localize import planted_table

    recs, cases, _, wall, _ = planted
    assert [c["name"] for c in cases] == ["clean", "L0.attn", "L0.mlp", "L15.attn", "L15.mlp", "L29.attn", "L29.mlp"]
    table = planted_table(recs, cases)
    bad = [r for r in table if not r["exact"]]
    assert bad == [], f"named differently from planted: {bad}"
    for row in table[1:]:
        assert row["phase"] == "prefill" and row["ratio_at_named"] > 10
        # the stage before the named one is inside its threshold (no earlier site moved)
        assert row["ratio_layer_before"] is None or row["ratio_layer_before"] < 1
        # the engine itself says which module it perturbed
        suffix = "self_attn" if row["planted_module"] == "attn" else "mlp"
        assert row["plugin_target"] == f"model.layers.{row['planted_layer']}.{suffix}"
    assert table[0]["plugin_target"] is None and table[0]["max_ratio"] < 1 and table[0]["status"] == "clean"
    print(f"\nplanted-fault session: {len(cases)} cases in {wall:.1f} s")


def test_the_record_carries_the_positions_growth_and_both_phases(planted):
    recs, _, ids, _, _ = planted
    rec = recs["L15.mlp"]
    v = rec.verdict
    assert rec.floor["precision"] == "fp64" and rec.oracle["precision"] == "fp32"
    assert rec.prompt["token_ids"] == ids and rec.prompt["decode_token_id"] == rec.engine["generated_ids"][0]
    assert {s.phase for s in rec.sites} == {"prefill", "decode"} and len(rec.sites) == 2 * (30 * 3 + 3)
    assert v.positions and all(ids[p.position] == p.token_id and p.ratio > 1 for p in v.positions)
    assert [g.layer for g in v.growth] == list(range(15, 30))
    # the decode step sees the same fault: its own first divergent site is the same
    from core.localize import site_order

    decode_first = min((s for s in rec.sites if s.phase == "decode" and s.diverged), key=lambda s: site_order(s.key))
    assert (decode_first.layer, decode_first.module) == (15, "mlp") and v.onset_step == 1


def test_the_fault_turned_on_by_the_plugins_environment_variables_is_named(planted):
    rec = planted[0]["env"]
    assert rec.engine["perturb"]["target"] == "model.layers.7.self_attn"   # installed at load, by the env
    assert rec.engine["env"]["DS41_PERTURB_LAYER"] == "7"
    assert (rec.verdict.first_divergent_layer, rec.verdict.first_divergent_module) == (7, "attn")


def test_the_cli_writes_the_record_plot_and_summary(planted, tmp_path, monkeypatch):
    import ds41gates.localize as loc
    from ds41gates.cli import main

    seen = {}

    def fake_run(profile, ids, source, work, **kw):
        seen.update(profile=profile, ids=ids, source=source, **kw)
        return {"run": planted[0]["env"]}

    monkeypatch.setattr(loc, "run_localize", fake_run)
    out = tmp_path / "loc"
    rc = main(["localize", "--engine-profile", PROFILE, "--engine-env", "DS41_PERTURB_LAYER=7",
               "--engine-env", "DS41_PERTURB_MODULE=attn", "--panel-item", ITEM, "--max-prompt-tokens", "16",
               "--out", str(out)])
    assert rc == 0
    assert seen["profile"] == PROFILE and len(seen["ids"]) == 16 and seen["source"]["seq_id"] == ITEM
    assert seen["engine_env"] == ENV_FAULT and seen["decode"] is True and seen["layers"] is None
    data = json.loads((out / "localize.json").read_text())
    assert data["format"] == "ds41-localize/2"
    assert (data["verdict"]["first_divergent_layer"], data["verdict"]["first_divergent_module"]) == (7, "attn")
    assert (out / "localize.png").stat().st_size > 10_000 and (out / "localize-decode.png").exists()
    assert "| 7 |" in (out / "localize.md").read_text()
    assert main(["localize", "--out", str(out), "--prompt", "x", "--panel-item", ITEM]) == 2   # one of the two
    assert main(["localize", "--out", str(out), "--prompt", "a b c", "--engine-env", "NOEQUALS"]) == 2
    assert main(["localize", "--out", str(out), "--prompt", "a b c", "--layers", "0,15,29"]) == 0
    assert seen["layers"] == [0, 15, 29]
    assert main(["localize", "--out", str(out), "--prompt", "a b c", "--layers", "x"]) == 2
    assert main(["localize", "--out", str(out), "--prompt", "a b c", "--layers", "0,999"]) == 2   # out of range


def test_every_capture_went_through_the_spill_one_site_at_a_time_and_none_is_left(planted):
    """Memory bound, on the real engine: the hooks wrote one file per layer x site x forward call (nothing kept in
    the worker), the runner assembled them into one file per case and removed them, and the oracle's and the
    floor's spill folders are gone after the comparison."""
    from safetensors import safe_open

    recs, cases, _, _, work = planted
    for name, rec in recs.items():
        calls = rec.engine["rows_per_call"]
        assert sum(calls) == len(rec.prompt["token_ids"]) + 1
        assert rec.engine["spill_files"] == (30 * 3 + 3) * len(calls), name
        with safe_open(str(work / "captures" / f"{name}.safetensors"), framework="pt") as f:
            assert len(list(f.keys())) == 2 * (30 * 3 + 3)
    assert sorted(p.name for p in (work / "captures").iterdir()) == sorted(f"{n}.safetensors" for n in recs)
    assert not (work / "oracle").exists()
