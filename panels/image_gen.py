"""The images of the image panels, drawn deterministically (seeded numpy, PIL, matplotlib's Agg backend).

    python -m panels.image_gen panels/data/images/images-1      # (re)writes the PNGs of images-1

The panel stores the PNGs it was published with (panels/data/images/images-1/*.png) and hashes their pixels,
so a font or matplotlib upgrade that draws a different pixel can never change a published panel: it would
only make this generator disagree with the stored files, which is a reason to publish a new version, not to
rewrite the old one. Every image is small (<= 160 px a side): the CPU rig's tiny vision tower sees 56 px.

Kinds (the issue's list): rendered text, a chart, a screenshot-like layout, photo-like noise, a table.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Callable

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

from core.atomic import atomic_path


def _font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    # Pillow's bundled font (no system font lookup): the same glyphs on every machine with this Pillow
    return ImageFont.load_default(size)


def rendered_text(text: str, size: tuple[int, int] = (160, 64), font_px: int = 18,
                  ink: tuple[int, int, int] = (20, 20, 20), paper: tuple[int, int, int] = (250, 248, 240)) -> Image.Image:
    """Black text on off-white paper, centred: the read-back images."""
    img = Image.new("RGB", size, paper)
    d = ImageDraw.Draw(img)
    f = _font(font_px)
    left, top, right, bottom = d.multiline_textbbox((0, 0), text, font=f, spacing=2)
    x = (size[0] - (right - left)) // 2 - left
    y = (size[1] - (bottom - top)) // 2 - top
    d.multiline_text((x, y), text, font=f, fill=ink, spacing=2)
    return img


def bar_chart(values: tuple[float, ...], labels: tuple[str, ...], title: str,
              size_px: tuple[int, int] = (160, 120)) -> Image.Image:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    dpi = 40
    with plt.rc_context({"font.family": "DejaVu Sans", "font.size": 7, "svg.hashsalt": "ds41",
                         "axes.prop_cycle": matplotlib.cycler(color=["#3366cc"])}):
        fig, ax = plt.subplots(figsize=(size_px[0] / dpi, size_px[1] / dpi), dpi=dpi)
        try:
            ax.bar(labels, values, color=["#3366cc", "#dc3912", "#ff9900", "#109618"][: len(values)])
            ax.set_title(title)
            fig.tight_layout(pad=0.2)
            buf = io.BytesIO()
            fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
        finally:
            plt.close(fig)
    buf.seek(0)
    return Image.open(buf).convert("RGB").resize(size_px, Image.Resampling.NEAREST)


def screenshot(title: str, lines: tuple[str, ...], size: tuple[int, int] = (160, 112)) -> Image.Image:
    """A window: title bar with three buttons, a sidebar, code-like lines, a highlighted row."""
    img = Image.new("RGB", size, (238, 238, 238))
    d = ImageDraw.Draw(img)
    w, h = size
    d.rectangle((0, 0, w - 1, 14), fill=(52, 58, 70))
    for k, c in enumerate(((237, 106, 94), (245, 191, 79), (98, 197, 84))):
        d.ellipse((4 + 10 * k, 4, 10 + 10 * k, 10), fill=c)
    d.text((40, 2), title, font=_font(10), fill=(230, 230, 230))
    d.rectangle((0, 15, 30, h - 1), fill=(210, 214, 222))
    for k in range(5):
        d.rectangle((4, 20 + 12 * k, 26, 26 + 12 * k), fill=(150, 160, 175))
    d.rectangle((31, 15 + 13 * 2, w - 1, 15 + 13 * 3), fill=(255, 243, 176))
    for k, line in enumerate(lines):
        d.text((35, 17 + 13 * k), line, font=_font(10), fill=(30, 30, 90))
    return img


def table(rows: tuple[tuple[str, ...], ...], size: tuple[int, int] = (160, 96)) -> Image.Image:
    img = Image.new("RGB", size, (255, 255, 255))
    d = ImageDraw.Draw(img)
    n_r, n_c = len(rows), len(rows[0])
    cw, rh = (size[0] - 2) // n_c, (size[1] - 2) // n_r
    for r, row in enumerate(rows):
        if r == 0:
            d.rectangle((1, 1, size[0] - 2, rh), fill=(220, 230, 245))
        for c, cell in enumerate(row):
            d.rectangle((1 + c * cw, 1 + r * rh, 1 + (c + 1) * cw, 1 + (r + 1) * rh), outline=(90, 90, 90))
            d.text((4 + c * cw, 3 + r * rh), cell, font=_font(11), fill=(0, 0, 0))
    return img


def photo_noise(seed: int, size: tuple[int, int] = (128, 96)) -> Image.Image:
    """Photo-like: smooth colour fields (blurred low-resolution noise) plus fine grain."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, size=(6, 8, 3), dtype=np.uint8)
    base = Image.fromarray(coarse, "RGB").resize(size, Image.Resampling.BICUBIC).filter(ImageFilter.GaussianBlur(3))
    grain = rng.normal(0.0, 12.0, size=(size[1], size[0], 3))
    arr = np.clip(np.asarray(base, dtype=np.float64) + grain, 0, 255).round().astype(np.uint8)
    return Image.fromarray(arr, "RGB")


# The images of panel images-1: file stem -> how it is drawn.
IMAGES_1: dict[str, Callable[[], Image.Image]] = {
    "note-total": lambda: rendered_text("TOTAL 42.17 EUR"),
    "note-code": lambda: rendered_text("K7-QX9", size=(120, 56), font_px=22),
    "note-poem": lambda: rendered_text("Slow rivers\ncarry the night", size=(160, 72), font_px=15),
    "chart-sales": lambda: bar_chart((3.0, 7.0, 5.0, 9.0), ("Q1", "Q2", "Q3", "Q4"), "Sales 2025"),
    "screen-editor": lambda: screenshot("main.py", ("def add(a, b):", "    return a + b", "print(add(2, 3))",
                                                    "# output: 5")),
    "table-stock": lambda: table((("item", "qty", "price"), ("bolt", "40", "0.10"), ("nut", "25", "0.05"),
                                  ("gear", "3", "7.50"))),
    "photo-dusk": lambda: photo_noise(41),
    "photo-field": lambda: photo_noise(7, size=(96, 128)),
}


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def write_images(out_dir: Path, images: dict[str, Callable[[], Image.Image]] = IMAGES_1) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for stem, draw in images.items():
        path = out_dir / f"{stem}.png"
        with atomic_path(path) as tmp:
            Path(tmp).write_bytes(png_bytes(draw()))
        written.append(path)
    return written


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m panels.image_gen OUT_DIR", file=sys.stderr)
        raise SystemExit(2)
    for p in write_images(Path(sys.argv[1])):
        print(p)
