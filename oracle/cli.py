"""`ds41gate oracle`: run an oracle over a panel and merge shard records. A DeepSeek checkpoint goes to the
DeepSeek oracle (oracle/dsv41/runner.py: layer-streamed, resumable, shardable); any other transformers model
folder to the generic fp32 transformers oracle (oracle/hf.py). This module only parses the command line,
turns the --panel argument into an EncodedPanel, and reports."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer

from oracle.kinds import ORACLE_KINDS, OracleKind, OracleKindError, oracle_kind, oracle_kind_of

oracle_app = typer.Typer(help="The fp32 oracles: DeepSeek's (layer-streamed) and the generic transformers one.",
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


IMPLEMENTATIONS = ("auto", *sorted(ORACLE_KINDS))


def chosen_kind(checkpoint: Path, implementation: str) -> OracleKind:
    """The oracle kind `--implementation` names, or (auto) the one the checkpoint's config.json belongs to."""
    if implementation not in IMPLEMENTATIONS:
        _fail(f"--implementation {implementation!r}: must be one of {', '.join(IMPLEMENTATIONS)}")
    try:
        return oracle_kind_of(checkpoint) if implementation == "auto" else oracle_kind(implementation)
    except OracleKindError as exc:
        _fail(str(exc))


def _run_whole_panels(kind: OracleKind, checkpoint: Path, panel: str, out: Path, work: Optional[Path],
                      tokenizer: Optional[str], precision: str, threads: int, top_k: int, full_logprobs: bool,
                      progress: bool, keep_work: bool, restart: bool, refused: dict) -> None:
    """An oracle that scores whole panels in memory (the generic fp32 transformers oracle) behind the same
    command; the layer-streamed runner's options that have no meaning for it are refused, never ignored."""
    import shutil

    from core.records import RecordError
    from oracle.scoring import OracleError

    given = [name for name, is_set in {**refused, "--precision": precision not in kind.run_precisions}.items()
             if is_set]
    if given:
        _fail(f"{', '.join(given)}: DeepSeek-oracle options; {checkpoint} is a {kind.name} model folder "
              f"(the {kind.summary} computes in {', '.join(kind.run_precisions)} on CPU and scores whole panels)")
    tok = tokenizer or str(checkpoint)
    try:
        pin, _ = load_panel_arg(panel, tok)
        # per-sequence results land here as they finish, so an interrupted run resumes where it stopped
        work_dir = work if work is not None else out.with_name(out.name + ".work")
        if restart and work_dir.exists():
            shutil.rmtree(work_dir)
        rec = kind.oracle(None, checkpoint, work_dir, precision=precision, top_k=top_k, threads=threads or 2,
                          progress=progress, full_logprobs=full_logprobs).score(pin)
        rec.save(out)
        if not keep_work:
            shutil.rmtree(work_dir, ignore_errors=True)
    except (OracleError, RecordError, ValueError, OSError) as e:
        _fail(str(e))
    typer.echo(f"wrote {out}: {rec.n_sequences} sequences, {rec.n_positions} scored positions ({kind.name} "
               f"{precision}, {rec.provenance.extra['seconds']:.1f} s, {rec.provenance.extra['resumed_sequences']} "
               "sequences resumed)")


