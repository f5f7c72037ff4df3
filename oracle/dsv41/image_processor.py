"""DeepSeek-V4.1 image preprocessing and the LLM span an image occupies (dsv41-architecture.md §16).

    img = process_image(pil_or_rgb_array, cfg)          # ProcessedImage: patches, ViT grid, LLM grid
    prompt = layout_prompt([ids_before, img, ids_after], cfg)   # VisionPrompt: ids, token types, spans
    prompt = prompt_from_ids(ids_with_spans, [(start, pil_or_array)], cfg)   # ids laid out elsewhere (a panel)
    Model.forward(prompt.ids_tensor(), state, prompt.types_tensor(), images=[prompt.spans])

An image is resized (aspect kept, centred, padded with grey 127) to a pixel size that is a multiple of the
patch size, normalised to (x / 255 - 0.5) / 0.5, and cut into patches [N, 3, p, p] in row-major grid order.
Its LLM span is

    [IMAGE_START] + ([IMAGE] * n_llm_w + [IMAGE_NEW_LINE]) * n_llm_h + [IMAGE_END]

with n_llm = ceil(n_vit / downsample_ratio) per axis; every position of the span carries `image_token_id`.

The patches are kept in fp32: the reference rounds them to bf16, and that rounding is one of the bf16 points
the tower's reference-bf16 mode applies (oracle/dsv41/vision.py), not part of the input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np
import torch
from PIL import Image, ImageOps

from core.errors import UserError

from .config import ModelConfig

# token types, as the reference's image_processor defines them (model.py imports these four)
TEXT, IMAGE, IMAGE_START, IMAGE_END, IMAGE_NEW_LINE = -1, 0, 1, 2, 3
PAD_GREY = 127

ImageLike = Union[Image.Image, np.ndarray]


class ImageInputError(UserError, ValueError):
    """An image or an image prompt the oracle cannot take; the message names which and why."""


@dataclass(frozen=True)
class GridPlan:
    """Pixel size the image is brought to, and the two grids it gives."""

    height: int
    width: int
    n_vit_h: int
    n_vit_w: int
    n_llm_h: int
    n_llm_w: int

    @property
    def n_span(self) -> int:
        return span_length(self.n_llm_h, self.n_llm_w)


@dataclass(frozen=True)
class ProcessedImage:
    patches: torch.Tensor  # [n_vit_h * n_vit_w, 3, p, p] fp32, row-major grid order
    plan: GridPlan

    @property
    def n_vit_h(self) -> int:
        return self.plan.n_vit_h

    @property
    def n_vit_w(self) -> int:
        return self.plan.n_vit_w

    def span_types(self) -> list[int]:
        return span_types(self.plan.n_llm_h, self.plan.n_llm_w)


@dataclass(frozen=True)
class ImageSpan:
    """One image of a sequence: its span starts (IMAGE_START) at position `start`."""

    start: int
    image: ProcessedImage

    @property
    def end(self) -> int:
        return self.start + self.image.plan.n_span


@dataclass(frozen=True)
class VisionPrompt:
    """A sequence with its image spans laid out: the oracle's input for one prompt with images."""

    input_ids: tuple[int, ...]
    token_types: tuple[int, ...]
    spans: tuple[ImageSpan, ...]

    def ids_tensor(self) -> torch.Tensor:
        return torch.tensor([self.input_ids], dtype=torch.int64)

    def types_tensor(self) -> torch.Tensor:
        return torch.tensor([self.token_types], dtype=torch.int64)


def span_length(n_llm_h: int, n_llm_w: int) -> int:
    return n_llm_h * (n_llm_w + 1) + 2


def span_types(n_llm_h: int, n_llm_w: int) -> list[int]:
    return [IMAGE_START] + ([IMAGE] * n_llm_w + [IMAGE_NEW_LINE]) * n_llm_h + [IMAGE_END]


