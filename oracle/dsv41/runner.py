"""The layer-streamed panel runner: score a whole panel with the DeepSeek-V4.1 oracle while holding one
layer's weights at a time.

    ck = Checkpoint(ckpt_dir, pack_dir)
    panel = panels.encoded_from_json("ids.json")   # or panels.encode_panel(...), panels.encoded_from_record(...)
    rec = DSV41Oracle(ck, work_dir, RunOptions(precision="fp32")).score(panel)   # -> core.records.Record

Order of work (why: every weight is read once per panel, and memory is one layer + the activations):

    stage 0        embed.weight                  -> per sequence: block.embed_step (h, pre)
    stage L + 1    layers.L (+ its Engram)       -> per sequence: block.engram_step, Block(L).attention_part;
                                                    then one MoE call over a group of sequences' FFN inputs
                                                    (each expert used once per group, not once per sequence)
    head           norm.weight, head.weight      -> per sequence: block.head_step -> logits -> oracle.scoring

These are the steps `Model.forward` takes for a one-pass prefill (§7, §17.1), split at layer boundaries; the
window KV and the ratio-2 carry are dropped after their layer (a prefill never reads them again), which is
what keeps the activations small. Between stages every sequence's *state* (h [s, hc, d], pre [s, hc], and
the attention state later layers read: compressed KV, index keys, published top-k indices and candidate
masks, owner pointers, tie counts) is a StageWriter entry (spill.py), held in RAM or spilled to disk. Each
stage is committed atomically into the work dir (workdir.py), so a run killed at any point continues from
the last finished stage and produces the same bytes as an uninterrupted run. Sharding and merging shard
records: panel_shards.py. Allocator, /proc and readahead plumbing: host.py.

A DeepSeek-V4 checkpoint runs the same stages with its architecture's layer and head (arch.arch_of: the V4
layer also gets the token ids for its hash routing, the V4 head reads hc_head_* beside norm and head).
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from core.console import StagedProgress
from core.records import Record, SequenceScores
from oracle.scoring import oracle_provenance, sequence_scores
from panels.model import EncodedPanel, EncodedSequence
from panels.pre_encoded import sequences_hash

from .arch import arch_of
from .attention import SharedRuntime
from .block import Block, ModelState, StepContext, embed_step, engram_step, head_step
from .checkpoint import Checkpoint, OutputBuffers
from .engram import Engram, EngramLayout, NgramHasher, compressed_token_map, tiny_token_map
from .formats import warm_up_decoders
from .head import Embedding
from .host import MallocTuning, Readahead, meminfo_kib, reset_peak_rss, status_kib
from .model import Model
from .numerics import Numerics, TieStats
from .options import TOP_K, RunnerError, RunOptions, compute_context
from .spill import StageReader, StageWriter
from .tiny import is_tiny_checkpoint
from .workdir import KILL_ENV, MANIFEST, Manifest, RunTotals, WorkDir, fault, record_to_file

__all__ = ["DSV41Oracle", "KILL_ENV", "MANIFEST", "RunOptions", "RunnerError", "checkpoint_identity", "engram_token_map",
           "forward_in_memory", "run_panel", "run_to_file"]

# Engram tables up to this many fp32 bytes are loaded whole (tiny checkpoints); larger ones (the release's
# ~98 GB tables) are read row by row through Checkpoint.engram_rows.
WHOLE_TABLE_BYTES = 1 << 30
# LayerCache fields only the owning layer reads, and only in decode: dropped after the layer (prefill only)
# (window_start: where a chunked prefill's trimmed window begins; the runner's one-pass prefill never trims it)
PREFILL_ONLY_CACHE_FIELDS = ("window_kv", "window_start", "carry_kv", "carry_score", "ring", "compress_state",
                             "index_state")
# Sequences share one MoE call while their pending fp32 state (FFN input and output, the residual stream
# and the mHC mixes) stays under this many bytes; a longer sequence goes alone.
MOE_GROUP_BYTES = 1 << 27
# With streamed experts every MoE call decodes each expert it uses again, so the stage's sequences share as
# few calls as this much pending state allows (the default panel at release size: one call, ~1.5 GB)
STREAM_GROUP_BYTES = 1 << 32


# ----------------------------------------------------------------------------------------------------------
# Entry points


@dataclass
class DSV41Oracle:
    """The DeepSeek-V4.1 oracle behind the oracle seam (oracle.seam.Oracle): `score(panel) -> Record`, run
    layer by layer and resumable through `work`. `token_map`: the Engram compressed token map (see
    engram_token_map); generated tiny checkpoints need none."""

    checkpoint: Checkpoint
    work: Path
    opts: RunOptions = RunOptions()
    token_map: np.ndarray | None = None

    def score(self, panel: EncodedPanel) -> Record:
        return run_panel(self.checkpoint, panel, self.work, self.opts, self.token_map)


def run_to_file(ck: Checkpoint, panel: EncodedPanel, out: str | os.PathLike, work: str | os.PathLike | None = None,
                opts: RunOptions = RunOptions(), token_map: np.ndarray | None = None) -> Record:
    """`run_panel`, then write the record atomically and (unless keep_work) delete the work dir."""
    return record_to_file(lambda w: run_panel(ck, panel, w, opts, token_map), out, work, opts.keep_work)


def run_panel(ck: Checkpoint, panel: EncodedPanel, work: str | os.PathLike, opts: RunOptions = RunOptions(),
              token_map: np.ndarray | None = None) -> Record:
    """Score `panel` layer by layer; resumable through `work` (see the module docstring)."""
    t_start = time.perf_counter()
    cfg = ck.model_config
    _check_ids(panel, cfg.vocab_size)
    if token_map is None:
        token_map = engram_token_map(ck)
    hasher = NgramHasher(cfg, EngramLayout.build(cfg), token_map) if cfg.engram_layer_ids else None
    threads = opts.threads or torch.get_num_threads()
    opts = dataclasses.replace(opts, threads=threads)
    with WorkDir(work, _job_identity(ck, panel, opts)).locked() as wd:
        return _run_stages(ck, panel, wd, opts, hasher, t_start)


def engram_token_map(ck: Checkpoint, tokenizer=None) -> np.ndarray | None:
    """The §8.2 compressed token map: None without Engram layers, the stub map for generated tiny
    checkpoints, else built from the tokenizer (a panels.PanelTokenizer) the panel was encoded with."""
    cfg = ck.model_config
    if not cfg.engram_layer_ids:
        return None
    if is_tiny_checkpoint(ck.dir):
        return tiny_token_map(cfg.vocab_size)
    if tokenizer is None:
        raise RunnerError("the checkpoint has Engram layers: its compressed token map needs the tokenizer; "
                          "encode the panel with --tokenizer instead of passing pre-encoded ids")
    return compressed_token_map(tokenizer.tokenizer)


def _check_ids(panel: EncodedPanel, vocab: int) -> None:
    for s in panel.sequences:
        bad = [t for t in s.token_ids if not 0 <= t < vocab]
        if bad:
            raise RunnerError(f"sequence {s.seq_id!r}: token id {bad[0]} is outside the checkpoint's vocabulary "
                              f"0..{vocab - 1} (was the panel encoded with another tokenizer?)")



# ----------------------------------------------------------------------------------------------------------
# The stage loop


def _run_stages(ck: Checkpoint, panel: EncodedPanel, wd: WorkDir, opts: RunOptions, hasher, t_start) -> Record:
    """The embed stage and one stage per layer, each committed to the work dir, from the first stage the
    manifest does not hold; then the head writes the record."""
    cfg = ck.model_config
    n_stages = 1 + cfg.n_layers  # embed + layers; the head writes the record
    stats = RunStats(stages=n_stages + 1, spill=_spill_decision(opts, ck, panel),
                     tokens=sum(len(s.token_ids) for s in panel.sequences))
    manifest = wd.resume(opts.restart)
    reader = None
    if manifest is not None:
        stats.continue_from(manifest.totals)
        reader = StageReader.open_verified(wd.path / manifest.acts, manifest.table, manifest.acts_sha256)
    stats.resumed_from_stage = manifest.stages_done if manifest else 0
    warm_up_decoders()  # JIT code is a per-process constant: loaded before the baseline
    run = _StageRun(ck, panel, wd, opts, hasher, stats, n_stages, _step_groups(panel, cfg, opts),
                    loaded=dict(manifest.loaded) if manifest else {},
                    bar=StagedProgress(opts.progress, n_stages + 1, len(panel.sequences), label="panel"))
    run.malloc.trim()
    stats.baseline_rss_kib = status_kib("VmRSS")
    reset_peak_rss()
    try:
        with compute_context(opts.device, opts.threads):
            for stage in range(stats.resumed_from_stage, n_stages):
                reader = _run_stage(run, stage, reader)
            record = _head_stage(ck, panel, reader, opts, stats, run.bar, run.loaded)
    finally:
        run.readahead.wait()
        run.bar.close()
    reader.close()
    stats.peak_rss_kib = status_kib("VmHWM")
    stats.total_s = time.perf_counter() - t_start
    record.provenance.extra["run"] = dataclasses.asdict(stats)
    return record


@dataclass
class _StageRun:
    """What every stage of one run shares: the job, its running totals, and the host plumbing (the pool the
    next stage decodes into, the readahead of its bytes, the allocator)."""

    ck: Checkpoint
    panel: EncodedPanel
    wd: WorkDir
    opts: RunOptions
    hasher: NgramHasher | None
    stats: "RunStats"
    n_stages: int
    groups: list[list[int]]  # panel indices that share one step call
    loaded: dict[str, str]  # tensor name -> SHA-256 of its stored bytes, every stage so far
    bar: StagedProgress
    buffers: OutputBuffers = field(default_factory=OutputBuffers)
    readahead: Readahead = field(default_factory=Readahead)
    malloc: MallocTuning = field(default_factory=MallocTuning)


def _run_stage(run: _StageRun, stage: int, reader: StageReader | None) -> StageReader:
    """Stage `stage` over every sequence (the states in `reader`, None before the embed stage), committed to
    the work dir; -> the reader of the new stage's states."""
    ck, stats, seqs = run.ck, run.stats, run.panel.sequences
    name = "embed" if stage == 0 else f"layer {stage - 1}"
    run.bar.begin(name, stage)
    writer = StageWriter(run.wd.acts_path(stage), spill=stats.spill)
    t = time.perf_counter()
    step, nbytes = _stage_step(run, stage)
    ck.release_file_handles()  # the shards' mapped pages are not needed once decoded
    stats.read_s += time.perf_counter() - t
    run.readahead.start([r for p in _next_prefixes(ck.model_config, stage, run.n_stages) for r in ck.byte_ranges(p)])
    if nbytes > stats.largest_stage_weight_bytes:
        stats.largest_stage_weight_bytes, stats.largest_stage_name = nbytes, name
    for group in run.groups:
        t = time.perf_counter()
        states = [reader.get(i) if reader is not None else None for i in group]
        t2 = time.perf_counter()
        outputs = step([seqs[i] for i in group], states)
        t3 = time.perf_counter()
        del states
        for i, (arrays, meta) in zip(group, outputs):
            writer.put(arrays, meta)
            run.bar.step()
            if i == 0:
                fault("seq", stage)
        del outputs, arrays
        stats.io_s += (t2 - t) + (time.perf_counter() - t3)
        stats.compute_s += t3 - t2
    del step  # the stage's weights go before the next stage loads its own
    t = time.perf_counter()
    sha = writer.commit(lambda point: fault(point, stage))
    run.loaded.update(ck.loaded_digests())
    stats.activation_bytes = max(stats.activation_bytes, writer.offset)
    run.wd.commit(Manifest(stages_done=stage + 1, stage_name=name, acts=writer.path.name, acts_sha256=sha,
                           acts_bytes=writer.offset, table=writer.table, loaded=dict(run.loaded),
                           totals=stats.totals()),
                  lambda point: fault(point, stage))
    fault("committed", stage)
    if reader is not None:
        reader.close()
        if reader.path != writer.path:
            reader.path.unlink(missing_ok=True)  # the new stage is durable: the old one is garbage
    reader = writer.reader()
    del writer
    stats.io_s += time.perf_counter() - t
    ck.release_file_handles()
    if run.buffers.in_use():  # a reference cycle still holds this stage's weights: collect it
        gc.collect()  # (a full collection costs 0.1-0.4 s with torch loaded, so only then)
    run.buffers.reclaim()  # the stage's arrays nothing references any more serve the next stage
    run.malloc.trim()
    return reader