@oracle_app.command("run")
def run_cmd(
    checkpoint: Path = typer.Option(..., "--checkpoint", help="DeepSeek checkpoint dir (config.json, shards) or a "
                                                             "transformers model folder"),
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
    threads: int = typer.Option(0, "--threads", help="CPU threads (0: torch's default; with --cluster: per shard, 0 = 1)"),
    spill: str = typer.Option("auto", "--spill", help="auto | ram | disk: where activations live between layers"),
    top_k: int = typer.Option(256, "--top-k", help="top-k logprobs kept per position (the engine side must ask for <= this)"),
    full_logprobs: bool = typer.Option(False, "--full-logprobs", help="also store float32 full-vocab logprobs"),
    keep_work: bool = typer.Option(False, "--keep-work", help="keep the work dir after success"),
    restart: bool = typer.Option(False, "--restart", help="ignore any state in the work dir"),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="show a progress bar per layer and sequence"),
    stream_experts: bool = typer.Option(False, "--stream-experts",
                                        help="decode routed experts one at a time as the MoE reaches them (one "
                                             "expert in memory instead of a layer's 384: 54 GB fp32 on the "
                                             "release); same record"),
    cluster: Optional[str] = typer.Option(None, "--cluster",
                                          help="score the shards on Ray workers: local:N (N workers started "
                                               "here), auto, HOST:PORT (a Ray head) or ray://HOST:PORT"),
    shards: Optional[int] = typer.Option(None, "--shards",
                                         help="with --cluster: shards to submit (default: the cluster's "
                                              "worker slots, at most one per sequence)"),
    retries: int = typer.Option(2, "--retries", help="with --cluster: reruns of a shard whose worker died or failed"),
    implementation: str = typer.Option("auto", "--implementation",
                                       help=f"{' | '.join(IMPLEMENTATIONS)} (auto: DeepSeek checkpoints go to the "
                                            "DeepSeek oracle, other transformers folders to the generic one)"),
) -> None:
    """Score a panel. DeepSeek checkpoints layer by layer (every sequence through layer L, then L is freed and
    L+1 loaded; with --cluster the panel's shards run on the workers of a Ray cluster and are merged into OUT);
    any other transformers model with the generic fp32 transformers oracle."""
    kind = chosen_kind(checkpoint, implementation)
    if not kind.layer_streamed:
        _run_whole_panels(kind, checkpoint, panel, out, work, tokenizer, precision, threads, top_k, full_logprobs,
                          progress, keep_work, restart,
                          {"--pack": pack is not None, "--device": device != "cpu", "--shard": shard is not None,
                           "--spill": spill != "auto", "--cluster": cluster is not None,
                           "--shards": shards is not None, "--stream-experts": stream_experts})
        return
    if device.startswith("cuda"):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before anything initialises cuBLAS
    from core.records import RecordError
    from oracle.dsv41.checkpoint import Checkpoint, CheckpointError
    from oracle.dsv41.runner import RunnerError, RunOptions, engram_token_map, run_to_file
    from oracle.dsv41.panel_shards import select_shard

    sh = _parse_shard(shard)
    if cluster is not None and sh is not None:
        _fail("--cluster splits the panel itself; it cannot be combined with --shard (that is for schedulers "
              "such as Slurm array jobs)")
    if cluster is None and shards is not None:
        _fail("--shards needs --cluster (without it, use --shard I/N on each machine)")
    tok = tokenizer
    if tok is None and (checkpoint / "tokenizer.json").is_file():
        tok = str(checkpoint)
    try:
        opts0 = RunOptions(precision=precision, device=device, threads=threads, spill=spill, top_k=top_k,
                           full_logprobs=full_logprobs, keep_work=keep_work, restart=restart, progress=progress,
                           stream_experts=stream_experts)
        try:
            pin, panel_tokenizer = load_panel_arg(panel, tok)
        except RunnerError as e:
            if tok is None and "no tokenizer" in str(e):
                _fail(f"{e}: {checkpoint} has no tokenizer.json; pass --tokenizer deepseek (or a path), or a "
                      f"pre-encoded panel (*.json / *.safetensors)")
            raise
        if cluster is not None:
            from oracle.dsv41.cluster import run_on_cluster

            ck = Checkpoint(checkpoint, pack)
            rec = run_on_cluster(checkpoint, pack, pin, out, opts0, cluster, shards=shards, retries=retries,
                                 work=work, token_map=engram_token_map(ck, panel_tokenizer),
                                 log=lambda msg: typer.echo(msg, err=True))
            typer.echo(f"wrote {out}: {rec.n_sequences} sequences, {rec.n_positions} scored positions, merged "
                       f"from {rec.provenance.extra['cluster']['shards']} shards run on {cluster}")
            return
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
    from oracle.dsv41.panel_shards import merge_records

    try:
        rec = merge_records(shards)
        rec.save(out)
    except (RunnerError, RecordError, OSError) as e:
        _fail(str(e))
    typer.echo(f"wrote {out}: {rec.n_sequences} sequences from {len(shards)} shards")


if __name__ == "__main__":  # pragma: no cover
    oracle_app(sys.argv[1:])