def llm_grid(height: int, width: int, cfg: ModelConfig) -> tuple[int, int]:
    p, r = cfg.vision_patch_size, cfg.vision_downsample_ratio
    return math.ceil(height // p / r), math.ceil(width // p / r)


def _fit_token_budget(height: float, width: float, cfg: ModelConfig) -> tuple[int, int]:
    """The largest aspect-preserving pixel size whose span fits in `vision_max_n_token` positions.

    With n_h = aspect * n_w cells the span is n_h * (n_w + 1) + 2 positions; the real root of that quadratic
    is the widest grid that fits, rounded down to whole aligner cells, then to whole patches."""
    p, cell, budget = cfg.vision_patch_size, cfg.vision_patch_size * cfg.vision_downsample_ratio, cfg.vision_max_n_token
    aspect = height / width
    n_w = math.sqrt((budget - 2) / aspect + 0.25) - 0.5
    n_h = n_w * aspect
    if n_w < 1.0:  # taller than the budget allows even one cell wide: one column
        return (budget - 2) // 2 * cell, cell
    if n_h < 1.0:  # wider than one row of cells allows: one row
        return cell, (budget - 3) * cell
    scale = min(math.floor(n_w) * cell / width, math.floor(n_h) * cell / height)
    return math.floor(height * scale / p) * p, math.floor(width * scale / p) * p


def plan_grid(width: int, height: int, cfg: ModelConfig) -> GridPlan:
    """Pixel size and grids for an image of `width` x `height` pixels (a pure function of the sizes)."""
    if width <= 0 or height <= 0:
        raise ImageInputError(f"image of {width}x{height} pixels: both sides must be positive")
    p = cfg.vision_patch_size
    w, h = float(width), float(height)
    if cfg.vision_max_wh_ratio is not None and w > h * cfg.vision_max_wh_ratio:
        w = h * cfg.vision_max_wh_ratio
    if w * h < cfg.vision_min_pixels:  # small images are enlarged to the minimum pixel count
        grow = math.sqrt(cfg.vision_min_pixels / (w * h))
        w, h = float(int(w * grow)), float(int(h * grow))
    out_h, out_w = math.ceil(h / p) * p, math.ceil(w / p) * p
    n_llm_h, n_llm_w = llm_grid(out_h, out_w, cfg)
    if span_length(n_llm_h, n_llm_w) > cfg.vision_max_n_token:
        out_h, out_w = _fit_token_budget(h, w, cfg)
        n_llm_h, n_llm_w = llm_grid(out_h, out_w, cfg)
        if span_length(n_llm_h, n_llm_w) > cfg.vision_max_n_token:
            raise ImageInputError(f"image of {width}x{height} pixels: no grid fits vision_max_n_token "
                                  f"{cfg.vision_max_n_token}")
    return GridPlan(out_h, out_w, out_h // p, out_w // p, n_llm_h, n_llm_w)


def to_rgb(image: ImageLike, where: str = "image") -> Image.Image:
    """A PIL image (any mode, converted to RGB) or an RGB uint8 array [H, W, 3]."""
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise ImageInputError(f"{where}: an array image must be RGB uint8 [H, W, 3], got {image.dtype} "
                                  f"{list(image.shape)}")
        return Image.fromarray(image, "RGB")
    raise ImageInputError(f"{where}: expected a PIL image or an RGB uint8 array, got {type(image).__name__}")


def process_image(image: ImageLike, cfg: ModelConfig, where: str = "image") -> ProcessedImage:
    rgb = to_rgb(image, where)
    plan = plan_grid(rgb.width, rgb.height, cfg)
    size = (plan.width, plan.height)
    stretch = cfg.vision_max_wh_ratio is not None and rgb.width >= cfg.vision_max_wh_ratio * rgb.height
    if stretch:  # the width was clamped to the ratio: squeeze, nothing to pad
        rgb = rgb.resize(size, Image.Resampling.BICUBIC)
    else:
        rgb = ImageOps.pad(rgb, size, method=Image.Resampling.BICUBIC, color=(PAD_GREY,) * 3)
    x = torch.from_numpy(np.asarray(rgb, dtype=np.float32).copy()).permute(2, 0, 1) / 255
    x = (x - 0.5) / 0.5
    p = cfg.vision_patch_size
    patches = (x.reshape(3, plan.n_vit_h, p, plan.n_vit_w, p).permute(1, 3, 0, 2, 4)
               .reshape(plan.n_vit_h * plan.n_vit_w, 3, p, p).contiguous())
    return ProcessedImage(patches, plan)


def layout_prompt(parts: Sequence[Sequence[int] | ImageLike | ProcessedImage], cfg: ModelConfig) -> VisionPrompt:
    """Token ids and images in reading order -> the sequence the model takes: each image becomes its span of
    `image_token_id` positions with their token types, text positions type TEXT."""
    ids: list[int] = []
    types: list[int] = []
    spans: list[ImageSpan] = []
    for i, part in enumerate(parts):
        if isinstance(part, (Image.Image, np.ndarray, ProcessedImage)):
            img = part if isinstance(part, ProcessedImage) else process_image(part, cfg, f"prompt part {i}")
            spans.append(ImageSpan(len(ids), img))
            t = img.span_types()
            ids += [cfg.image_token_id] * len(t)
            types += t
        else:
            text = [int(t) for t in part]
            if cfg.image_token_id in text:
                raise ImageInputError(f"prompt part {i}: token {cfg.image_token_id} (image_token_id) in text; "
                                      "image positions come only from images")
            ids += text
            types += [TEXT] * len(text)
    return VisionPrompt(tuple(ids), tuple(types), tuple(spans))


def prompt_from_ids(input_ids: Sequence[int], images: Sequence[tuple[int, ImageLike | ProcessedImage]],
                    cfg: ModelConfig) -> VisionPrompt:
    """A sequence whose image spans were laid out elsewhere (a panel's encoded ids) and its images with the
    position of each span's IMAGE_START. Each span must be exactly the `image_token_id` run this config gives
    the image, and no `image_token_id` may stand outside a span."""
    ids = [int(t) for t in input_ids]
    types = [TEXT] * len(ids)
    spans = []
    for k, (start, image) in enumerate(sorted(images, key=lambda si: si[0])):
        where = f"image {k} at position {start}"
        img = image if isinstance(image, ProcessedImage) else process_image(image, cfg, where)
        t = img.span_types()
        end = start + len(t)
        if start < 0 or end > len(ids):
            raise ImageInputError(f"{where}: its span of {len(t)} positions runs outside the {len(ids)} ids")
        if any(types[i] != TEXT for i in range(start, end)):
            raise ImageInputError(f"{where}: its span overlaps the previous image's")
        if any(ids[i] != cfg.image_token_id for i in range(start, end)):
            raise ImageInputError(f"{where}: ids {start}..{end - 1} must all be image_token_id {cfg.image_token_id}"
                                  f" (the image's {img.plan.n_llm_h} x {img.plan.n_llm_w} grid needs {len(t)})")
        types[start:end] = t
        spans.append(ImageSpan(start, img))
    stray = [i for i, (t, ty) in enumerate(zip(ids, types)) if t == cfg.image_token_id and ty == TEXT]
    if stray:
        raise ImageInputError(f"image_token_id {cfg.image_token_id} at position {stray[0]} belongs to no image "
                              f"(a span longer than its image's, or an image missing)")
    return VisionPrompt(tuple(ids), tuple(types), tuple(spans))


@dataclass(frozen=True)
class DeepSeekImageLayout:
    """DeepSeek-V4.1's image layout for a panel (panels.images.ImageLayout): an image's span is
    `image_token_id` over every position `plan_grid` gives it, so `prompt_from_ids` takes the encoded ids."""

    cfg: ModelConfig

    @property
    def name(self) -> str:
        c = self.cfg
        return (f"dsv41-p{c.vision_patch_size}-r{c.vision_downsample_ratio}-min{c.vision_min_pixels}"
                f"-max{c.vision_max_n_token}-wh{c.vision_max_wh_ratio}")

    @property
    def image_token_id(self) -> int:
        return int(self.cfg.image_token_id)

    def span_ids(self, image) -> list[int]:
        """`image` is a panel image (width, height attributes) or anything `to_rgb` takes."""
        w, h = (image.width, image.height) if hasattr(image, "width") else to_rgb(image).size
        return [self.image_token_id] * plan_grid(int(w), int(h), self.cfg).n_span
