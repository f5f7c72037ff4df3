"""nightly/configs/gpu-h200.toml parses with the nightly's own loader and preflight (every profile loads, every
flag is registered) and every name it uses resolves, without launching anything: the profiles' flag tables, the
--engine-flag and --reference each cell passes, and the matrix the issue asks for (bf16 + EXL3 at 4, 3, 2 bits ×
the EXL3_INT8_GEMV modes × the DSpark drafter off/on)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine.profiles import load_profile
from nightly.runner import NightlyConfigError, cell_argv, load_config, parse_config

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "nightly" / "configs" / "gpu-h200.toml"


@pytest.fixture(scope="module")
def cfg():
    return load_config(CONFIG)   # parse + check_cells: profiles load, flags are in the config's registry


def _opt(args, name):
    return [args[i + 1] for i, a in enumerate(args) if a == name]


def test_every_flag_and_engine_flag_is_a_table_of_its_profile(cfg):
    for cell in cfg.cells:
        prof = load_profile(cell.profile)
        for f in (*cell.flags, *_opt(cell.pytest_args, "--engine-flag")):
            assert f in prof.flags, f"{cell.name}: {f} is not a [flags.{f}] table of {prof.name}"


def test_the_matrix_covers_bits_int8_modes_and_the_drafter(cfg):
    by_profile: dict[str, list] = {}
    for cell in cfg.cells:
        by_profile.setdefault(load_profile(cell.profile).name, []).append(cell)
    assert set(by_profile) == {"exllamav3-dsv4-bf16", "exllamav3-dsv4-exl3", "exllamav3-dsv4-exl3-b3",
                               "exllamav3-dsv4-exl3-b2"}
    for name, cells in by_profile.items():
        # the drafter off (as launched) with a dspark A/B, and a whole cell with the drafter on
        assert any("dspark" in c.flags for c in cells), name
        assert any("dspark" in _opt(c.pytest_args, "--engine-flag") for c in cells), name
        if name == "exllamav3-dsv4-bf16":
            continue
        # both non-default EXL3_INT8_GEMV modes, with the drafter off and on (mode 2 is the launch default)
        for c in cells:
            assert {"no_int8_gemv", "int8_gemv_residual"} <= set(c.flags), c.name
            env = {f: load_profile(c.profile).flags[f].env for f in ("no_int8_gemv", "int8_gemv_residual")}
            assert env == {"no_int8_gemv": {"EXL3_INT8_GEMV": "0"}, "int8_gemv_residual": {"EXL3_INT8_GEMV": "1"}}


def test_each_exl3_cell_is_judged_against_its_own_weights(cfg):
    """An EXL3 engine's KL reference is the oracle decoding the same EXL3 folder (docs/EXLLAMAV3.md §2): the
    reference a cell names is the one the session driver writes for that profile's bits."""
    for cell in cfg.cells:
        prof = load_profile(cell.profile)
        model = prof.args[prof.args.index("--model") + 1]
        refs = _opt(cell.pytest_args, "--reference")
        m = re.fullmatch(r"dsv4-tiny-exl3-b(\d)", model)
        if m is None:
            assert refs == [], f"{cell.name}: the bf16 cells use the target's own reference"
            continue
        assert refs == [f"refs/exl3/refs/ref-{m[1]}.safetensors"], cell.name
        argv = cell_argv(cfg, cell, Path("/tmp/cell"))
        assert argv[-len(cell.pytest_args):] == list(cell.pytest_args)


def test_a_cell_key_outside_the_schema_is_refused():
    data = {"nightly": {"name": "x"}, "cells": [{"profile": "exllamav3-dsv4-bf16", "pytest_arg": ["-x"]}]}
    with pytest.raises(NightlyConfigError, match=r"cells\[0\]: a cell holds"):
        parse_config(data, "x.toml", ROOT)
    data["cells"][0] = {"profile": "exllamav3-dsv4-bf16", "pytest_args": "-x"}
    with pytest.raises(NightlyConfigError, match=r"pytest_args must be a list of strings"):
        parse_config(data, "x.toml", ROOT)