def _step_groups(panel: EncodedPanel, cfg, opts: RunOptions) -> list[list[int]]:
    """Panel indices sent through one step call together. reference-bf16 reproduces the reference's
    per-sequence calls, whose fp32 ops depend on the row count, so it never groups."""
    if opts.precision != "fp32":
        return [[i] for i in range(len(panel.sequences))]
    return moe_groups(panel.sequences, cfg, STREAM_GROUP_BYTES if opts.stream_experts else MOE_GROUP_BYTES)


def _stage_step(run: _StageRun, stage: int):
    """-> (the stage's step over a group of sequences, the bytes of the weights it holds)."""
    ck, cfg, opts = run.ck, run.ck.model_config, run.opts
    if stage == 0:
        w, nbytes = _load_named(ck, {"embed.weight": "tensor"}, opts.device)
        return _embed_stage_step(Embedding(cfg).load(w), cfg.hc_mult, opts), nbytes
    L = stage - 1
    w, nbytes = _load_layer(ck, L, opts.device, run.buffers, opts.precision, opts.stream_experts)
    block = arch_of(cfg).block(cfg, L, opts.index_k).load(w)
    engram = Engram(cfg, L).load(w) if L in cfg.engram_layer_ids else None
    return _layer_stage_step(block, engram, run.hasher, opts), nbytes


