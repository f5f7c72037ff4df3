"""Kernel registry parsing (strict, errors name entry and field) and the gate's pure evaluation step."""

from __future__ import annotations

import copy

import pytest
import torch

from engine.kernels.cases import PRIMITIVES, Case, build_case
from engine.kernels.driver import plan
from engine.kernels.registry import FORMAT, RegistryError, Tolerance, load_registry, parse_registry
from gates.lib.kernels import evaluate

BASE = {
    "format": FORMAT,
    "engines": {"e": {"python": "{cache}/venvs/x/bin/python"}},
    "kernel": [{"name": "k", "primitive": "rmsnorm", "engine": "e", "target": "mod.sub:fn", "adapter": "a",
                "flag": "VLLM_DS41_HC_FUSED", "tolerance": {"out": {"max_ulp": 1}}}],
}


def _with(**changes):
    doc = copy.deepcopy(BASE)
    doc["kernel"][0].update(changes)
    return doc


def test_real_registry_loads_and_is_consistent():
    reg = load_registry()
    names = [k.name for k in reg.kernels]
    assert len(names) == len(set(names))
    active = [k for k in reg.kernels if k.status == "active"]
    assert active and all(k.primitive in PRIMITIVES for k in active)
    assert all(k.flag.startswith("VLLM_DS41_") for k in reg.kernels)
    exl3 = [k for k in reg.kernels if k.primitive == "exl3_gemm"]
    assert exl3 and all(k.device == "gpu-only" and not k.runnable_on_cpu for k in exl3)
    assert any(k.test_only and k.expect_violation for k in reg.kernels)
    assert reg.get("vllm-cpu.qnorm_rope_kv_insert").tolerance["kv_nope"].exact


def test_minimal_registry_parses():
    reg = parse_registry(BASE, "mem")
    k = reg.get("k")
    assert k.tolerance == {"out": Tolerance(max_ulp=1)} and k.shapes == ("tiny", "production") and k.runnable_on_cpu
    with pytest.raises(KeyError, match="no entry named 'nope'"):
        reg.get("nope")


@pytest.mark.parametrize("doc,msg", [
    ({**BASE, "format": "other/1"}, "format 'other/1'"),
    (_with(colour="red"), r"kernel\[0\] \(k\): unknown field\(s\) \['colour'\]"),
    (_with(flag="HC_FUSED"), "not a VLLM_DS41_"),
    (_with(target="no_colon"), "must be 'module.path:attribute'"),
    (_with(engine="missing"), "engine 'missing' has no"),
    (_with(device="tpu"), "device 'tpu'"),
    (_with(shapes=["huge"]), "shapes"),
    (_with(tolerance={}), "needs at least one"),
    (_with(tolerance={"out": {"exact": True, "max_ulp": 2}}), "exact tolerance takes no"),
    (_with(tolerance={"out": {}}), "needs max_ulp, atol and/or row_rtol"),
    (_with(tolerance={"out": {"max_ulp": "1"}}), "'max_ulp' must be int"),
    (_with(tolerance={"out": {"max_ulp": -1}}), "must be >= 0"),
    (_with(perturb={"out": "ulp+1"}), "only allowed on test_only"),
    (_with(test_only=True, perturb={"out": "noise"}), "perturb.out = 'noise'"),
    (_with(test_only=True, perturb={"y": "ulp+1"}), "perturb.y names an output without"),
    (_with(known_issue={"y": "x"}), "known_issue.y must name"),
    (_with(name=3), "'name' must be str"),
])
def test_registry_errors_name_entry_and_field(doc, msg):
    with pytest.raises(RegistryError, match=msg):
        parse_registry(doc, "mem")


