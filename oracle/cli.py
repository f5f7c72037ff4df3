"""`ds41gate oracle`: run the DeepSeek-V4.1 oracle over a panel (layer-streamed, resumable, shardable) and
merge shard records. The work is oracle/dsv41/runner.py (and shards.py); this module only parses the
command line, turns the --panel argument into an EncodedPanel, and reports."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer

oracle_app = typer.Typer(help="The DeepSeek-V4.1 fp32 oracle: layer-streamed panel runs and shard merges.",
                         no_args_is_help=True, add_completion=False)


def _fail(msg: str, code: int = 2) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(code)


def _parse_shard(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        i, n = (int(v) for v in text.split("/"))
    except ValueError:
        _fail(f"--shard {text!r}: expected I/N, e.g. 0/4")
    if not (n >= 1 and 0 <= i < n):
        _fail(f"--shard {text}: need 0 <= I < N")
    return i, n


def load_panel_arg(spec: str, tokenizer: str | None):
    """`spec`: a *.json pre-encoded panel, a *.safetensors record, or a panel name (encoded with `tokenizer`,
    a spec for panels.load_tokenizer). -> (EncodedPanel, the PanelTokenizer it was encoded with or None)."""
    import panels
    from core.records import Record
    from oracle.dsv41.runner import RunnerError

    if spec.endswith(".json") and not spec.endswith(".manifest.json"):
        return panels.encoded_from_json(spec), None
    if spec.endswith(".safetensors"):
        return panels.encoded_from_record(Record.load(spec), spec), None
    if tokenizer is None:
        raise RunnerError(f"panel {spec!r} must be encoded, but no tokenizer was given")
    tok = panels.load_tokenizer(tokenizer)
    return panels.encode_panel(panels.load_panel(spec), tok), tok


@oracle_app.command("run")
def run_cmd(
    checkpoint: Path = typer.Option(..., "--checkpoint", help="official checkpoint dir (config.json, shards)"),
    panel: str = typer.Option(..., "--panel", help="panel NAME[@VERSION], a pre-encoded *.json (token-id lists), "
                                                   "or a *.safetensors record whose sequences to score"),
    out: Path = typer.Option(..., "--out", help="reference record to write (ds41-record/1)"),
    pack: Optional[Path] = typer.Option(None, "--pack", help="build pack layered over the checkpoint"),
    precision: str = typer.Option("fp32", "--precision", help="fp32 | reference-bf16"),
    device: str = typer.Option("cpu", "--device", help="cpu | cuda[:N] (TF32 off, deterministic algorithms)"),
    shard: Optional[str] = typer.Option(None, "--shard", help="I/N: score every N-th sequence starting at I"),
    work: Optional[Path] = typer.Option(None, "--work", help="resumable state (default: OUT.work)"),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer",
                                            help="'deepseek' or a path (default: the checkpoint dir)"),
    threads: int = typer.Option(0, "--threads", help="CPU threads (0: torch's default)"),
    spill: str = typer.Option("auto", "--spill", help="auto | ram | disk: where activations live between layers"),
    top_k: int = typer.Option(256, "--top-k"),
    full_logprobs: bool = typer.Option(False, "--full-logprobs", help="also store float32 full-vocab logprobs"),
    keep_work: bool = typer.Option(False, "--keep-work", help="keep the work dir after success"),
    restart: bool = typer.Option(False, "--restart", help="ignore any state in the work dir"),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
) -> None:
    """Score a panel layer by layer: every sequence through layer L, then L is freed and L+1 loaded."""
    if device.startswith("cuda"):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before anything initialises cuBLAS
    from core.records import RecordError
    from oracle.dsv41.checkpoint import Checkpoint, CheckpointError
    from oracle.dsv41.runner import RunnerError, RunOptions, engram_token_map, run_to_file
    from oracle.dsv41.shards import select_shard

    sh = _parse_shard(shard)
    tok = tokenizer
    if tok is None and (checkpoint / "tokenizer.json").is_file():
        tok = str(checkpoint)
    try:
        opts0 = RunOptions(precision=precision, device=device, threads=threads, spill=spill, top_k=top_k,
                           full_logprobs=full_logprobs, keep_work=keep_work, restart=restart, progress=progress)
        try:
            pin, panel_tokenizer = load_panel_arg(panel, tok)
        except RunnerError as e:
            if tok is None and "no tokenizer" in str(e):
                _fail(f"{e}: {checkpoint} has no tokenizer.json; pass --tokenizer deepseek (or a path), or a "
                      f"pre-encoded panel (*.json / *.safetensors)")
            raise
        total = len(pin.sequences)
        indices = tuple(range(total))
        if sh is not None:
            pin, picked = select_shard(pin, *sh)
            indices = tuple(picked)
        import dataclasses

        opts = dataclasses.replace(opts0, shard=sh, seq_indices=indices, panel_sequences=total)
        ck = Checkpoint(checkpoint, pack)
        rec = run_to_file(ck, pin, out, work, opts, engram_token_map(ck, panel_tokenizer))
    except (RunnerError, CheckpointError, RecordError, ValueError, OSError) as e:
        _fail(str(e))
    run = rec.provenance.extra["run"]
    typer.echo(f"wrote {out}: {rec.n_sequences} sequences, {rec.n_positions} scored positions, "
               f"{run['total_s']:.1f} s (weights {run['read_s']:.1f} s, compute {run['compute_s']:.1f} s, "
               f"activations {run['io_s']:.1f} s), peak RSS {run['peak_rss_kib'] / 2**20:.2f} GiB, "
               f"resumed from stage {run['resumed_from_stage']}")


@oracle_app.command("merge")
def merge_cmd(
    shards: list[Path] = typer.Argument(..., help="records written with --shard I/N"),
    out: Path = typer.Option(..., "--out", help="merged reference record"),
) -> None:
    """Join shard records into the record an unsharded run writes."""
    from core.records import RecordError
    from oracle.dsv41.runner import RunnerError
    from oracle.dsv41.shards import merge_records

    try:
        rec = merge_records(shards)
        rec.save(out)
    except (RunnerError, RecordError, OSError) as e:
        _fail(str(e))
    typer.echo(f"wrote {out}: {rec.n_sequences} sequences from {len(shards)} shards")


if __name__ == "__main__":  # pragma: no cover
    oracle_app(sys.argv[1:])