def _next_prefixes(cfg, stage: int, n_stages: int) -> list[str]:
    """What the stage after `stage` reads, for the readahead (a linear by its prefix, as byte_ranges takes it)."""
    if stage + 1 < n_stages:
        return [f"layers.{stage}"]
    return [name.removesuffix(".weight") if kind == "linear" else name
            for name, kind in arch_of(cfg).head_tensors.items()]


@dataclass
class RunStats:
    stages: int = 0
    resumed_from_stage: int = 0
    spill: bool = False
    read_s: float = 0.0  # weights: read + exact decode to fp32
    compute_s: float = 0.0
    io_s: float = 0.0  # activation get / put / commit
    head_s: float = 0.0
    total_s: float = 0.0
    largest_stage_weight_bytes: int = 0
    largest_stage_name: str = ""
    activation_bytes: int = 0  # the largest committed stage
    baseline_rss_kib: int = 0
    peak_rss_kib: int = 0
    tokens: int = 0
    ties: dict = field(default_factory=dict)

    def totals(self) -> RunTotals:
        """What a manifest carries to a resumed run."""
        return RunTotals(**{f.name: getattr(self, f.name) for f in dataclasses.fields(RunTotals)})

    def continue_from(self, totals: RunTotals) -> None:
        """Start from a committed run's totals."""
        for f in dataclasses.fields(RunTotals):
            setattr(self, f.name, getattr(totals, f.name))


