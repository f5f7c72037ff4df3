"""The vision tower gate's verdict: relative L2 per image of an engine's tower output against the oracle's fp32
tower, with the oracle's reference-bf16 tower as the noise floor (dsv41-architecture.md §5.5, §16).

    rel_l2(x, ref) = ||x - ref||_2 / ||ref||_2          (float64 over every element of the image's output)
    limit(image)   = max(floor_factor * rel_l2(bf16, fp32), abs_floor)
    pass           = rel_l2(engine, fp32) <= limit for every image

An engine at or below the reference's own bf16 distance is indistinguishable from a faithful bf16
implementation of the reference tower (floor_factor 1). Pure: torch tensors in, small records out, no IO.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Mapping

import torch


class TowerInputError(ValueError):
    """Tower outputs that cannot be compared (missing image, shape mismatch, a bad oracle output)."""


def relative_l2(x: torch.Tensor, ref: torch.Tensor, where: str = "tower output") -> float:
    """||x - ref|| / ||ref|| in float64; inf when x has a non-finite value (never 'close')."""
    if tuple(x.shape) != tuple(ref.shape):
        raise TowerInputError(f"{where}: shapes differ {list(x.shape)} vs oracle {list(ref.shape)}")
    r = ref.detach().to(torch.float64)
    if not bool(torch.isfinite(r).all()):
        raise TowerInputError(f"{where}: the oracle output has non-finite values")
    denom = float(r.norm())
    if denom == 0.0:
        raise TowerInputError(f"{where}: the oracle output is all zeros; a relative distance is undefined")
    d = x.detach().to(torch.float64)
    if not bool(torch.isfinite(d).all()):
        return math.inf
    return float((d - r).norm()) / denom


@dataclass(frozen=True)
class TowerImageResult:
    image: str
    engine_rel_l2: float
    floor_rel_l2: float
    limit: float
    passed: bool


@dataclass(frozen=True)
class TowerVerdict:
    images: tuple[TowerImageResult, ...]
    floor_factor: float
    abs_floor: float

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.images)

    @property
    def why(self) -> str:
        bad = [r for r in self.images if not r.passed]
        if not bad:
            worst = max(self.images, key=lambda r: r.engine_rel_l2 / r.limit if r.limit else math.inf)
            return (f"all {len(self.images)} images within the limit; worst {worst.image}: "
                    f"{worst.engine_rel_l2:.3e} <= {worst.limit:.3e} (bf16 floor {worst.floor_rel_l2:.3e})")
        return "; ".join(f"{r.image}: engine {r.engine_rel_l2:.3e} > limit {r.limit:.3e} "
                         f"(bf16 floor {r.floor_rel_l2:.3e} x {self.floor_factor})" for r in bad)

    def to_dict(self) -> dict:
        return {"passed": self.passed, "why": self.why, "floor_factor": self.floor_factor,
                "abs_floor": self.abs_floor, "images": [asdict(r) for r in self.images]}


def tower_verdict(engine: Mapping[str, torch.Tensor], oracle_fp32: Mapping[str, torch.Tensor],
                  oracle_bf16: Mapping[str, torch.Tensor], floor_factor: float = 1.0,
                  abs_floor: float = 0.0) -> TowerVerdict:
    """One result per image id; the three maps must name the same images."""
    if not floor_factor > 0 or not abs_floor >= 0:
        raise TowerInputError(f"tower verdict: floor_factor must be > 0 and abs_floor >= 0, got "
                              f"{floor_factor}, {abs_floor}")
    names = set(oracle_fp32)
    for label, m in (("engine", engine), ("oracle reference-bf16", oracle_bf16)):
        if set(m) != names:
            raise TowerInputError(f"tower verdict: {label} images differ from the oracle fp32 images: "
                                  f"missing {sorted(names - set(m))}, extra {sorted(set(m) - names)}")
    if not names:
        raise TowerInputError("tower verdict: no images")
    out = []
    for name in sorted(names):
        floor = relative_l2(oracle_bf16[name], oracle_fp32[name], f"image {name} (oracle reference-bf16)")
        got = relative_l2(engine[name], oracle_fp32[name], f"image {name} (engine)")
        limit = max(floor_factor * floor, abs_floor)
        out.append(TowerImageResult(name, got, floor, limit, got <= limit))
    return TowerVerdict(tuple(out), floor_factor, abs_floor)
