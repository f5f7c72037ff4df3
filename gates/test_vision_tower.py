"""Gate 1 of issue 18, in process like the kernel gates: the engine's own image encoder (vLLM's Idefics3
vision tower and connector, run in the vLLM environment by engine/vision_tower_runner.py) on the image
panel's images, against the oracle's fp32 encoder (transformers, oracle/hf_vision.py) — relative L2 per image,
with the oracle's bf16 encoder as the noise floor, through gates/lib/vision_tower.py's verdict (limits from the
VLLM_DS41_VISION registry entry).

Both sides get the same pixels (the model's own Idefics3 image processor, run once here), so the gate sees
the tower and connector, nothing else. Can fail: the engine fed ImageNet-normalised pixels (a wrong
preprocessing on the engine side) must fail the same verdict.

    pytest gates/test_vision_tower.py -m gate [--results DIR]
"""

from __future__ import annotations

import pytest
import torch

from core.atomic import write_json_atomic
from core.paths import cache_dir
from core.results import GateEntry
from gates.lib.vision_tower import VISION_FLAG, tower_gate
from nightly.flags import load_registry

pytestmark = pytest.mark.gate

IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


@pytest.fixture(scope="module")
def tower_run(gate_run):
    from engine.launcher import VLLM_VENV
    from engine.vision_tower import VisionTowerRunError, run_engine_image_encoder
    from engine.vlm import ensure_tiny_vlm
    from oracle.hf_vision import HFVisionOracle
    from panels.images import load_image_panel

    python = cache_dir() / "venvs" / VLLM_VENV / "bin" / "python"
    if not python.exists():
        pytest.skip(f"vLLM environment not built: {python} missing (scripts/setup-vllm.sh)")
    model_dir = ensure_tiny_vlm()
    panel = load_image_panel("images")
    names = sorted(panel.images)
    orc = HFVisionOracle.load(model_dir)
    pv, mask = orc.pixel_values([panel.images[n] for n in names])
    wrong = HFVisionOracle.load(model_dir, processor_overrides={"image_mean": IMAGENET_MEAN,
                                                                "image_std": IMAGENET_STD})
    wpv, wmask = wrong.pixel_values([panel.images[n] for n in names])
    inputs = {n: (pv[0, i], mask[0, i]) for i, n in enumerate(names)}
    inputs.update({f"wrongnorm-{n}": (wpv[0, i], wmask[0, i]) for i, n in enumerate(names)})
    try:
        engine, report = run_engine_image_encoder(python, model_dir, inputs, gate_run.folder.vision_tower_work,
                                                  dtypes=("float32", "bfloat16"))
    except VisionTowerRunError as exc:
        pytest.fail(str(exc))
    fp32 = dict(zip(names, orc.image_features(pv, mask)))
    bf16 = dict(zip(names, orc.image_features(pv, mask, torch.bfloat16)))
    return {"names": names, "engine": engine, "fp32": fp32, "bf16": bf16, "report": report}


def _rows(run, dtype, prefix=""):
    return {n: run["engine"][dtype][prefix + n] for n in run["names"]}


def test_engine_fp32_image_encoder_matches_the_oracle(tower_run, gate_run):
    row = tower_gate(_rows(tower_run, "float32"), tower_run["fp32"], tower_run["bf16"], load_registry())
    bf16_row = tower_gate(_rows(tower_run, "bfloat16"), tower_run["fp32"], tower_run["bf16"], load_registry())
    doc = {"fp32": row, "bf16": bf16_row, "runner": {k: v for k, v in tower_run["report"].items() if k != "runs"}}
    write_json_atomic(gate_run.folder.vision_tower_file, doc)
    gate_run.add(GateEntry("vision_tower", row["passed"], flag=row["flag"],
                           failures=[] if row["passed"] else [row["why"]],
                           evidence={"why": row["why"], "bf16_engine_passed": bf16_row["passed"],
                                     "bf16_engine_why": bf16_row["why"]}))
    worst = max(r["engine_rel_l2"] for r in row["images"])
    floor = min(r["floor_rel_l2"] for r in row["images"])
    print(f"\nvision tower (fp32 engine): worst rel. L2 {worst:.2e}, bf16 floor >= {floor:.2e}; "
          f"bf16 engine: {bf16_row['why']}")
    assert row["flag"] == VISION_FLAG
    assert row["passed"], row["why"]
    # the floor is real: bf16 moves the rows by far more than the fp32 engine does
    assert floor > 100 * worst


def test_wrong_preprocessing_on_the_engine_side_fails(tower_run):
    row = tower_gate(_rows(tower_run, "float32", "wrongnorm-"), tower_run["fp32"], tower_run["bf16"], load_registry())
    assert not row["passed"]
    assert all(not r["passed"] for r in row["images"]), row["why"]