def _spill_decision(opts: RunOptions, ck: Checkpoint, panel: EncodedPanel) -> bool:
    if opts.spill != "auto":
        return opts.spill == "disk"
    c = ck.model_config
    per_token = c.hc_mult * c.dim * 4 + c.hc_mult * 4 + c.index_topk * 8 + (c.head_dim + c.index_head_dim) * 4 * 2
    est = sum(len(s.token_ids) * (per_token + len(s.token_ids)) for s in panel.sequences)  # + candidate masks
    budget = opts.ram_budget or meminfo_kib("MemAvailable") * 1024 // 4
    return est > budget


def moe_groups(seqs: Sequence[EncodedSequence], cfg, limit_bytes: int = MOE_GROUP_BYTES) -> list[list[int]]:
    """Consecutive panel indices, grouped so that each group's pending state stays under `limit_bytes`."""
    per_token = 4 * (3 * cfg.hc_mult * cfg.dim + 2 * cfg.dim + cfg.hc_mult * (cfg.hc_mult + 2))
    groups: list[list[int]] = []
    used = 0
    for i, seq in enumerate(seqs):
        need = per_token * len(seq.token_ids)
        if not groups or used + need > limit_bytes:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += need
    return groups


# ----------------------------------------------------------------------------------------------------------
# One stage's work on a group of sequences: the schedule steps of block.py