def test_duplicate_names_and_missing_file(tmp_path):
    doc = copy.deepcopy(BASE)
    doc["kernel"].append(copy.deepcopy(doc["kernel"][0]))
    with pytest.raises(RegistryError, match="duplicate kernel name 'k'"):
        parse_registry(doc, "mem")
    with pytest.raises(RegistryError, match=r"none.toml: kernel registry does not exist"):
        load_registry(tmp_path / "none.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("format = ")
    with pytest.raises(RegistryError, match=r"bad.toml: cannot read kernel registry"):
        load_registry(bad)


def test_unbound_and_gpu_entries_are_not_planned():
    doc = copy.deepcopy(BASE)
    doc["kernel"].append({"name": "g", "primitive": "exl3_gemm", "engine": "x", "adapter": "a",
                          "flag": "VLLM_DS41_MOE_EXL3_PLAN", "device": "gpu-only", "status": "unbound"})
    reg = parse_registry(doc, "mem")
    pairs = plan(list(reg.kernels), ("tiny",))
    assert [(e.name, c.shape) for e, c in pairs] == [("k", "tiny")]


def _case() -> Case:
    return build_case("rmsnorm", "tiny", 0, "k.tiny.0")


def test_evaluate_pass_violation_and_errors():
    reg = parse_registry(BASE, "mem")
    entry, case = reg.get("k"), _case()
    good = {"out": case.oracle["out"].to(torch.bfloat16)}
    r = evaluate(entry, case, good, {"wall_s": 0.1})
    assert r.ok and r.violations == [] and r.outputs[0].stats.max_ulp == 0
    bad = {"out": (good["out"].float() * 1.05).to(torch.bfloat16)}
    r = evaluate(entry, case, bad, {"wall_s": 0.1})
    assert not r.ok and "k[tiny].out" in r.violations[0] and "max_ulp=1" in r.violations[0]
    r = evaluate(entry, case, {}, {"error": "RuntimeError: boom"})
    assert not r.ok and r.violations == ["k[tiny]: engine call failed: RuntimeError: boom"]
    r = evaluate(entry, case, {"y": good["out"]}, {})
    assert not r.ok and "no output 'out'" in r.error
    r = evaluate(entry, case, {"out": good["out"][:1]}, {})
    assert not r.ok and "shape mismatch" in r.error
    d = evaluate(entry, case, good, {"wall_s": 0.1}).to_dict()
    assert d["ok"] and d["outputs"]["out"]["tolerance"]["max_ulp"] == 1


def test_cases_are_deterministic_and_oracle_side_is_exact_where_claimed():
    a, b = build_case("kv_insert_act_quant", "tiny", 5), build_case("kv_insert_act_quant", "tiny", 5)
    assert all(torch.equal(a.inputs[k], b.inputs[k]) for k in a.inputs)
    # the all-zero block quantizes to zero; the power-of-two amax block keeps its value exactly (no bump)
    assert (a.oracle["kv_nope"][0, :64] == 0).all()
    assert torch.equal(a.oracle["kv_nope"][1, :64], a.inputs["kv"][1, :64].float())
    with pytest.raises(KeyError, match="no oracle primitive 'nope'"):
        build_case("nope", "tiny")
    with pytest.raises(ValueError, match="unknown shape 'huge'"):
        build_case("rmsnorm", "huge")


@pytest.mark.parametrize("doc,msg", [
    ({k: v for k, v in BASE.items() if k != "format"}, "mem: format None, expected 'ds41-kernel-registry/1'"),
    ({**BASE, "engines": {"e": {}}}, "mem: engines.e: missing field 'python'"),
    ({**BASE, "kernel": [{k: v for k, v in BASE["kernel"][0].items() if k != "adapter"}]},
     "mem: kernel[0] (k): missing field 'adapter'"),
    (_with(status="retired"), "mem: kernel[0] (k): status 'retired' not in ('active', 'unbound')"),
    (_with(shapes=[]), "mem: kernel[0] (k): shapes [] must be a non-empty subset of ('tiny', 'production')"),
    (_with(tolerance={"out": {"max_ulp": 1, "rtol": 1}}),
     "mem: kernel[0] (k): tolerance.out: unknown tolerance field(s) ['rtol']"),
    (_with(test_only="yes"), "mem: kernel[0] (k): field 'test_only' must be bool, got str 'yes'"),
])
def test_registry_messages_are_one_line_naming_file_entry_and_field(doc, msg):
    with pytest.raises(RegistryError) as info:
        parse_registry(doc, "mem")
    assert str(info.value) == msg


def test_an_unbound_entry_needs_no_target_nor_tolerance_and_a_gpu_entry_no_environment():
    doc = copy.deepcopy(BASE)
    doc["kernel"].append({"name": "g", "primitive": "exl3_gemm", "engine": "x", "adapter": "a",
                          "flag": "VLLM_DS41_MOE_EXL3_PLAN", "device": "gpu-only", "status": "unbound"})
    assert parse_registry(doc, "mem").get("g").target == ""
