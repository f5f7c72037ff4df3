"""gates/config.toml and its production override: every override key exists in the CI file."""

import pytest

from gates.conftest import CONFIG, load_gate_config


def test_production_config_overrides_ci_sizes():
    ci = load_gate_config()
    prod = load_gate_config(CONFIG.with_name("config-production.toml"))
    assert set(ci) == {"selfconsistency", "batch", "prefix", "needles", "specdec", "bench", "evals", "long_context"}
    assert prod["needles"]["lengths"][-1] == 1_048_576 and max(ci["needles"]["lengths"]) < 2048
    assert prod["bench"]["max_tokens"] > ci["bench"]["max_tokens"]
    assert ci["prefix"]["passes"] >= 2 and prod["prefix"]["eviction_pass"]
    assert ci["evals"]["humaneval_limit"] > 0 and prod["evals"]["humaneval_limit"] == 0  # production: every problem


def test_unknown_override_key_is_refused(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[needles]\nlenghts = [1]\n")
    with pytest.raises(pytest.UsageError, match="lenghts"):
        load_gate_config(bad)
    bad.write_text("[nedles]\nlengths = [1]\n")
    with pytest.raises(pytest.UsageError, match="nedles"):
        load_gate_config(bad)


def test_dsv4_config_shrinks_the_behaviour_gates_and_ungates_retrieval():
    ci = load_gate_config()
    dsv4 = load_gate_config(CONFIG.with_name("config-vllm-cpu-dsv4.toml"))
    assert ci["needles"]["gate_found"] is True and dsv4["needles"]["gate_found"] is False
    assert min(dsv4["needles"]["lengths"]) > 128       # past the tiny V4's sliding window
    assert dsv4["batch"]["max_tokens"] < ci["batch"]["max_tokens"]
    assert dsv4["selfconsistency"]["max_tokens"] < ci["selfconsistency"]["max_tokens"]
    # one block boundary (256) and a 45-token suffix after one block; the verdict rules stay the CI ones
    assert (dsv4["prefix"]["boundaries"], dsv4["prefix"]["extra_lengths"]) == ([1], [301])
    assert {k: v for k, v in dsv4["prefix"].items() if k not in ("boundaries", "extra_lengths")} == \
        {k: v for k, v in ci["prefix"].items() if k not in ("boundaries", "extra_lengths")}