def _embed_stage_step(embed: Embedding, hc: int, opts: RunOptions):
    def step(group: list[EncodedSequence], _states):
        out = []
        for seq in group:
            h, pre = embed_step(embed, torch.tensor([seq.token_ids], dtype=torch.int64), hc)
            out.append(_capture(ModelState(num=Numerics(opts.precision), batch=1), h, pre))
        return out
    return step


def _layer_stage_step(block: Block, engram: Engram | None, hasher: NgramHasher | None, opts: RunOptions):
    """Block(L) over a group of sequences: the attention part per sequence, then ONE MoE call over the
    concatenated FFN inputs (the MoE is per token and every op is row-independent, so this is bit-identical
    to a call per sequence; tested against the in-memory forward). The router's tie counts of the group
    are credited to its first sequence: the run's totals are exact."""
    def step(group: list[EncodedSequence], states):
        runs, ffn_inputs, group_ids = [], [], []
        for seq, state in zip(group, states):
            st, h, pre = _restore(*state, opts.precision, opts.device)
            hashes = None
            if engram is not None:
                with torch.device("cpu"):  # the hasher's tables live on the CPU
                    ids = torch.tensor([seq.token_ids], dtype=torch.int64)
                    hashes, _ = hasher(ids, hasher.new_history(1), 0)
            h = engram_step(engram, h, hashes, None, st.num)
            ids = torch.tensor([seq.token_ids], dtype=torch.int64, device=h.device)
            ffn_in, pending = block.attention_part(h, pre, StepContext(0, st, input_ids=ids))
            runs.append((st, pending))
            ffn_inputs.append(ffn_in)
            group_ids.append(ids)
            del h, pre
        lengths = [x.shape[1] for x in ffn_inputs]
        # the token ids travel with the rows: V4's hash-routed layers pick experts by them
        y = block.moe(torch.cat(ffn_inputs, dim=1),
                      StepContext(0, runs[0][0], input_ids=torch.cat(group_ids, dim=1)))
        del ffn_inputs
        out = []
        for (st, pending), y_seq in zip(runs, torch.split(y, lengths, dim=1)):
            h, pre = block.ffn_part(y_seq, pending, st.num)
            out.append(_capture(st, h, pre))
        return out
    return step


def _head_stage(ck, panel: EncodedPanel, reader: StageReader, opts: RunOptions, stats: RunStats, bar,
                loaded) -> Record:
    cfg = ck.model_config
    bar.begin("head", 1 + cfg.n_layers)
    t = time.perf_counter()
    arch = arch_of(cfg)
    w, nbytes = _load_named(ck, arch.head_tensors, opts.device)
    head = arch.head(cfg).load(w)
    stats.read_s += time.perf_counter() - t
    if nbytes > stats.largest_stage_weight_bytes:
        stats.largest_stage_weight_bytes, stats.largest_stage_name = nbytes, "head"
    t = time.perf_counter()
    scores, ties = [], TieStats()
    for i, seq in enumerate(panel.sequences):
        st, h, pre = _restore(*reader.get(i), opts.precision, opts.device)
        logits = head_step(head, h, pre, st.num)[0]
        scores.append(sequence_scores(seq, logits, opts.top_k, opts.full_logprobs))
        for site, n in st.num.ties.counts.items():
            ties.add(site, n, st.num.ties.rows[site])
        bar.step()
    stats.head_s = time.perf_counter() - t
    del head, w
    loaded.update(ck.loaded_digests())
    ck.release_file_handles()
    stats.ties = {"total": ties.total, "counts": dict(sorted(ties.counts.items()))}
    return Record.from_sequences(_provenance(ck, panel, opts, loaded, stats.ties), scores, k=opts.top_k)


