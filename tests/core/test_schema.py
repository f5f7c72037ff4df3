"""core/schema.py: strict config models and their one-line errors naming the file and the key."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import StrictInt, StrictStr, field_validator, model_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass

from core.errors import UserError
from core.schema import STRICT, Seq, StrictModel, key_path, parse_model, read_model


class ConfigError(UserError, ValueError):
    pass


class Gate(StrictModel):
    oracle: str = "transformers"
    size: int = 1

    @field_validator("oracle")
    @classmethod
    def _known(cls, value: str) -> str:
        if value not in ("deepseek", "transformers"):
            raise ValueError(f"unknown oracle {value!r} (known: deepseek, transformers)")
        return value


class Top(StrictModel):
    name: str
    args: Seq[str] = ()
    gate: Gate = Gate()
    ratio: float = 1.0

    @model_validator(mode="after")
    def _name_not_args(self) -> Top:
        if self.name in self.args:
            raise ValueError(f"name {self.name!r} is also an argument")
        return self


def _message(data, where="x.toml") -> str:
    with pytest.raises(ConfigError) as info:
        parse_model(Top, data, where, ConfigError)
    text = str(info.value)
    assert "\n" not in text
    return text


def test_valid_table_becomes_frozen_model_with_tuples():
    top = parse_model(Top, {"name": "a", "args": ["x", "y"], "gate": {"oracle": "deepseek"}, "ratio": 2},
                      "x.toml", ConfigError)
    assert top.args == ("x", "y") and top.gate.oracle == "deepseek" and top.ratio == 2.0
    with pytest.raises(Exception):
        top.name = "b"   # type: ignore[misc]
    assert hash(top.gate) == hash(Gate(oracle="deepseek"))


def test_validator_message_names_file_and_dotted_key():
    assert _message({"name": "a", "gate": {"oracle": "foo"}}) == \
        "x.toml: gate.oracle: unknown oracle 'foo' (known: deepseek, transformers)"


def test_unknown_key_names_key_and_the_known_ones():
    assert _message({"name": "a", "gate": {"orcale": "deepseek"}}) == \
        "x.toml: gate: unknown key(s) ['orcale']; known: ['oracle', 'size']"
    assert _message({"name": "a", "nmae": "b"}) == "x.toml: unknown key(s) ['nmae']; known: ['args', 'gate', 'name', 'ratio']"


def test_shape_errors_say_what_the_key_must_be():
    assert _message({}) == "x.toml: name: is required"
    assert _message({"name": 3}) == "x.toml: name: must be a string, got 3"
    assert _message({"name": "a", "gate": {"size": "1"}}) == "x.toml: gate.size: must be an integer, got '1'"
    assert _message({"name": "a", "gate": {"size": True}}) == "x.toml: gate.size: must be an integer, got True"
    assert _message({"name": "a", "gate": "deepseek"}) == "x.toml: gate: must be a table, got 'deepseek'"
    assert _message({"name": "a", "args": ["x", 2]}) == "x.toml: args[1]: must be a string, got 2"
    assert _message({"name": "a", "args": "x"}) == "x.toml: args: must be an array, got 'x'"


def test_cross_field_rule_is_named_at_the_file():
    assert _message({"name": "a", "args": ["a"]}) == "x.toml: name 'a' is also an argument"


def test_several_problems_report_the_first_and_count_the_rest():
    assert _message({"name": 1, "ratio": "x"}) == "x.toml: name: must be a string, got 1 (and 1 more)"


def test_an_unknown_key_is_reported_before_the_missing_one_it_was_meant_to_be():
    assert _message({"nmae": "a"}) == \
        "x.toml: unknown key(s) ['nmae']; known: ['args', 'gate', 'name', 'ratio'] (and 1 more)"


def test_key_path_forms():
    assert key_path(("gate", "oracle")) == "gate.oracle"
    assert key_path(("flags", "F", "args", 0)) == "flags.F.args[0]"
    assert key_path(()) == ""


def test_read_model_goes_through_the_one_reader(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text('name = "a"\n[gate]\noracle = "deepseek"\n')
    assert read_model(Top, good, "test config", ConfigError).gate.oracle == "deepseek"
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "a"\n[gate]\noracle = "foo"\n')
    with pytest.raises(ConfigError, match=r"bad\.toml: gate\.oracle: unknown oracle 'foo'"):
        read_model(Top, bad, "test config", ConfigError)
    with pytest.raises(ConfigError, match=r"missing\.toml: test config does not exist"):
        read_model(Top, tmp_path / "missing.toml", "test config", ConfigError)
    broken = tmp_path / "broken.toml"
    broken.write_text("name = \n")
    with pytest.raises(ConfigError, match=r"broken\.toml: cannot read test config"):
        read_model(Top, broken, "test config", ConfigError)


class Flag(StrictModel):
    env: dict[str, str] = {}
    args: Seq[str] = ()


class WithFlags(StrictModel):
    flags: dict[str, Flag] = {}

    @classmethod
    def explain(cls, problem, data):
        if problem.kind == "string_type" and problem.loc[-1] == "args":
            return "never reached: the loc of an item ends in its index"
        if problem.kind == "dict_type":
            return f"[{key_path(problem.loc)}] must be a table of strings, not {problem.value!r}"
        return None


def test_unknown_keys_of_one_table_are_gathered_and_known_ones_found_through_tables_of_models():
    with pytest.raises(ConfigError) as info:
        parse_model(WithFlags, {"flags": {"F": {"colour": 1, "size": 2}}}, "p.toml", ConfigError)
    assert str(info.value) == "p.toml: flags.F: unknown key(s) ['colour', 'size']; known: ['args', 'env']"


def test_a_schema_words_its_own_problems_and_falls_back_to_the_default():
    with pytest.raises(ConfigError) as info:
        parse_model(WithFlags, {"flags": {"F": {"env": 3}}}, "p.toml", ConfigError)
    assert str(info.value) == "p.toml: [flags.F.env] must be a table of strings, not 3"
    with pytest.raises(ConfigError) as info:
        parse_model(WithFlags, {"flags": {"F": {"args": [1]}}}, "p.toml", ConfigError)
    assert str(info.value) == "p.toml: flags.F.args[0]: must be a string, got 1"


@pydantic_dataclass(frozen=True, config=STRICT)
class Target:
    panel: StrictStr = "default"
    size: StrictInt = 1

    @classmethod
    def explain(cls, problem, data):
        return f" [target]: {problem.text}" if problem.kind != "extra_forbidden" else None


def test_a_pydantic_dataclass_schema_is_read_the_same_way():
    assert parse_model(Target, {"panel": "x"}, "t.toml", ConfigError) == Target(panel="x")
    assert dataclasses.replace(Target(), size=2).size == 2
    with pytest.raises(ConfigError) as info:
        parse_model(Target, {"pannel": "x"}, "t.toml", ConfigError)
    assert str(info.value) == "t.toml: unknown key(s) ['pannel']; known: ['panel', 'size']"
    with pytest.raises(ConfigError) as info:
        parse_model(Target, {"size": "2"}, "t.toml", ConfigError)
    assert str(info.value) == "t.toml [target]: must be an integer, got '2'"
