"""A profile's [gate] table (engine.profiles.GateTarget) and its resolution (engine.target): parsed strictly,
the embedded default when absent, and every shipped profile names a known model and existing files."""

from __future__ import annotations

import pytest

from engine.profiles import (
    DEFAULT_GATE_TARGET,
    OWN_TOKENIZER,
    REPO_ROOT,
    GateTarget,
    ProfileError,
    available_profiles,
    load_profile,
    parse_profile,
)
from engine.target import (
    CheckedTarget,
    check_gate_target,
    checked_target,
    gate_target,
    one_gate_target,
    resolve_gate_target,
)

BASE = {"command": ["{python}", "-c", "pass"]}
DSV4 = {"model": "dsv4_tiny_dir", "panel": "dsv4-ci", "tokenizer": "deepseek", "oracle": "deepseek",
        "precision": "fp32", "bands": "gates/bands.toml", "sizes": "gates/config-vllm-cpu-dsv4.toml"}


def _profile(tmp_path, text: str):
    path = tmp_path / "p.toml"
    path.write_text('command = ["{python}", "-c", "pass"]\n' + text)
    return path


def test_a_gate_table_parses_into_a_gate_target():
    prof = parse_profile({**BASE, "gate": DSV4}, default_name="p")
    assert prof.gate == GateTarget(**DSV4)


def test_no_gate_table_is_the_embedded_default_smollm2_on_its_own_tokenizer():
    prof = parse_profile(BASE, default_name="p")
    assert prof.gate == DEFAULT_GATE_TARGET
    assert (prof.gate.model, prof.gate.panel, prof.gate.tokenizer, prof.gate.oracle, prof.gate.precision) == \
        ("model_hf_dir", "default", OWN_TOKENIZER, "transformers", "fp32")
    assert gate_target(None) == DEFAULT_GATE_TARGET and checked_target(None).sizes is None


def test_a_partial_gate_table_keeps_the_default_for_the_keys_it_leaves_out():
    prof = parse_profile({**BASE, "gate": {"panel": "dsv4-ci"}}, default_name="p")
    assert prof.gate.panel == "dsv4-ci" and prof.gate.oracle == "transformers" and prof.gate.sizes == ""


def test_an_unknown_gate_key_names_the_file_and_the_key(tmp_path):
    path = _profile(tmp_path, '[gate]\nmodel = "model_hf_dir"\nreference = "x"\n')
    with pytest.raises(ProfileError, match=r"p\.toml \[gate\]: unknown key\(s\) \['reference'\]") as info:
        load_profile(path)
    assert str(path.resolve()) in str(info.value)


@pytest.mark.parametrize("table, message", [
    ({"oracle": "jax"}, r"oracle 'jax': expected one of \['deepseek', 'transformers'\]"),
    ({"oracle": "transformers", "precision": "bf16"}, r"precision 'bf16': the transformers oracle"),
    ({"panel": 3}, r"'panel' must be a non-empty string"),
    ({"sizes": ""}, r"'sizes' must be a non-empty string"),
])
def test_a_bad_gate_value_is_a_profile_error(table, message):
    with pytest.raises(ProfileError, match=message):
        parse_profile({**BASE, "gate": table}, default_name="p")


def test_gate_must_be_a_table():
    with pytest.raises(ProfileError, match="'gate' must be a table"):
        parse_profile({**BASE, "gate": "dsv4"}, default_name="p")


def test_a_launch_override_cannot_change_what_is_gated():
    prof = parse_profile(BASE, default_name="p")
    with pytest.raises(ProfileError, match=r"unknown override\(s\) \['gate'\]"):
        prof.with_overrides({"gate": GateTarget(**DSV4)})


def test_an_unknown_model_provider_or_a_missing_file_is_refused_before_any_work(tmp_path):
    path = _profile(tmp_path, '[gate]\nmodel = "gguf_f32"\n')   # a launch placeholder, not a model folder
    with pytest.raises(ProfileError, match=r"model 'gguf_f32' is not a model provider"):
        check_gate_target(path)
    path = _profile(tmp_path, '[gate]\nsizes = "gates/config-no-such-profile.toml"\n')
    with pytest.raises(ProfileError, match=r"sizes = 'gates/config-no-such-profile.toml': no such file"):
        check_gate_target(path)