# ----------------------------------------------------------------------------------------------------------
# Identity and provenance


def _job_identity(ck: Checkpoint, panel: EncodedPanel, opts: RunOptions) -> dict:
    """What must be equal for a work dir to be continued: a different one would mix two computations."""
    return {"checkpoint_hash": checkpoint_identity(ck),
            "pack": str(ck.pack_dir) if ck.pack_dir else None, "panel_hash": panel.panel_hash,
            "sequences": sequences_hash(panel.sequences), "precision": opts.precision, "index_k": opts.index_k,
            "device": opts.device, "threads": opts.threads, "torch": torch.__version__}


def weights_read_hash(loaded: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(sorted(loaded.items())).encode()).hexdigest()


def _provenance(ck: Checkpoint, panel: EncodedPanel, opts: RunOptions, loaded: dict, ties: dict):
    n = opts.panel_sequences or len(panel.sequences)
    return oracle_provenance(
        panel, precision=opts.precision, vocab_size=int(ck.model_config.vocab_size),
        source={"oracle": "oracle.dsv41", "checkpoint": str(ck.dir.resolve()),
                "pack": str(ck.pack_dir.resolve()) if ck.pack_dir else None,
                # the build's identity (config, index, plan, every header): taken before any read, so equal
                # across resumed and sharded runs
                "checkpoint_hash": checkpoint_identity(ck),
                "weights_read_sha256": weights_read_hash(loaded), "tensors_read": len(loaded)},
        extra={"top_k": opts.top_k, "index_k": opts.index_k, "device": opts.device,
               "threads": opts.threads, "torch": torch.__version__,
               "log_softmax_dtype": "float64", "shard": list(opts.shard) if opts.shard else None,
               "panel_sequences": n,
               "seq_indices": list(opts.seq_indices) if opts.seq_indices is not None else list(range(n)),
               "ties": ties})


def checkpoint_identity(ck: Checkpoint) -> str:
    """The build's identity hash (config, index, plan, every header), whatever this object has read so far:
    equal across resumed, sharded and cluster runs of one build."""
    saved = ck._loaded, ck._rows_read
    ck._loaded, ck._rows_read = {}, {}
    try:
        return ck.provenance_hash()
    finally:
        ck._loaded, ck._rows_read = saved


# ----------------------------------------------------------------------------------------------------------
# Weights, one stage at a time


class _EngramRows:
    """Indexable by a LongTensor of rows: reads only those rows of a real-size Engram table."""

    def __init__(self, ck: Checkpoint, layer: int, device: str):
        self.ck, self.layer, self.device = ck, layer, device

    def __getitem__(self, rows: torch.Tensor) -> torch.Tensor:
        with torch.device("cpu"):  # the reader's index arithmetic is CPU tensors, whatever the compute device
            return self.ck.engram_rows(self.layer, rows.cpu()).to(self.device)


