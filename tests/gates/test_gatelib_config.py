"""gates/config.toml and its production override: every override key exists in the CI file."""

import pytest

from gates.conftest import CONFIG, load_gate_config


def test_production_config_overrides_ci_sizes():
    ci = load_gate_config()
    prod = load_gate_config(CONFIG.with_name("config-production.toml"))
    assert set(ci) == {"selfconsistency", "batch", "prefix", "needles", "specdec", "bench"}
    assert prod["needles"]["lengths"][-1] == 1_048_576 and max(ci["needles"]["lengths"]) < 2048
    assert prod["bench"]["max_tokens"] > ci["bench"]["max_tokens"]
    assert ci["prefix"]["passes"] >= 2 and prod["prefix"]["eviction_pass"]


def test_unknown_override_key_is_refused(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[needles]\nlenghts = [1]\n")
    with pytest.raises(pytest.UsageError, match="lenghts"):
        load_gate_config(bad)
    bad.write_text("[nedles]\nlengths = [1]\n")
    with pytest.raises(pytest.UsageError, match="nedles"):
        load_gate_config(bad)
