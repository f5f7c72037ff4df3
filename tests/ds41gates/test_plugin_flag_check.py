"""An unknown --flag, or a broken --flag-registry, stops a gate session as a usage error before collection,
so no engine fixture can start a server."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _gate_session(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "gates", "-m", "gate", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    return proc, time.monotonic() - started


def test_unknown_flag_is_a_usage_error_before_collection():
    proc, elapsed = _gate_session("--flag", "VLLM_DS41_MOE_BACKEND", "--flag", "VLLM_DS41_NO_SUCH_FLAG")
    assert proc.returncode == 4, proc.stdout + proc.stderr  # pytest's USAGE_ERROR: no session, no fixture ran
    assert elapsed < 30
    message = proc.stderr.strip().splitlines()[0]
    assert message.startswith("ERROR: --flag: unknown flag(s) ['VLLM_DS41_NO_SUCH_FLAG']")
    assert "VLLM_DS41_MOE_BACKEND" in message.split("known:")[1]  # the known flags are listed
    assert "collected" not in proc.stdout


def test_broken_flag_registry_is_a_usage_error(tmp_path):
    bad = tmp_path / "flags.toml"
    bad.write_text("[flags.VLLM_DS41_X]\ndescription = 'x'\nclass = 'correctness'\ncolour = 'red'\n")
    proc, elapsed = _gate_session("--flag", "VLLM_DS41_X", "--flag-registry", str(bad))
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert elapsed < 30
    message = proc.stderr.strip().splitlines()[0]
    assert message.startswith("ERROR: --flag-registry: ") and str(bad) in message and "colour" in message


def test_known_flag_passes_the_check():
    proc, _ = _gate_session("--flag", "VLLM_DS41_MOE_BACKEND", "--collect-only", "-q")
    assert proc.returncode in (0, 5), proc.stdout + proc.stderr
    assert "unknown flag" not in proc.stderr


def test_engine_flag_the_profile_lacks_is_a_usage_error_before_collection():
    proc, elapsed = _gate_session("--engine-profile", "vllm-cpu-dsv4", "--engine-flag", "fp8_weights",
                                  "--engine-flag", "fp8_wieghts")
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert elapsed < 30
    message = proc.stderr.strip().splitlines()[0]
    assert message.startswith("ERROR: --engine-flag: profile 'vllm-cpu-dsv4' has no flag(s) ['fp8_wieghts']")
    assert "'fp8_weights'" in message.split("defines")[1]    # the profile's flags are listed
    assert "collected" not in proc.stdout


def test_engine_flag_check_accepts_a_defined_flag_and_refuses_it_for_another_profile():
    """--engine-flag is checked against the profile it runs with (flags are per profile)."""
    import pytest

    from ds41gates import pytest_plugin

    class Config:
        options = {"--engine-url": None, "--engine-profile": "vllm-cpu-dsv4",
                   "--engine-flag": ["fp8_weights", "fp8_weights"]}

        def getoption(self, name):
            return self.options[name]

    def check() -> None:      # as configure does: the profile parsed once, the flags checked against it
        pytest_plugin._check_engine_flags(Config(), pytest_plugin._engine_profile(Config()))

    check()          # a defined flag passes, a repeat is harmless
    Config.options["--engine-profile"] = "vllm-cpu-fp32"
    with pytest.raises(pytest.UsageError, match=r"profile 'vllm-cpu-fp32' has no flag\(s\) \['fp8_weights'\]"):
        check()
    Config.options["--engine-profile"] = None          # no profile given: the default's flags
    with pytest.raises(pytest.UsageError, match=r"profile 'vllm-cpu-fp32' has no flag\(s\)"):
        check()
