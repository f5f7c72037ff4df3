"""Flag registry (nightly/flags.py), A/B statistics (nightly/flag_ab.py) and `ds41gate flags` — no engine needed."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from core import metrics
from core.records import Record
from core.results import FlagGateVerdict, GateResults
from engine.adapters.base import Generation, PositionLogprobs
from engine.profiles import load_profile, parse_profile
from nightly import flag_ab as ab
from nightly.flags import (CLASS_GATES, FlagRegistryError, Thresholds, ValueSpec, check_profile,
                           lane_of, load_registry, load_registry_file, parse_registry)
from tests.core.recordkit import pair_of_records, provenance, sequence_from_full

REPO = Path(__file__).resolve().parents[2]
CPU_REGISTRY = REPO / "nightly" / "flags-vllm-cpu.toml"
SHARED = REPO.parent / "shared"  # the team's shared docs sit beside the checkout (CI copies them there too)
SEED_FLAGS = ["VLLM_DS41_MOE_EXL3_PLAN", "VLLM_DS41_MOE_EXL3_GROUP_MIN_TOKENS", "VLLM_DS41_BATCH_INVARIANT_GEMM",
              "VLLM_DS41_ATTN_GRAPH", "VLLM_DS41_BUILDER_GRAPHS", "VLLM_DS41_HC_FUSED", "VLLM_DS41_HC_NORM_EXACT"]


# ------------------------------------------------------------------------------------------ registry

def test_shipped_registry_covers_seed_cards_and_gates_md():
    reg = load_registry(env={})
    seeds = set()
    for card in (SHARED / "seeds").glob("*.txt") if (SHARED / "seeds").exists() else []:
        seeds |= set(re.findall(r"VLLM_DS41_[A-Z0-9_]*[A-Z0-9]", card.read_text()))
    for name in set(SEED_FLAGS) | seeds:
        assert name in reg, name
    # gates.md §10.5 proposed classes
    assert reg.get("VLLM_DS41_ATTN_GRAPH").cls == "exact"
    assert reg.get("VLLM_DS41_HC_FUSED").cls == "numerics"
    assert reg.get("VLLM_DS41_ENGRAM_PREFETCH").cls == "perf"
    assert reg.get("VLLM_DS41_CORE_LAYER_SUBSET").test_only
    assert reg.get("VLLM_DS41_MOE_EXL3_GROUP_MIN_TOKENS").production == "2"
    assert reg.get("VLLM_DS41_HC_NORM_EXACT").thresholds.kl_margin_rel == 0.0
    assert len(reg) >= 40


def test_gates_md_flags_all_registered():
    doc = SHARED / "docs" / "gates.md"
    if not doc.exists():
        pytest.skip("shared docs not mounted")
    names = set(re.findall(r"`(VLLM_DS41_[A-Z0-9_]*[A-Z0-9])`", doc.read_text()))
    names |= {"VLLM_DS41_" + n for n in re.findall(r"\| `([A-Z0-9_]+)`(?:, `[A-Z0-9_]+`)* \|", doc.read_text())
              if n.isupper() and not n.startswith("VLLM")}
    missing = sorted(n for n in names if n not in load_registry(env={}) and not n.endswith("_{WO,FFN,NEXT}_MB"))
    assert not missing


def test_class_gates():
    reg = load_registry([CPU_REGISTRY], env={})
    assert reg.get("no_prefix_cache").effective_gates() == CLASS_GATES["exact"]
    assert reg.get("chunked_prefill_64").effective_gates() == ("kl_band", "paired_not_worse")
    assert "speed" in reg.get("kv_cache_2g").effective_gates()
    assert reg.get("kv_cache_2g").thresholds.speed_tolerance == 0.25


def test_user_file_merges_over_shipped(tmp_path):
    user = tmp_path / "mine.toml"
    user.write_text('[flags.VLLM_DS41_HC_FUSED]\nclass = "exact"\nevidence = ["reports/ab-hc.html"]\n'
                    '[flags.VLLM_DS41_HC_FUSED.thresholds]\nalpha = 0.01\n'
                    '[flags.my_new_flag]\ndescription = "a team flag"\nclass = "perf"\n')
    base = load_registry(env={})
    reg = load_registry([user], env={})
    hc = reg.get("VLLM_DS41_HC_FUSED")
    assert hc.cls == "exact" and hc.evidence == ("reports/ab-hc.html",)
    assert hc.description == base.get("VLLM_DS41_HC_FUSED").description      # kept
    assert hc.thresholds.alpha == 0.01 and hc.thresholds.kl_margin_rel == 0.05
    assert reg.get("my_new_flag").cls == "perf"
    assert len(reg) == len(base) + 1 and reg.content_hash != base.content_hash
    # the environment variable does the same
    via_env = load_registry(env={"DS41_FLAG_REGISTRY": str(user)})
    assert via_env.get("VLLM_DS41_HC_FUSED").cls == "exact"


@pytest.mark.parametrize("text,match", [
    ('[flags.X]\nclass = "exact"\n', "description"),
    ('[flags.X]\ndescription = "d"\nclass = "fast"\n', "class"),
    ('[flags.X]\ndescription = "d"\nclass = "exact"\ncolour = 1\n', "unknown key"),
    ('[flags.X]\ndescription = "d"\nclass = "exact"\ngates = ["nope"]\n', "unknown gate"),
    ('[flags.X]\ndescription = "d"\nclass = "exact"\nvalues = { type = "int", min = 5, max = 1 }\n', "min 5 > "),
    ('[flags.X]\ndescription = "d"\nclass = "exact"\nvalues = { type = "int", max = 3 }\ndefault = "7"\n', "outside"),
    ('[flags.X]\ndescription = "d"\nclass = "exact"\n[flags.X.thresholds]\nalpha = 2\n', "alpha"),
    ('[flags.X]\ndescription = "d"\nclass = "exact"\n[flags.X.thresholds]\nspeed = 2\n', "unknown threshold"),
    ('[flags.X]\ndescription = "d"\nclass = "exact"\n[flags.X.thresholds]\nkl_margin_rel = inf\n', "finite number"),
    ('[flags.X]\ndescription = "d"\nclass = "exact"\n[flags.X.thresholds]\nkl_floor_abs = nan\n', "finite number"),
    ('[flags.X]\ndescription = "d"\nclass = "exact"\n[flags.X.thresholds]\nkl_floor_abs = -1e-9\n', ">= 0"),
    ('[flags.X]\ndescription = "d"\nclass = "exact"\n[flags.X.thresholds]\nspeed_tolerance = 1.5\n', r"\[0, 1\)"),
    ('[flags.X]\ndescription = "d"\nclass = "exact"\n[flags.X.thresholds]\nrequire_speedup = "yes"\n', "bool"),
    ('[flags.VLLM_DS41_]\ndescription = "d"\nclass = "exact"\n', "part after the prefix"),
    ('[flagz.X]\n', "unknown top-level"),
])
def test_registry_errors_name_the_problem(text, match):
    import tomllib

    with pytest.raises(FlagRegistryError, match=match):
        parse_registry(tomllib.loads(text), "t.toml")


def test_missing_and_unknown(tmp_path):
    with pytest.raises(FlagRegistryError, match="does not exist"):
        load_registry_file(tmp_path / "absent.toml")
    with pytest.raises(FlagRegistryError, match="did you mean.*VLLM_DS41_HC_FUSED"):
        load_registry(env={}).get("VLLM_DS41_HC_FUSD")


def test_strict_value_parsing():
    b = ValueSpec(type="bool")
    assert b.parse("F", "On") is True and b.parse("F", "no") is False
    with pytest.raises(FlagRegistryError, match="F='2'"):
        b.parse("F", "2")
    i = ValueSpec(type="int", min=1, max=64)
    assert i.parse("T", "64") == 64
    for bad in ("0", "65", "0x10", "1.5", ""):
        with pytest.raises(FlagRegistryError, match="T="):
            i.parse("T", bad)
    s = ValueSpec(type="str", choices=("sm70", "torch"))
    assert s.parse("I", "torch") == "torch"
    with pytest.raises(FlagRegistryError, match="not one of"):
        s.parse("I", "cuda")
    assert lane_of("VLLM_DS41_MOE_IMPL") == "MOE" and lane_of("VLLM_DS41_BUILDER_GRAPHS") is None


def _profile(env=None, flags=None):
    return parse_profile({"command": ["x"], "env": env or {}, "flags": flags or {}}, default_name="p")


def test_profile_check_refuses_unknown_bad_and_test_only():
    reg = load_registry(env={})
    ok = check_profile(_profile({"VLLM_DS41_HC_FUSED": "1", "HF_HUB_OFFLINE": "1"}), reg)
    assert ok.ok and dict(ok.ds41_env) == {"VLLM_DS41_HC_FUSED": "1"}
    bad = check_profile(_profile({"VLLM_DS41_NOPE": "1", "VLLM_DS41_ENGRAM_IO_THREADS": "99",
                                  "VLLM_DS41_CORE_LAYER_SUBSET": "0-3"}), reg)
    text = "\n".join(bad.problems)
    assert "VLLM_DS41_NOPE is not in the flag registry" in text
    assert "VLLM_DS41_ENGRAM_IO_THREADS='99': outside [1, 64]" in text
    assert "test-only" in text
    # a flag table that sets an unknown VLLM_DS41_* is refused too, and so is an unmapped flag
    prof = _profile(flags={"VLLM_DS41_HC_FUSED": {"env": {"VLLM_DS41_HC_FUSED": "0", "VLLM_DS41_X": "1"}}})
    res = check_profile(prof, reg, ["VLLM_DS41_HC_FUSED", "VLLM_DS41_ATTN_GRAPH"])
    assert any("VLLM_DS41_X" in p for p in res.problems)
    assert any("no [flags.VLLM_DS41_ATTN_GRAPH] table" in p for p in res.problems)


def test_cpu_profiles_map_every_cpu_flag():
    reg = load_registry([CPU_REGISTRY], env={})
    fp32 = load_profile("vllm-cpu-fp32")
    for name in ("no_prefix_cache", "chunked_prefill_64", "dtype_bf16", "kv_cache_2g"):
        assert check_profile(fp32, reg, [name]).ok, name
    assert check_profile(fp32, load_registry(env={}), ["dtype_bf16"]).problems  # not in the shipped registry


# ------------------------------------------------------------------------------------------ A/B verdicts

def _gen(seq="s", ids=(5, 6, 7), lps=None, k=3):
    rows = []
    for j, t in enumerate(ids):
        lp = lps[j] if lps else (-0.1 * (j + 1), -2.0, -3.0)
        rows.append(PositionLogprobs(10 + j, t, lp[0], 1, (t, 1, 2), tuple(lp)))
    return Generation(seq, (1, 2), tuple(ids), tuple(rows), k, "t", "", "length")


def test_compare_generations_bitwise():
    a = [_gen("a"), _gen("b", (8, 9))]
    assert ab.compare_generations(a, [_gen("a"), _gen("b", (8, 9))]).identical
    ulp = float(np.nextafter(-0.2, 0))
    one_ulp = ab.compare_generations(a, [_gen("a", lps=[(-0.1, -2.0, -3.0), (ulp, -2.0, -3.0), (-0.1 * 3, -2.0, -3.0)]),
                                         _gen("b", (8, 9))])
    assert not one_ulp.identical and one_ulp.n_mismatches == 1
    assert "a step 1: logprob values differ" in one_ulp.mismatches[0] and 0 < one_ulp.max_abs_diff < 1e-15
    assert one_ulp.ids_identical
    div = ab.compare_generations(a, [_gen("a", (5, 6, 99)), _gen("b", (8, 9))])
    assert not div.identical and any("diverge at step 2" in m for m in div.mismatches) and not div.ids_identical
    short = ab.compare_generations(a, [_gen("a", (5, 6)), _gen("b", (8, 9))])
    assert not short.identical
    with pytest.raises(ValueError, match="out of order"):
        ab.compare_generations(a, list(reversed(a)))


def _record_from(full_lps, tokens, k=5):
    seqs = [sequence_from_full(f"s{i}", "d", t, p, k) for i, (t, p) in enumerate(zip(tokens, full_lps))]
    return Record.from_sequences(provenance("engine"), seqs)


def test_compare_records_bitwise():
    rng = np.random.default_rng(1)
    ref, eng, full = pair_of_records(rng, n_seq=3, length=8, vocab=30)
    tokens = [eng.token_ids[eng.seq_offsets[i]:eng.seq_offsets[i + 1]] for i in range(3)]
    qs = [q for _, q in full]
    same = _record_from(qs, tokens)
    assert ab.compare_records_bitwise(same, _record_from(qs, tokens)).identical
    bumped = [q.copy() for q in qs]
    bumped[1][2, :] = np.nextafter(bumped[1][2, :], 0)  # one position, one ulp everywhere
    res = ab.compare_records_bitwise(same, _record_from(bumped, tokens))
    assert not res.identical and res.n_mismatches == 1 and res.mismatches[0].startswith("s1@3") and res.ids_identical
    other = _record_from(qs[:2], tokens[:2])
    assert not ab.compare_records_bitwise(same, other).identical


def test_paired_not_worse_and_regression_rule():
    rng = np.random.default_rng(3)
    ref, eng_a, _ = pair_of_records(rng, n_seq=20, length=12, vocab=40, noise=0.2)
    rng = np.random.default_rng(3)
    _, eng_b, _ = pair_of_records(rng, n_seq=20, length=12, vocab=40, noise=0.6)
    pa, pb = metrics.position_metrics(ref, eng_a), metrics.position_metrics(ref, eng_b)
    worse = ab.paired_not_worse(metrics.paired_comparison(pa, pb), Thresholds())
    assert not worse.passed and worse.wilcoxon_p < 0.05 and worse.ci_high > worse.allowance
    better = ab.paired_not_worse(metrics.paired_comparison(pb, pa), Thresholds())
    assert better.passed
    same = ab.paired_not_worse(metrics.paired_comparison(pa, pa), Thresholds())
    assert same.passed and same.diff_mean == 0
    # a worsening inside the allowance is not a regression; one beyond it without significance neither
    assert not ab.regression_rule(0.04, 0.03, 0.001, 1.0, 0.0, 0.05, 0.05)[0]
    assert not ab.regression_rule(0.5, 0.3, 0.2, 1.0, 0.0, 0.05, 0.05)[0]
    assert ab.regression_rule(0.5, 0.3, 0.01, 1.0, 0.0, 0.05, 0.05)[0]
    assert ab.regression_rule(0.5, 0.3, 0.01, 1.0, 0.0, 0.05, 0.05)[1] == pytest.approx(0.05)
    assert ab.regression_rule(0.5, 0.3, 0.01, 1.0, 1.0, 0.05, 0.05) == (False, 1.0, ab.regression_rule(
        0.5, 0.3, 0.01, 1.0, 1.0, 0.05, 0.05)[2])


def test_paired_series_is_cores_paired_comparison_on_stored_series():
    """The nightly's run-vs-baseline statistics on per-prompt series equal core's paired comparison of the
    records those series came from (same prompt bootstrap draws, same Wilcoxon)."""
    rng = np.random.default_rng(4)
    ref, eng_a, _ = pair_of_records(rng, n_seq=15, length=10, vocab=40, noise=0.2)
    rng = np.random.default_rng(4)
    _, eng_b, _ = pair_of_records(rng, n_seq=15, length=10, vocab=40, noise=0.5)
    pa, pb = metrics.position_metrics(ref, eng_a), metrics.position_metrics(ref, eng_b)
    core_pc = metrics.paired_comparison(pa, pb)
    keep = np.isfinite(pa.kl_part) & np.isfinite(pb.kl_part) & ~pa.ambiguous & ~pb.ambiguous
    series = [metrics.per_prompt_means(pm.kl_part[keep], pm.seq[keep], 15) for pm in (pa, pb)]
    base, cur = ([None if np.isnan(x) else float(x) for x in s] for s in series)
    ours = ab.paired_series(base, cur)
    assert ours.n_prompts == core_pc.n_prompts == 15 and ours.wilcoxon_p == core_pc.wilcoxon_p
    for name in ("mean_a", "mean_b", "mean_diff", "ci_low", "ci_high"):
        assert getattr(ours, name) == pytest.approx(getattr(core_pc, name), rel=1e-12, abs=1e-15), name


def test_paired_series_worked_example_and_errors():
    from scipy import stats

    pc = ab.paired_series([1.0, 2.0, 3.0, None, 4.0], [2.0, 2.0, 5.0, 7.0, None])
    assert (pc.n_prompts, pc.mean_a, pc.mean_b, pc.mean_diff) == (3, 2.0, 3.0, 1.0)
    assert 0.0 <= pc.ci_low <= 1.0 <= pc.ci_high <= 2.0          # resampled means of d = (1, 0, 2)
    assert pc.wilcoxon_p == pytest.approx(stats.wilcoxon([1.0, 0.0, 2.0]).pvalue)
    flat = ab.paired_series([0.5, 0.5], [0.5, 0.5])
    assert flat.wilcoxon_p == 1.0 and flat.ci_low == flat.ci_high == 0.0
    assert ab.paired_series([None], [1.0]).n_prompts == 0
    with pytest.raises(ValueError, match="panel changed"):
        ab.paired_series([1.0], [1.0, 2.0])


def test_speed_verdict():
    th = Thresholds(speed_tolerance=0.1)
    assert ab.speed_verdict([100, 102, 98], [95, 93, 97], th).passed          # 5 % slower: within tolerance
    slow = ab.speed_verdict([100, 102, 98], [80, 85, 82], th)
    assert not slow.passed and slow.ratio == pytest.approx(0.82)
    need = th.model_copy(update={"require_speedup": True})
    assert not ab.speed_verdict([100], [105], need).passed and ab.speed_verdict([100], [115], need).passed
    with pytest.raises(ValueError):
        ab.speed_verdict([], [1.0], th)
    with pytest.raises(ValueError):
        ab.speed_verdict([math.nan], [1.0], th)


# ------------------------------------------------------------------------------------------ CLI

def test_flags_cli_lists_last_verdicts(tmp_path):
    from ds41gates.cli import app

    res_dir = tmp_path / "r"
    res_dir.mkdir()
    results = GateResults()
    for flag, gate, passed, why in (("no_prefix_cache", "bitwise_panel", True, "ok"),
                                    ("no_prefix_cache", "bitwise_greedy", True, "ok"),
                                    ("dtype_bf16", "bitwise_panel", False, "differ")):
        results = results.with_flag_verdict(flag, "exact", "", "vllm-cpu-fp32", FlagGateVerdict(gate, passed, why))
    results.save(res_dir / "results.json")
    runner = CliRunner()
    out = runner.invoke(app, ["flags", "-r", str(CPU_REGISTRY), "--results", str(res_dir), "--json"])
    assert out.exit_code == 0, out.output
    rows = {r["name"]: r for r in json.loads(out.output)}
    assert rows["no_prefix_cache"]["last_verdict"]["passed"] is True
    assert rows["dtype_bf16"]["last_verdict"]["passed"] is False
    assert rows["VLLM_DS41_HC_FUSED"]["last_verdict"] is None
    table = runner.invoke(app, ["flags", "-r", str(CPU_REGISTRY), "--results", str(res_dir), "--class", "exact"])
    # the flag's verdict names every expected gate that did not pass: bitwise_greedy never ran (issue 35)
    assert table.exit_code == 0 and "VLLM_DS41_HC_FUSED" not in table.output
    assert "FAIL (bitwise_panel: failed, bitwise_greedy: missing)" in " ".join(table.output.split())
    refused = runner.invoke(app, ["flags", "check", "vllm-cpu-fp32", "--flag", "dtype_bf16"])
    assert refused.exit_code == 1 and "not in the flag registry" in refused.output
    shown = runner.invoke(app, ["flags", "show", "VLLM_DS41_NOPE"])
    assert shown.exit_code == 2 and "--flag-registry" in shown.output
    # the option the hint names exists on this command too (an alias of --registry)
    named = runner.invoke(app, ["flags", "--flag-registry", str(CPU_REGISTRY), "show", "no_prefix_cache"])
    assert named.exit_code == 0 and json.loads(named.output)["name"] == "no_prefix_cache"


def test_flags_cli_refuses_an_untyped_results_file_naming_it(tmp_path):
    """A results.json of a gate run before results were typed (the flag table at top level, no format tag) is
    refused with one line naming the file, never read as 'no verdicts'."""
    from ds41gates.cli import app

    old = tmp_path / "results.json"
    old.write_text(json.dumps({"flag_ab": {"dtype_bf16": {"class": "exact", "gates": {
        "bitwise_panel": {"passed": False, "why": "differ"}}}}}))
    out = CliRunner().invoke(app, ["flags", "-r", str(CPU_REGISTRY), "--results", str(tmp_path)])
    assert out.exit_code == 2 and str(old) in out.output and "no format tag" in out.output
