"""engine/profiles.py as a schema: the engine and the oracle are checked against their registries when the file is
read (a typo fails before any server launches), every shipped profile parses, launch overrides are validated."""

from __future__ import annotations

import dataclasses

import pytest

from engine.adapters import ENGINE_KINDS
from engine.launcher import EngineServer
from engine.profiles import GateTarget, Profile, ProfileError, available_profiles, load_profile, parse_profile
from oracle.kinds import ORACLE_KINDS

OK = 'command = ["{python}", "-c", "pass"]\nserved_model = "m"\n'


def _file(tmp_path, text):
    path = tmp_path / "typo.toml"
    path.write_text(OK + text)
    return path


def test_an_unknown_engine_is_refused_at_parse_naming_file_key_value_and_the_known_ones(tmp_path):
    path = _file(tmp_path, 'engine = "vlm"\n')
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    message = str(info.value)
    assert message == (f"{path.resolve()}: engine 'vlm': no adapter for it; expected one of "
                       f"{sorted(ENGINE_KINDS)} (engine/adapters)")
    with pytest.raises(ProfileError, match="engine 'vlm'"):   # before anything launches: no server is built
        EngineServer(str(path))


def test_an_unknown_oracle_is_refused_at_parse_naming_file_key_value_and_the_known_ones(tmp_path):
    path = _file(tmp_path, '[gate]\noracle = "deepsek"\n')
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    assert str(info.value) == f"{path.resolve()} [gate]: oracle 'deepsek': expected one of {sorted(ORACLE_KINDS)}"


def test_every_registered_engine_and_oracle_is_accepted():
    for engine in ENGINE_KINDS:
        assert parse_profile({"command": ["x"], "engine": engine}, default_name="p").engine == engine
    for oracle in ORACLE_KINDS:
        assert parse_profile({"command": ["x"], "gate": {"oracle": oracle}}, default_name="p").gate.oracle == oracle


@pytest.mark.parametrize("name", available_profiles())
def test_every_shipped_profile_parses_and_names_a_registered_engine(name):
    prof = load_profile(name)
    assert prof.engine in ENGINE_KINDS and prof.gate.oracle in ORACLE_KINDS and prof.source.name == f"{name}.toml"


@pytest.mark.parametrize("text, message", [
    ('port = true\n', "'port' must be an integer in [0, 65535], got True"),
    ('args = ["--a", true]\n', "'args' must be a list of strings, got ['--a', True]"),
    ('host = 1\n', "'host' must be a string, got 1"),
    ('source = "/elsewhere.toml"\n', "unknown key(s) ['source']"),
    ('allow_env = []\n', "'allow_env' is gone"),
    ('name = "../x"\n', "profile name"),
    ('[flags.F]\nenv = { A = "1" }\ncolour = 1\n', "[flags.F]: a flag table holds only 'env' and 'args'"),
    ('[flags.F]\nargs = "--x"\n', "[flags.F]: 'args' must be a list of strings, got '--x'"),
    ('[gate]\nprefix_cache = "maybe"\n', "[gate]: prefix_cache 'maybe': expected \"required\" or \"optional\""),
], ids=["bool port", "bool arg", "number host", "source key", "allow_env", "unsafe name", "flag key", "flag args",
        "prefix_cache"])
def test_bad_values_are_one_line_naming_the_file(tmp_path, text, message):
    path = _file(tmp_path, text)
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    assert str(info.value).startswith(str(path.resolve())) and message in str(info.value), str(info.value)
    assert "\n" not in str(info.value)


def test_numbers_in_string_lists_are_their_text_as_before():
    prof = parse_profile({"command": ["x", 1], "args": ["--len", 2048, 0.5], "env": {"VLLM_CPU_OMP_THREADS_BIND": 4}},
                         default_name="p")
    assert prof.command == ("x", "1") and prof.args == ("--len", "2048", "0.5")
    assert prof.env == {"VLLM_CPU_OMP_THREADS_BIND": "4"}


def test_launch_overrides_are_validated_like_the_file():
    prof = parse_profile({"command": ["x"]}, default_name="p")
    moved = prof.with_overrides({"port": 8001, "extra_args": ["--b", 3], "start_timeout_s": 5})
    assert (moved.port, moved.args, moved.start_timeout_s) == (8001, ("--b", "3"), 5.0)
    with pytest.raises(ProfileError, match=r"profile 'p' override: 'port' must be an integer in \[0, 65535\], got -1"):
        prof.with_overrides({"port": -1})
    with pytest.raises(ProfileError, match=r"override: engine 'x'"):
        prof.with_overrides({"engine": "x"})


def test_profiles_and_targets_stay_frozen_dataclasses():
    prof = parse_profile({"command": ["x"]}, default_name="p")
    with pytest.raises(dataclasses.FrozenInstanceError):
        prof.port = 1   # type: ignore[misc]
    assert dataclasses.replace(GateTarget(), panel="dsv4-ci").panel == "dsv4-ci"   # the default sizes "" kept
    assert isinstance(prof, Profile) and hash(GateTarget()) == hash(GateTarget())