def _load_layer(ck: Checkpoint, L: int, device: str, buffers: OutputBuffers | None = None,
                precision: str = "fp32", stream_experts: bool = False) -> tuple[dict, int]:
    """Full-name fp32 weights of layer L on `device`, and their byte count (the stage's working set).
    On the CPU the routed experts (the bulk of a layer, kept fp32 for the whole stage: 54 GB on the release)
    are decoded into `buffers`, the previous layer's arrays; the rest mostly becomes float64 at once
    (_dot_only_weight). With `stream_experts` the experts are decoded one at a time as the MoE asks for them
    (StreamedExperts); the byte count is then the rest plus one expert."""
    prefix = f"layers.{L}."
    table = f"layers.{L}.engram.embed"
    spec = ck.inventory.tables.get(table)
    whole = spec is None or spec.rows * spec.width * 4 <= WHOLE_TABLE_BYTES
    w = {prefix + k: v.to(device) for k, v in ck.load_layer(L, tables=whole, experts=False).items()}
    n_experts = ck.model_config.moe_experts(L)[0]
    if stream_experts:
        w = StreamedExperts(w, ck, L, device)
        one = 3 * ck.model_config.dim * ck.model_config.moe_inter_dim * 4
        nbytes = sum(t.numel() * t.element_size() for t in w.values()) + (one if n_experts else 0)
    else:
        pool = buffers if device == "cpu" else None
        for e in range(n_experts):
            for k, v in ck.load_expert(L, e, pool).items():
                w[f"{prefix}ffn.experts.{e}.{k}.weight"] = v.to(device)
        nbytes = sum(t.numel() * t.element_size() for t in w.values())
    # only fp32 mode accumulates in float64; reference-bf16 runs the reference's fp32 / bf16 products
    for name in [n for n in w if precision == "fp32" and _dot_only_weight(n)]:
        w[name] = w[name].double()  # replaces the fp32 copy: see _dot_only_weight
    if not whole:
        w[table + ".weight"] = _EngramRows(ck, L, device)
    return w, nbytes


class StreamedExperts(dict):
    """A layer's weights whose routed experts are decoded when first asked for (`w[name]`, as `need` and
    MoE.expert_weights do), one expert at a time: asking for expert e drops the expert held before and
    decodes e into its fp32 arrays (reused once nothing else references them: moe.MoE keeps no weight past its
    product). The MoE visits each used expert once per call, in ascending order, so a stage decodes every
    expert once per MoE call; the values are the same exact decode, so the record is bit-identical (tested)."""

    _NAME = re.compile(r"layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight")

    def __init__(self, dense: dict, ck: Checkpoint, layer: int, device: str):
        super().__init__(dense)
        self.ck, self.layer, self.device = ck, layer, device
        self.pool = OutputBuffers()
        self.held: tuple[int, dict[str, torch.Tensor]] | None = None
        self.decoded = 0  # expert decodes so far

    def __missing__(self, name: str) -> torch.Tensor:
        m = self._NAME.fullmatch(name)
        if m is None or int(m.group(1)) != self.layer:
            raise KeyError(name)
        e = int(m.group(2))
        if not 0 <= e < self.ck.model_config.moe_experts(self.layer)[0]:
            raise KeyError(name)
        if self.held is None or self.held[0] != e:
            self.held = None
            self.pool.reclaim()  # the previous expert's arrays, now unreferenced, take the next one
            cpu = self.ck.load_expert(self.layer, e, self.pool if self.device == "cpu" else None)
            self.held = (e, {k: v.to(self.device) for k, v in cpu.items()})
            self.decoded += 1
        return self.held[1][m.group(3)]


def _dot_only_weight(name: str) -> bool:
    """The non-expert matrices of a layer, which the forward uses only as dot-product operands. The oracle
    accumulates every dot product in float64 (numerics.mm), which converts the weight on each call; held in
    float64 for the stage instead, they are converted once, not once per sequence (values unchanged, so the
    record is bit-identical). They are a few percent of a release layer, whose bulk (the routed experts)
    stays fp32 and is converted once per MoE group. The stage's fp32 working set (the memory bound) is
    counted before this conversion."""
    if ".experts." in name or ".engram.embed." in name or not name.endswith((".weight", "_fn")):
        return False
    return not name.endswith(("norm.weight", "q_weight", "k_weight"))


def _load_named(ck: Checkpoint, names: dict[str, str], device: str) -> tuple[dict, int]:
    """{name: 'linear'|'tensor'} -> fp32 weights."""
    w = {}
    for name, kind in names.items():
        t = ck.load_linear(name[:-len(".weight")]) if kind == "linear" else ck.load_tensor(name)
        w[name] = t.to(device)
    return w, sum(t.numel() * t.element_size() for t in w.values())


# ----------------------------------------------------------------------------------------------------------
# Sequence state <-> arrays


