"""The divergence localizer on DeepSeek-V4 (vllm-cpu-dsv4: the tiny V4, unquantized form, bf16, AVX512-BF16 CPUs)
against the DeepSeek oracle and its reference-bf16 floor: one engine process, the fault off and the plugin's fault
on the first, a middle and the last layer x attn / ffn. The floor of this bf16 engine is 4-13 % per site, so the
fault is planted at scale 1.0 (the module's output doubled): a 1e-3 fault is below it (docs/DESIGN.md, "The
divergence localizer"). A DeepSeek-V4 launch on top of CI's own: marker `long`, the nightly job runs it."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.long]

PROFILE = "vllm-cpu-dsv4"


def test_planted_faults_on_deepseek_v4_are_named_exactly(tmp_path):
    from ds41gates.localize import n_decoder_layers, planted_cases, planted_table, prompt_ids, run_localize

    ids, source = prompt_ids(PROFILE, panel_item="knowledge-01-water")
    cases = planted_cases(n_decoder_layers(PROFILE), scale=1.0)
    recs = run_localize(PROFILE, ids, source, tmp_path, cases=cases)
    table = planted_table(recs, cases)
    assert [r for r in table if not r["exact"]] == []
    assert recs["clean"].floor["precision"] == "reference-bf16" and recs["clean"].oracle["oracle"] == "oracle.dsv41"
    assert all(r["plugin_target"].endswith((".attn", ".ffn")) for r in table[1:])
