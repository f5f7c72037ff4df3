"""The tower gate on a real tower: the oracle's tiny tower as the engine passes at its bf16 floor, an engine with
the wrong image normalisation or a truncated tower fails; the limits come from VLLM_DS41_VISION's registry
entry."""

from __future__ import annotations

import numpy as np
import pytest

from gates.lib.vision_tower import VISION_FLAG, tower_gate
from nightly.flags import FlagRegistryError, load_registry, parse_registry
from oracle.dsv41.image_processor import process_image
from oracle.dsv41.numerics import Numerics
from oracle.dsv41.tiny import TINY_VISION_OVERRIDES, random_vision_weights, tiny_config
from oracle.dsv41.vision import VisionTower

CFG = tiny_config(TINY_VISION_OVERRIDES)


@pytest.fixture(scope="module")
def setup():
    tower = VisionTower(CFG).load(random_vision_weights(CFG, 0, "vision."))
    rng = np.random.default_rng(0)
    images = {f"img{i}": process_image(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), CFG)
              for i, (h, w) in enumerate([(56, 56), (42, 70), (84, 28)])}

    def run(mode, patches_of=lambda im: im.patches, t=tower):
        return {k: t(patches_of(im), im.n_vit_h, im.n_vit_w, Numerics(mode)) for k, im in images.items()}
    return tower, images, run, run("fp32"), run("reference-bf16")


def test_registry_registers_the_vision_flag_with_tower_thresholds():
    entry = load_registry().get(VISION_FLAG)
    assert entry.component == "vision" and entry.cls == "numerics"
    assert entry.thresholds.tower_floor_factor == 1.0 and entry.thresholds.tower_abs_floor == 0.0


def test_a_faithful_bf16_engine_passes_and_the_row_names_the_flag(setup):
    _, _, _, fp32, bf16 = setup
    row = tower_gate(bf16, fp32, bf16, load_registry())
    assert row["flag"] == VISION_FLAG and row["gate"] == "vision_tower" and row["passed"], row["why"]
    assert all(0 < r["floor_rel_l2"] == r["engine_rel_l2"] for r in row["images"])


def test_wrong_normalisation_or_a_missing_block_fails(setup):
    tower, _, run, fp32, bf16 = setup
    # mean/std changed on the engine side: (x/255 - 0.485)/0.229-like scaling instead of (x/255 - 0.5)/0.5
    wrong_norm = run("reference-bf16", lambda im: (im.patches * 0.5 + 0.5 - 0.485) / 0.229)
    row = tower_gate(wrong_norm, fp32, bf16, load_registry())
    assert not row["passed"] and all(not r["passed"] for r in row["images"])
    short = VisionTower(CFG)
    short.__dict__.update(tower.__dict__)
    short.blocks = tower.blocks[:1]
    row = tower_gate(run("reference-bf16", t=short), fp32, bf16, load_registry())
    assert not row["passed"]


def test_thresholds_come_from_the_registry_and_unknown_flags_are_refused(setup):
    _, _, _, fp32, bf16 = setup
    loose = {k: v * 1.0 + (bf16[k] - fp32[k]) * 0.5 for k, v in bf16.items()}  # 1.5x (ish) the floor away
    assert not tower_gate(loose, fp32, bf16, load_registry())["passed"]
    base = load_registry()
    relaxed = parse_registry({"flags": {VISION_FLAG: {"thresholds": {"tower_floor_factor": 2.0}}}}, "test", base)
    assert tower_gate(loose, fp32, bf16, relaxed)["passed"]
    with pytest.raises(FlagRegistryError, match="not in the flag registry"):
        tower_gate(bf16, fp32, bf16, base, flag="VLLM_DS41_VISON")
