"""gates/config.toml and the sizes files laid over it (gates/sizes.py): typed, every override key of the kind the CI
file declares, a bad file one line naming the file, the table and the key."""

from pathlib import Path

import pytest

from gates.sizes import CONFIG, GateSizes, GateSizesError, load_gate_sizes


def test_production_config_overrides_ci_sizes():
    ci = load_gate_sizes()
    prod = load_gate_sizes(CONFIG.with_name("config-production.toml"))
    assert set(GateSizes.model_fields) == {"selfconsistency", "batch", "prefix", "needles", "specdec", "bench",
                                           "evals", "long_context"}
    assert prod.needles.lengths[-1] == 1_048_576 and max(ci.needles.lengths) < 2048
    assert prod.bench.max_tokens > ci.bench.max_tokens
    assert ci.prefix.passes >= 2 and prod.prefix.eviction_pass
    assert ci.evals.humaneval_limit > 0 and prod.evals.humaneval_limit == 0  # production: every problem
    # keys the override does not give keep the CI value
    assert prod.needles.seed == ci.needles.seed and prod.specdec.strict is ci.specdec.strict


def test_every_shipped_sizes_file_loads():
    files = sorted(CONFIG.parent.glob("config-*.toml"))
    assert len(files) >= 6
    for path in files:
        assert isinstance(load_gate_sizes(path), GateSizes), path


def _refused(tmp_path: Path, text: str) -> str:
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    with pytest.raises(GateSizesError) as info:
        load_gate_sizes(bad)
    message = str(info.value)
    assert message.startswith(f"{bad}: ") and "\n" not in message
    return message[len(f"{bad}: "):]


def test_bad_override_is_named_by_table_key_and_kind(tmp_path):
    assert _refused(tmp_path, "[needles]\nlenghts = [1]\n").startswith("[needles]: unknown keys ['lenghts']")
    assert _refused(tmp_path, "[nedles]\nlengths = [1]\n").startswith("unknown gate table [nedles]")
    assert _refused(tmp_path, "[batch]\nmax_tokens = -3\n") == "[batch] max_tokens = -3: must be an integer >= 0"
    assert _refused(tmp_path, "[batch]\nmax_tokens = 2.0\n") == "[batch] max_tokens = 2.0: must be an integer >= 0"
    assert _refused(tmp_path, '[prefix]\nkl_tol_floor = "1e-6"\n') == \
        "[prefix] kl_tol_floor = '1e-6': must be a finite number >= 0"
    assert _refused(tmp_path, "[prefix]\nkl_tol_floor = inf\n") == \
        "[prefix] kl_tol_floor = inf: must be a finite number >= 0"
    assert _refused(tmp_path, "[needles]\nlengths = [512, -1]\n") == \
        "[needles] lengths = [512, -1]: must be a list of numbers >= 0"
    assert _refused(tmp_path, "[needles]\ngate_found = 1\n") == "[needles] gate_found = 1: must be true or false"
    assert _refused(tmp_path, "[specdec]\ndomains = [\"code\", 1]\n") == \
        "[specdec] domains = ['code', 1]: must be a list of strings"
    assert _refused(tmp_path, "batch = 3\n") == "[batch] must be a table, got 3"
    assert _refused(tmp_path, "[selfconsistency]\nfloors = { p = [1e-3] }\n").startswith(
        "[selfconsistency] floors = {'p': [0.001]}: must be a table of [mean, worst] pairs")


def test_a_broken_base_file_is_named_too(tmp_path):
    base = tmp_path / "config.toml"
    base.write_text(CONFIG.read_text().replace("passes = 2", "passes = -2"))
    with pytest.raises(GateSizesError, match=r"config\.toml: \[prefix\] passes = -2: must be an integer >= 0"):
        load_gate_sizes(base=base)
    base.write_text(CONFIG.read_text().replace("passes = 2", ""))
    with pytest.raises(GateSizesError, match=r"config\.toml: prefix\.passes: is required"):
        load_gate_sizes(base=base)
    with pytest.raises(GateSizesError, match=r"absent\.toml: gate sizes file does not exist"):
        load_gate_sizes(tmp_path / "absent.toml")


def test_dsv4_config_shrinks_the_behaviour_gates_and_ungates_retrieval():
    ci = load_gate_sizes()
    dsv4 = load_gate_sizes(CONFIG.with_name("config-vllm-cpu-dsv4.toml"))
    assert ci.needles.gate_found is True and dsv4.needles.gate_found is False
    assert min(dsv4.needles.lengths) > 128       # past the tiny V4's sliding window
    assert dsv4.batch.max_tokens < ci.batch.max_tokens
    assert dsv4.selfconsistency.max_tokens < ci.selfconsistency.max_tokens
    # one block boundary (256) and a 45-token suffix after one block; the verdict rules stay the CI ones
    assert (dsv4.prefix.boundaries, dsv4.prefix.extra_lengths) == ((1,), (301,))
    assert dsv4.prefix.model_copy(update={"boundaries": (), "extra_lengths": ()}) == \
        ci.prefix.model_copy(update={"boundaries": (), "extra_lengths": ()})


def test_evidence_form_is_the_plain_table():
    ci = load_gate_sizes()
    assert ci.for_json("needles")["lengths"] == [512, 1024, 1536]
    assert ci.for_json("selfconsistency")["floors"]["vllm-cpu-fp32"] == [1e-6, 1e-5]
