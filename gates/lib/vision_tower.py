"""The vision tower gate, tied to the flag that guards an engine's vision path.

In process like the kernel gates: the caller runs the engine's tower module and the oracle's tower
(oracle.dsv41.vision.VisionTower, both precision modes) on the same processed images and hands the three
outputs over; the limits come from the flag's registry thresholds (`tower_floor_factor`, `tower_abs_floor`),
so a registry file can tighten or loosen them per engine without code.
"""

from __future__ import annotations

from typing import Mapping

import torch

from core.metrics.tower import tower_verdict
from nightly.flags import Registry

VISION_FLAG = "VLLM_DS41_VISION"
GATE_NAME = "vision_tower"


def tower_gate(engine: Mapping[str, torch.Tensor], oracle_fp32: Mapping[str, torch.Tensor],
               oracle_bf16: Mapping[str, torch.Tensor], registry: Registry, flag: str = VISION_FLAG) -> dict:
    """The gate's result row: flag, gate, verdict and the per-image figures. An unregistered flag is a
    FlagRegistryError (gates.md §10.1: unknown flags are refused)."""
    th = registry.get(flag).thresholds
    v = tower_verdict(engine, oracle_fp32, oracle_bf16, th.tower_floor_factor, th.tower_abs_floor)
    return {"flag": flag, "gate": GATE_NAME, **v.to_dict()}