def _capture(st: ModelState, h: torch.Tensor, pre: torch.Tensor) -> tuple[dict[str, np.ndarray], dict]:
    arrays = {"h": h.cpu().numpy(), "pre": pre.cpu().numpy()}
    meta: dict[str, Any] = {"shared": {}, "ties": {"counts": st.num.ties.counts, "rows": st.num.ties.rows}}
    for f in dataclasses.fields(SharedRuntime):
        if f.name == "caches":
            continue
        v = getattr(st.shared, f.name)
        if isinstance(v, torch.Tensor):
            arrays[f"shared.{f.name}"] = v.cpu().numpy()
        elif v is None or isinstance(v, int):
            meta["shared"][f.name] = v
        else:
            raise TypeError(f"runner: SharedRuntime.{f.name} has type {type(v).__name__}, which it cannot store")
    for L, cache in st.shared.caches.items():
        for f in dataclasses.fields(cache):
            v = getattr(cache, f.name)
            if v is not None and f.name not in PREFILL_ONLY_CACHE_FIELDS:
                arrays[f"cache.{L}.{f.name}"] = v.cpu().numpy()
    return arrays, meta


def _restore(arrays: dict[str, np.ndarray], meta: dict, precision: str, device: str):
    t = {k: torch.from_numpy(v).to(device) for k, v in arrays.items()}
    st = ModelState(num=Numerics(precision, TieStats(dict(meta["ties"]["counts"]), dict(meta["ties"]["rows"]))),
                    batch=1)
    for name, v in meta["shared"].items():
        setattr(st.shared, name, v)
    for k, v in t.items():
        if k.startswith("shared."):
            setattr(st.shared, k[len("shared."):], v)
        elif k.startswith("cache."):
            _, L, name = k.split(".", 2)
            setattr(st.cache(int(L)), name, v)
    return st, t["h"], t["pre"]


# ----------------------------------------------------------------------------------------------------------
# The in-memory forward (the independent reference the streamed runner is tested against)


def full_weights(ck: Checkpoint) -> dict[str, torch.Tensor]:
    w = dict(ck.load_top(vision=ck.model_config.vision_n_layers > 0))
    for L in range(ck.model_config.n_layers):
        w.update({f"layers.{L}.{k}": v for k, v in ck.load_layer(L).items()})
    return w


def forward_in_memory(ck: Checkpoint, panel: EncodedPanel, precision: str = "fp32", top_k: int = TOP_K,
                      full_logprobs: bool = False, device: str = "cpu", threads: int = 0,
                      token_map: np.ndarray | None = None) -> tuple[list[SequenceScores], TieStats]:
    """Every sequence through `Model.forward` with all weights in memory (small checkpoints only)."""
    cfg = ck.model_config
    _check_ids(panel, cfg.vocab_size)
    if token_map is None:
        token_map = engram_token_map(ck)
    w = {k: v.to(device) for k, v in full_weights(ck).items()}
    out, ties = [], TieStats()
    with compute_context(device, threads):
        model = Model(cfg, w, token_map, precision=precision, with_mtp=False)
        if device != "cpu":  # the hasher's tables stay on the CPU, as in the runner
            model.hasher = _CpuHasher(model.hasher) if model.hasher else None
        for seq in panel.sequences:
            st = model.new_state(1)
            logits = model.forward(torch.tensor([seq.token_ids], dtype=torch.int64), st).logits[0]
            out.append(sequence_scores(seq, logits, top_k, full_logprobs))
            for site, n in st.num.ties.counts.items():
                ties.add(site, n, st.num.ties.rows[site])
    return out, ties


class _CpuHasher:
    def __init__(self, hasher: NgramHasher):
        self.h = hasher

    def new_history(self, b):
        with torch.device("cpu"):
            return self.h.new_history(b)

    def __call__(self, ids, history, start_pos, mask=None):
        dev = ids.device
        with torch.device("cpu"):
            hashes, hist = self.h(ids.cpu(), history.cpu(), start_pos, None if mask is None else mask.cpu())
        return hashes.to(dev), hist
