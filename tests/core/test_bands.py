import numpy as np
import pytest

from core import metrics
from core.bands import Band, BandsError, judge_panel, load_bands
from gates import BANDS_FILE
from tests.core.recordkit import pair_of_records


def _result(noise):
    ref, eng, _ = pair_of_records(np.random.default_rng(0), n_seq=8, length=30, vocab=30, k_ref=30, k_eng=10,
                                  noise=noise)
    return metrics.panel_metrics(ref, eng, n_boot=100)


def test_close_engine_passes_and_noisy_engine_fails_with_reasons():
    band = {"default": Band(kl_mean=0.01, kl_p99=0.1, top1_decided=0.9, ln_ppl=0.02)}
    assert judge_panel(_result(1e-4), band, "unit").passed
    verdict = judge_panel(_result(1.0), band, "unit")
    assert not verdict.passed
    text = " ".join(verdict.failures())
    assert "mean KL_part" in text and "top-1" in text


def test_domain_specific_band_overrides_default():
    result = _result(0.05)
    loose = Band(1.0, 10.0, 0.0, 1.0)
    strict = Band(0.0, 0.0, 1.0, 0.0)
    verdict = judge_panel(result, {"default": loose, "b": strict}, "unit")
    by = {d.domain: d.passed for d in verdict.domains}
    assert by == {"a": True, "b": False}


def test_shipped_bands_file_parses_for_every_profile():
    for profile in ("vllm-cpu-fp32", "vllm-cpu-bf16", "llamacpp-f32", "llamacpp-q4_1", "some-unknown-engine"):
        assert "default" in load_bands(profile, BANDS_FILE)


def test_bad_bands_file_names_the_problem(tmp_path):
    path = tmp_path / "b.toml"
    path.write_text("[profiles.x.default]\nkl_mean = 1\nbogus = 2\n")
    with pytest.raises(BandsError, match="profiles.x.default"):
        load_bands("x", path)


def test_missing_or_malformed_bands_file_is_named(tmp_path):
    with pytest.raises(BandsError, match=r"absent.toml: bands file does not exist"):
        load_bands("x", tmp_path / "absent.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[profiles.x\n")
    with pytest.raises(BandsError, match=r"broken.toml: cannot read bands file"):
        load_bands("x", broken)