@pytest.mark.parametrize("name", available_profiles())
def test_every_shipped_profile_declares_a_known_model_and_existing_files(name):
    checked = checked_target(name)
    assert checked.target == check_gate_target(name) == load_profile(name).gate
    assert checked.bands == REPO_ROOT / checked.target.bands
    assert checked.sizes == (REPO_ROOT / checked.target.sizes if checked.target.sizes else None)


def test_every_gate_sizes_file_belongs_to_a_profile_that_declares_it():
    """gates/config-<profile>.toml used to be found by file name; each is now named by its profile's [gate]."""
    declared = {checked_target(name).sizes for name in available_profiles()} - {None}
    on_disk = {p for p in (REPO_ROOT / "gates").glob("config-*.toml") if p.name != "config-production.toml"}
    assert on_disk == declared


def test_the_deepseek_profile_is_gated_on_deepseek_and_the_smollm2_profiles_on_the_default():
    t = resolve_gate_target("vllm-cpu-dsv4")
    assert (t.oracle, t.precision, t.tokenizer, t.target.panel) == ("deepseek", "fp32", "deepseek", "dsv4-ci")
    assert t.model_dir.name.startswith("dsv4-tiny-") and (t.model_dir / "config.json").is_file()
    assert t.encoded.panel_name == "dsv4-ci" and len(t.encoded.sequences) == 8
    assert t.sizes == REPO_ROOT / "gates/config-vllm-cpu-dsv4.toml" and t.bands == REPO_ROOT / "gates/bands.toml"
    for name in ("vllm-cpu-fp32", "vllm-cpu-bf16", "llamacpp-f32", "llama-server-q4_1"):
        assert gate_target(name) == DEFAULT_GATE_TARGET


def test_the_default_target_encodes_the_default_panel_with_the_model_folders_own_tokenizer():
    from ds41gates import pipeline

    t = resolve_gate_target(None)
    assert t.tokenizer == str(t.model_dir) and t.oracle == "transformers" and t.sizes is None
    assert t.encoded == pipeline.encode_default_panel("default", t.model_dir)   # what the demo used to encode
    light = resolve_gate_target("vllm-cpu-fp32", encode=False)
    assert light.encoded is None and light.model_dir == t.model_dir


def test_the_gate_models_are_launch_providers_one_registry():
    from engine.launcher import MODEL_PROVIDERS, default_providers

    assert set(MODEL_PROVIDERS) <= set(default_providers())


def test_profiles_sharing_a_target_are_checked_once_and_resolved_without_a_second_check(monkeypatch):
    import engine.target

    profiles, checked = one_gate_target(["vllm-cpu-fp32", "vllm-cpu-bf16"])
    assert [p.name for p in profiles] == ["vllm-cpu-fp32", "vllm-cpu-bf16"]
    assert isinstance(checked, CheckedTarget) and checked.profile is profiles[0]
    assert checked.target == DEFAULT_GATE_TARGET and checked.bands == REPO_ROOT / "gates/bands.toml"
    # resolving what was checked checks nothing again: the check is not reached
    monkeypatch.setattr(engine.target, "checked_target", lambda *a: pytest.fail("checked twice"))
    t = resolve_gate_target(checked, encode=False)
    assert (t.profile, t.target, t.bands, t.sizes, t.encoded) == ("vllm-cpu-fp32", checked.target, checked.bands,
                                                                  None, None)
    assert t.oracle_kind.name == "transformers"


def test_profiles_on_different_targets_are_refused_naming_each(tmp_path):
    with pytest.raises(ProfileError, match=r"are gated on different targets \(vllm-cpu-fp32: model_hf_dir on "
                                           r"default \(transformers\), vllm-cpu-dsv4: dsv4_tiny_dir on dsv4-ci "
                                           r"\(deepseek\)\)"):
        one_gate_target(["vllm-cpu-fp32", "vllm-cpu-dsv4"])
    with pytest.raises(ProfileError, match="no engine profile given"):
        one_gate_target([])
