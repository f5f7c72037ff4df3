"""The engine's image encoder in process: hand preprocessed pixels to engine/vision_tower_runner.py in the
engine's own environment (one subprocess) and read back what its vision tower and connector computed.
The verdict is the gate's (gates/lib/vision_tower.py)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Mapping, Sequence

import torch
from safetensors.torch import load_file, save_file

from core.atomic import atomic_write_text
from core.paths import repo_root


class VisionTowerRunError(RuntimeError):
    pass


def run_engine_image_encoder(python: Path, model_dir: Path, pixels: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                             work: Path, dtypes: Sequence[str] = ("float32",),
                             timeout: float = 900.0) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
    """pixels: image name -> (pixel values [3, H, W] fp32, pixel attention mask [H, W]).
    Returns ({dtype: {image: rows [tokens, d] fp32}}, the runner's report + wall time)."""
    if not Path(python).exists():
        raise VisionTowerRunError(f"engine python not found: {python} (build it with scripts/setup-vllm.sh)")
    work.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, (pv, mask) in pixels.items():
        tensors[f"pixels/{name}"] = pv.to(torch.float32).contiguous()
        tensors[f"mask/{name}"] = mask.contiguous()
    save_file(tensors, str(work / "inputs.safetensors"))
    req = {"model_dir": str(model_dir), "inputs": str(work / "inputs.safetensors"),
           "outputs": str(work / "outputs.safetensors"), "report": str(work / "runner.json"), "dtypes": list(dtypes)}
    atomic_write_text(work / "request.json", json.dumps(req, indent=1))
    from engine.environment import engine_base_env

    env = engine_base_env()   # the engine's code starts from the minimal base (engine/environment.py)
    env.update(VLLM_LOGGING_LEVEL="WARNING", PYTHONPATH=str(repo_root()), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    t0 = time.perf_counter()
    proc = subprocess.run([str(python), "-m", "engine.vision_tower_runner", str(work / "request.json")],
                          cwd=str(repo_root()), env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise VisionTowerRunError(f"vision tower runner failed (rc {proc.returncode}) with {python}:\n"
                                  f"{proc.stderr[-4000:]}")
    report = json.loads((work / "runner.json").read_text())
    report["wall_s"] = wall
    errors = {d: r["error"] for d, r in report["runs"].items() if "error" in r}
    if errors:
        raise VisionTowerRunError(f"vision tower runner: {errors}\n" + "\n".join(
            r.get("traceback", "") for r in report["runs"].values()))
    outs = load_file(str(work / "outputs.safetensors"))
    by_dtype: dict[str, dict[str, torch.Tensor]] = {d: {} for d in dtypes}
    for key, v in outs.items():
        d, name = key.split("/", 1)
        by_dtype[d][name] = v
    return by_dtype, report
