"""The layer-streamed panel runner: score a whole panel with the DeepSeek-V4.1 oracle while holding one
layer's weights at a time.

    ck = Checkpoint(ckpt_dir, pack_dir)
    panel = panel_from_json("ids.json")            # or encode_named_panel("default", tokenizer)
    rec = run_panel(ck, panel, work_dir, RunOptions(precision="fp32"))   # -> core.records.Record

Order of work (why: every weight is read once per panel, and memory is one layer + the activations):

    stage 0        embed.weight                  -> per sequence: h = 4 copies of the embedding, pre = e0
    stage L + 1    layers.L (+ its Engram)       -> per sequence: Engram, Block(L) attention part; then one
                                                    MoE call over a group of sequences' FFN inputs (each
                                                    expert used once per group, not once per sequence)
    head           norm.weight, head.weight      -> per sequence: logits -> top-K / logsumexp -> Record

Between stages every sequence's *state* (h [s, hc, d], pre [s, hc], and the attention state later layers
read: compressed KV, index keys, published top-k indices and candidate masks, owner pointers, tie counts)
is a StageWriter entry (oracle/dsv41/spill.py), held in RAM or spilled to disk. Each stage is committed
atomically (activation file, then manifest, both temp + fsync + os.replace), so a run killed at any point
continues from the last finished stage and produces the same bytes as an uninterrupted run.

The work per sequence is exactly `Model.forward` for a one-pass prefill (§7, §17.1), split at layer
boundaries; the window KV and the ratio-2 carry are dropped after their layer (a prefill never reads them
again), which is what keeps the activations small.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import gc
import hashlib
import json
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from core.records import Provenance, Record, SequenceScores
from core.version import code_version

from .attention import LayerCache, SharedRuntime
from .checkpoint import Checkpoint, OutputBuffers
from .engram import Engram, EngramLayout, NgramHasher, compressed_token_map, tiny_token_map
from .formats import warm_up_decoders
from .head import Embedding, Head
from .hyper import hc_pre
from .model import Block, Model, ModelState, StepContext
from .numerics import PRECISION_MODES, Numerics, TieStats
from .spill import StageReader, StageWriter, fsync_dir
from .tiny import is_tiny_checkpoint

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "ds41-runner/1"
TOP_K = 256
# Engram tables up to this many fp32 bytes are loaded whole (tiny checkpoints); larger ones (the release's
# ~98 GB tables) are read row by row through Checkpoint.engram_rows.
WHOLE_TABLE_BYTES = 1 << 30
# LayerCache fields only the owning layer reads, and only in decode: dropped after the layer (prefill only)
PREFILL_ONLY_CACHE_FIELDS = ("window_kv", "carry_kv", "carry_score", "ring")
# Sequences share one MoE call while their pending fp32 state (FFN input and output, the residual stream
# and the mHC mixes) stays under this many bytes; a longer sequence goes alone.
MOE_GROUP_BYTES = 1 << 27
KILL_ENV = "DS41_RUNNER_KILL"  # test hook: "point@stage[,point@stage...]" -> SIGKILL at that point


class RunnerError(RuntimeError):
    """The runner cannot start or continue; the message says what to change."""


# ----------------------------------------------------------------------------------------------------------
# Inputs


@dataclass(frozen=True)
class PanelSequence:
    seq_id: str
    domain: str
    token_ids: tuple[int, ...]
    scored_mask: tuple[bool, ...]


@dataclass(frozen=True)
class PanelInput:
    """An encoded panel (token ids + scored masks) with the identity a record needs."""

    panel_name: str
    panel_version: str
    panel_hash: str
    tokenizer_hash: str
    sequences: tuple[PanelSequence, ...]
    tokenizer: Any = None  # panels.PanelTokenizer when the panel was encoded here (gives the Engram token map)

    def select_shard(self, index: int, count: int) -> tuple["PanelInput", list[int]]:
        """Machine `index` of `count` takes every count-th sequence, starting at `index`."""
        if not (count >= 1 and 0 <= index < count):
            raise RunnerError(f"shard {index}/{count}: need 0 <= I < N")
        picked = list(range(index, len(self.sequences), count))
        if not picked:
            raise RunnerError(f"shard {index}/{count}: the panel has only {len(self.sequences)} sequences")
        return dataclasses.replace(self, sequences=tuple(self.sequences[i] for i in picked)), picked


def _sequence(seq_id, domain, ids, mask, where: str) -> PanelSequence:
    ids = tuple(int(t) for t in ids)
    mask = tuple(bool(m) for m in mask) if mask is not None else (False,) + (True,) * (len(ids) - 1)
    if not ids:
        raise RunnerError(f"{where}: sequence {seq_id!r} has no tokens")
    if len(mask) != len(ids):
        raise RunnerError(f"{where}: sequence {seq_id!r} has {len(ids)} ids but {len(mask)} mask entries")
    if mask[0]:
        raise RunnerError(f"{where}: sequence {seq_id!r} scores position 0, which has no distribution")
    return PanelSequence(str(seq_id), str(domain), ids, mask)


def _ids_hash(seqs: Sequence[PanelSequence]) -> str:
    body = [[s.seq_id, s.domain, list(s.token_ids), [int(m) for m in s.scored_mask]] for s in seqs]
    return "sha256:" + hashlib.sha256(json.dumps(body, separators=(",", ":")).encode()).hexdigest()


def panel_from_json(path: str | os.PathLike) -> PanelInput:
    """A pre-encoded panel: a JSON list of token-id lists, or {"panel_name", "panel_version", "panel_hash",
    "tokenizer_hash", "sequences": [{"seq_id", "domain", "token_ids", "scored_mask"?}]} (all but sequences
    optional). Unscored masks default to every position after the first."""
    p = Path(path)
    try:
        obj = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise RunnerError(f"{p}: not a readable JSON panel ({e})") from e
    if isinstance(obj, list):
        obj = {"sequences": obj}
    if not isinstance(obj, dict) or not isinstance(obj.get("sequences"), list) or not obj["sequences"]:
        raise RunnerError(f"{p}: expected a non-empty list of token-id lists or an object with 'sequences'")
    seqs = []
    for i, s in enumerate(obj["sequences"]):
        if isinstance(s, list):
            s = {"token_ids": s}
        if not isinstance(s, dict) or not isinstance(s.get("token_ids"), list) \
                or not all(isinstance(t, int) for t in s["token_ids"]):
            raise RunnerError(f"{p}: sequence {i} is not a list of integer token ids")
        seqs.append(_sequence(s.get("seq_id", f"s{i:05d}"), s.get("domain", "pre-encoded"), s["token_ids"],
                              s.get("scored_mask"), str(p)))
    if len({s.seq_id for s in seqs}) != len(seqs):
        raise RunnerError(f"{p}: duplicate seq_id")
    return PanelInput(str(obj.get("panel_name", p.stem)), str(obj.get("panel_version", "0")),
                      str(obj.get("panel_hash") or _ids_hash(seqs)), str(obj.get("tokenizer_hash", "pre-encoded")),
                      tuple(seqs))


def panel_from_record(path: str | os.PathLike) -> PanelInput:
    """The sequences (ids, scored masks, ids and domains) and panel identity of an existing record."""
    rec = Record.load(path)
    seqs = tuple(_sequence(sid, dom, rec.sequence_tokens(i), rec.scored[rec.seq_offsets[i]:rec.seq_offsets[i + 1]],
                           str(path)) for i, (sid, dom) in enumerate(zip(rec.seq_ids, rec.domains)))
    pv = rec.provenance
    return PanelInput(pv.panel_name, pv.panel_version, pv.panel_hash, pv.tokenizer_hash, seqs)


def encode_named_panel(name: str, tokenizer) -> PanelInput:
    """A published panel (NAME, NAME@VERSION or a manifest path) encoded with `tokenizer` (a spec for
    panels.load_tokenizer: 'deepseek', a checkpoint/tokenizer dir, a tokenizer.json)."""
    import panels

    tok = tokenizer if isinstance(tokenizer, panels.PanelTokenizer) else panels.load_tokenizer(tokenizer)
    enc = panels.encode_panel(panels.load_panel(name), tok)
    seqs = tuple(_sequence(s.seq_id, s.domain, s.token_ids, s.scored_mask, name) for s in enc.sequences)
    return PanelInput(enc.panel_name, str(enc.panel_version), enc.panel_hash, enc.tokenizer_hash, seqs, tok)


def load_panel_input(spec: str, tokenizer=None) -> PanelInput:
    """`spec`: a *.json pre-encoded panel, a *.safetensors record, or a panel name (encoded with `tokenizer`)."""
    if spec.endswith(".json") and not spec.endswith(".manifest.json"):
        return panel_from_json(spec)
    if spec.endswith(".safetensors"):
        return panel_from_record(spec)
    if tokenizer is None:
        raise RunnerError(f"panel {spec!r} must be encoded, but no tokenizer was given")
    return encode_named_panel(spec, tokenizer)


def engram_token_map(ck: Checkpoint, panel: PanelInput) -> np.ndarray | None:
    """The §8.2 compressed token map: the stub map for generated tiny checkpoints, else built from the
    tokenizer the panel was encoded with."""
    cfg = ck.model_config
    if not cfg.engram_layer_ids:
        return None
    if is_tiny_checkpoint(ck.dir):
        return tiny_token_map(cfg.vocab_size)
    if panel.tokenizer is None:
        raise RunnerError("the checkpoint has Engram layers: its compressed token map needs the tokenizer; "
                          "encode the panel with --tokenizer instead of passing pre-encoded ids")
    return compressed_token_map(panel.tokenizer.tokenizer)


# ----------------------------------------------------------------------------------------------------------
# Options, determinism, fault hook


@dataclass(frozen=True)
class RunOptions:
    precision: str = "fp32"
    device: str = "cpu"
    threads: int = 0  # 0: torch's default
    spill: str = "auto"  # "auto" | "ram" | "disk"
    ram_budget: int = 0  # bytes of activations kept in RAM under "auto"; 0: a quarter of MemAvailable
    top_k: int = TOP_K
    full_logprobs: bool = False
    index_k: str = "upstream"  # prefill-only scoring is identical for both switches (§18.1)
    progress: bool = True
    keep_work: bool = False
    restart: bool = False
    shard: tuple[int, int] | None = None  # (I, N), recorded in the provenance
    seq_indices: tuple[int, ...] | None = None  # panel indices of the sequences (sharding)
    panel_sequences: int | None = None  # sequences in the whole panel (sharding)

    def __post_init__(self):
        if self.precision not in PRECISION_MODES:
            raise RunnerError(f"precision {self.precision!r}: expected one of {PRECISION_MODES}")
        if self.spill not in ("auto", "ram", "disk"):
            raise RunnerError(f"spill {self.spill!r}: expected auto, ram or disk")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise RunnerError(f"device {self.device!r}: expected cpu or cuda[:N]")


@contextlib.contextmanager
def compute_context(device: str, threads: int) -> Iterator[None]:
    """A fixed thread count; on CUDA deterministic algorithms, TF32 off and cuBLAS's fixed-workspace mode (the
    env var must be set before the first cuBLAS call, so the CLI sets it at start too). On the CPU every op
    the oracle uses is deterministic already (repeated and resumed runs are tested bit-identical), and
    torch.use_deterministic_algorithms costs ~2 s of torch._inductor imports per process, so it is CUDA-only."""
    prev = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled())
    cuda = device.startswith("cuda")
    if threads:
        torch.set_num_threads(threads)
    if cuda:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        if not torch.cuda.is_available():
            raise RunnerError(f"device {device!r}: this torch build sees no CUDA device")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.use_deterministic_algorithms(True)
    try:
        with torch.device(device), torch.inference_mode():
            yield
    finally:
        torch.set_num_threads(prev[0])
        if cuda:
            torch.use_deterministic_algorithms(prev[1])


def _fault(point: str, stage: int) -> None:
    """SIGKILL ourselves at a named point when the test hook asks for it (no clean-up can run: like a crash)."""
    spec = os.environ.get(KILL_ENV)
    if spec and f"{point}@{stage}" in spec.split(","):
        os.kill(os.getpid(), signal.SIGKILL)


class _Readahead:
    """While a stage computes, a thread reads the next stage's stored bytes once into the page cache, so
    the disk time hides behind the compute (measured: a cold 256 MB shard read 0.11-0.45 s, warm 0.02 s).
    It holds one small buffer (RSS unchanged; the page cache is the kernel's). Advisory only: the load
    itself reads, checks and reports every byte, so a failure here changes nothing but the timing."""

    def __init__(self):
        self._thread: threading.Thread | None = None

    def start(self, ck: Checkpoint, prefixes: list[str]) -> None:
        self.wait()
        ranges = [r for p in prefixes for r in ck.byte_ranges(p)]
        self._thread = threading.Thread(target=self._read, args=(ranges,), name="ds41-readahead", daemon=True)
        self._thread.start()

    @staticmethod
    def _read(ranges: list[tuple[Path, int, int]]) -> None:
        buf = memoryview(bytearray(1 << 22))
        try:
            for path, begin, end in ranges:
                with open(path, "rb", buffering=0) as f:
                    f.seek(begin)
                    while begin < end and (n := f.readinto(buf[:min(end - begin, len(buf))])):
                        begin += n
        except OSError:
            return

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None


class _Malloc:
    """glibc knobs for a process that frees a whole layer at a time.

    The mmap threshold is fixed at 32 MiB (glibc's own ceiling) and the trim threshold at 256 MiB. Below
    32 MiB sit the forward's per-call temporaries (float64 copies of activations, QDQ scratch, expert
    rows), which then reuse heap pages instead of faulting in fresh zeroed ones on every call: measured on
    the 3,952-token panel of the > RAM benchmark, a 256 KiB threshold spent 2 min 50 s of system time in a
    3 min 27 s run, 32 MiB 20 s in 1 min 46 s. The routed experts, the bulk of a layer, live in the
    runner's OutputBuffers and are reused explicitly; what else the heap keeps after a stage, malloc_trim
    returns. Peak RSS stays inside the 1.5 x (layer + activations) bound on that run (1.79 of 2.13 GB)."""

    M_TRIM_THRESHOLD = -1
    M_MMAP_THRESHOLD = -3

    def __init__(self):
        import ctypes
        import ctypes.util

        try:
            self.libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            self.libc.mallopt(self.M_MMAP_THRESHOLD, 32 << 20)
            self.libc.mallopt(self.M_TRIM_THRESHOLD, 256 << 20)
        except (OSError, AttributeError):  # not glibc: nothing to tune
            self.libc = None

    def trim(self) -> None:
        if self.libc is not None:
            self.libc.malloc_trim(0)


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak_rss() -> None:
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


# ----------------------------------------------------------------------------------------------------------
# Weights, one stage at a time


def _release_file_handles(ck: Checkpoint) -> None:
    # The loader keeps a safe_open (an mmap of the whole shard) per file it has read; mapped pages count
    # toward RSS, so after a stage we drop them. (Checkpoint has no public close(); requested in the report.)
    for folder in (getattr(ck, "_official", None), getattr(ck, "_pack", None)):
        if folder is not None and hasattr(folder, "_handles"):
            folder._handles.clear()


class _EngramRows:
    """Indexable by a LongTensor of rows: reads only those rows of a real-size Engram table."""

    def __init__(self, ck: Checkpoint, layer: int, device: str):
        self.ck, self.layer, self.device = ck, layer, device

    def __getitem__(self, rows: torch.Tensor) -> torch.Tensor:
        return self.ck.engram_rows(self.layer, rows.cpu()).to(self.device)


def _load_layer(ck: Checkpoint, L: int, device: str, buffers: OutputBuffers | None = None,
                precision: str = "fp32") -> tuple[dict, int]:
    """Full-name fp32 weights of layer L on `device`, and their byte count (the stage's working set).
    On the CPU the routed experts (the bulk of a layer, kept fp32 for the whole stage) are decoded into
    `buffers`, the previous layer's arrays; the rest mostly becomes float64 at once (_dot_only_weight)."""
    prefix = f"layers.{L}."
    table = f"layers.{L}.engram.embed"
    spec = ck.inventory.tables.get(table)
    whole = spec is None or spec.rows * spec.width * 4 <= WHOLE_TABLE_BYTES
    w = {prefix + k: v.to(device) for k, v in ck.load_layer(L, tables=whole, experts=False).items()}
    pool = buffers if device == "cpu" else None
    for e in range(ck.model_config.moe_experts(L)[0]):
        for k, v in ck.load_expert(L, e, pool).items():
            w[f"{prefix}ffn.experts.{e}.{k}.weight"] = v.to(device)
    nbytes = sum(t.numel() * t.element_size() for t in w.values())
    # only fp32 mode accumulates in float64; reference-bf16 runs the reference's fp32 / bf16 products
    for name in [n for n in w if precision == "fp32" and _dot_only_weight(n)]:
        w[name] = w[name].double()  # replaces the fp32 copy: see _dot_only_weight
    if not whole:
        w[table + ".weight"] = _EngramRows(ck, L, device)
    return w, nbytes


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
        for f in dataclasses.fields(LayerCache):
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
# Scoring (shared by the streamed runner and the in-memory forward)


def sequence_scores(seq: PanelSequence, logits: torch.Tensor, top_k: int, full: bool) -> SequenceScores:
    """logits [s, V] fp32 of one sequence -> its record rows (logits[p-1] predicts token p)."""
    from oracle.hf import stats_from_logits

    ids = np.asarray(seq.token_ids, dtype=np.int64)
    mask = np.asarray(seq.scored_mask, dtype=bool)
    pos = np.flatnonzero(mask)
    rows = logits[torch.from_numpy(pos - 1).to(logits.device)].cpu()
    st = stats_from_logits(rows, ids[pos], top_k, full)
    return SequenceScores(seq.seq_id, seq.domain, ids, mask, st.topk_ids, st.topk_logprobs, st.actual_logprob,
                          st.actual_rank, logsumexp=st.logsumexp, full_logprobs=st.full_logprobs)


def _check_ids(panel: PanelInput, vocab: int) -> None:
    for s in panel.sequences:
        bad = [t for t in s.token_ids if not 0 <= t < vocab]
        if bad:
            raise RunnerError(f"sequence {s.seq_id!r}: token id {bad[0]} is outside the checkpoint's vocabulary "
                              f"0..{vocab - 1} (was the panel encoded with another tokenizer?)")


# ----------------------------------------------------------------------------------------------------------
# The streamed run


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


class _Progress:
    def __init__(self, enabled: bool, n_stages: int, n_seq: int):
        self.p = None
        if enabled:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)

            self.p = Progress(TextColumn("{task.description:>12}"), BarColumn(), MofNCompleteColumn(),
                              TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                              console=Console(stderr=True), transient=False)
            self.p.start()
            self.total = self.p.add_task("panel", total=n_stages)
            self.stage = self.p.add_task("", total=n_seq)

    def begin(self, name: str, done_stages: int) -> None:
        if self.p:
            self.p.update(self.total, completed=done_stages)
            self.p.reset(self.stage, description=name)

    def step(self) -> None:
        if self.p:
            self.p.advance(self.stage)

    def close(self) -> None:
        if self.p:
            self.p.update(self.total, completed=self.p.tasks[0].total)
            self.p.stop()


def _job_identity(ck: Checkpoint, panel: PanelInput, opts: RunOptions, threads: int) -> dict:
    """What must be equal for a work dir to be continued: a different one would mix two computations."""
    return {"checkpoint_hash": _identity_hash(ck),
            "pack": str(ck.pack_dir) if ck.pack_dir else None, "panel_hash": panel.panel_hash,
            "sequences": _ids_hash(panel.sequences), "precision": opts.precision, "index_k": opts.index_k,
            "device": opts.device, "threads": threads, "torch": torch.__version__}


def _atomic_json(obj, path: Path, hook=lambda point: None) -> None:
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "w") as f:
        json.dump(obj, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    hook("manifest-written")
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _spill_decision(opts: RunOptions, ck: Checkpoint, panel: PanelInput) -> bool:
    if opts.spill != "auto":
        return opts.spill == "disk"
    c = ck.model_config
    per_token = c.hc_mult * c.dim * 4 + c.hc_mult * 4 + c.index_topk * 8 + (c.head_dim + c.index_head_dim) * 4 * 2
    est = sum(len(s.token_ids) * (per_token + len(s.token_ids)) for s in panel.sequences)  # + candidate masks
    budget = opts.ram_budget or _status_meminfo_kib("MemAvailable") * 1024 // 4
    return est > budget


def _status_meminfo_kib(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def run_panel(ck: Checkpoint, panel: PanelInput, work: str | os.PathLike, opts: RunOptions = RunOptions(),
              token_map: np.ndarray | None = None) -> Record:
    """Score `panel` layer by layer; resumable through `work` (see the module docstring)."""
    t_start = time.perf_counter()
    cfg = ck.model_config
    _check_ids(panel, cfg.vocab_size)
    if token_map is None:
        token_map = engram_token_map(ck, panel)
    hasher = NgramHasher(cfg, EngramLayout.build(cfg), token_map) if cfg.engram_layer_ids else None
    threads = opts.threads or torch.get_num_threads()
    opts = dataclasses.replace(opts, threads=threads)
    identity = _job_identity(ck, panel, opts, threads)
    job = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    lock = open(work / "lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RunnerError(f"{work}: another run holds this work dir") from None
    try:
        return _run_locked(ck, panel, work, opts, hasher, identity, job, threads, t_start)
    finally:
        lock.close()


def _run_locked(ck, panel, work: Path, opts: RunOptions, hasher, identity, job, threads, t_start) -> Record:
    cfg = ck.model_config
    n_stages = 1 + cfg.n_layers  # embed + layers; the head writes the record
    seqs = panel.sequences
    stats = RunStats(stages=n_stages + 1, spill=_spill_decision(opts, ck, panel),
                     tokens=sum(len(s.token_ids) for s in seqs))
    for p in work.glob("*.partial"):  # a crash inside a write: the manifest never named these
        p.unlink()
    mpath = work / MANIFEST
    manifest = None
    if mpath.exists() and opts.restart:
        mpath.unlink()
    if mpath.exists():
        try:
            manifest = json.loads(mpath.read_text())
        except json.JSONDecodeError as e:
            raise RunnerError(f"{mpath}: unreadable manifest ({e}); rerun with --restart to start over") from e
        if manifest.get("format") != MANIFEST_FORMAT or manifest.get("job") != job:
            diff = sorted(k for k in identity if manifest.get("identity", {}).get(k) != identity[k])
            raise RunnerError(f"{work}: the work dir belongs to another run (differs in {diff}); use another --work "
                              f"or --restart")
    loaded: dict[str, str] = {}
    reader: StageReader | None = None
    start = 0
    if manifest is not None:
        start = manifest["stages_done"]
        loaded = dict(manifest["loaded"])
        for k in ("read_s", "compute_s", "io_s"):
            setattr(stats, k, manifest["timing"][k])
        stats.largest_stage_weight_bytes = manifest["largest_stage_weight_bytes"]
        stats.largest_stage_name = manifest["largest_stage_name"]
        stats.activation_bytes = manifest["activation_bytes"]
        reader = StageReader.open_verified(work / manifest["acts"], manifest["table"], manifest["acts_sha256"])
    stats.resumed_from_stage = start
    for p in work.glob("acts-*.bin"):  # files of stages the manifest does not name: uncommitted, recomputed
        if manifest is None or p.name != manifest["acts"]:
            p.unlink()
    warm_up_decoders()  # JIT code is a per-process constant: loaded before the baseline
    malloc = _Malloc()
    buffers = OutputBuffers()
    readahead = _Readahead()
    malloc.trim()
    stats.baseline_rss_kib = _status_kib("VmRSS")
    _reset_peak_rss()
    bar = _Progress(opts.progress, n_stages + 1, len(seqs))
    # reference-bf16 reproduces the reference's per-sequence calls, whose fp32 ops depend on the row count
    groups = moe_groups(seqs, cfg) if opts.precision == "fp32" else [[i] for i in range(len(seqs))]
    try:
        with compute_context(opts.device, threads):
            for stage in range(start, n_stages):
                name = "embed" if stage == 0 else f"layer {stage - 1}"
                bar.begin(name, stage)
                writer = StageWriter(work / f"acts-{stage:03d}.bin", spill=stats.spill)
                t = time.perf_counter()
                if stage == 0:
                    w, nbytes = _load_named(ck, {"embed.weight": "tensor"}, opts.device)
                    step = _embed_step(Embedding(cfg).load(w), cfg.hc_mult, opts)
                else:
                    L = stage - 1
                    w, nbytes = _load_layer(ck, L, opts.device, buffers, opts.precision)
                    step = _layer_step(Block(cfg, L, opts.index_k).load(w),
                                       Engram(cfg, L).load(w) if L in cfg.engram_layer_ids else None, hasher, opts)
                _release_file_handles(ck)  # the shards' mapped pages are not needed once decoded
                stats.read_s += time.perf_counter() - t
                readahead.start(ck, ["head", "norm.weight"] if stage + 1 == n_stages else [f"layers.{stage}"])
                if nbytes > stats.largest_stage_weight_bytes:
                    stats.largest_stage_weight_bytes, stats.largest_stage_name = nbytes, name
                for group in groups:
                    t = time.perf_counter()
                    states = [reader.get(i) if reader is not None else None for i in group]
                    t2 = time.perf_counter()
                    outputs = step([seqs[i] for i in group], states)
                    t3 = time.perf_counter()
                    del states
                    for i, (arrays, meta) in zip(group, outputs):
                        writer.put(arrays, meta)
                        bar.step()
                        if i == 0:
                            _fault("seq", stage)
                    del outputs, arrays
                    stats.io_s += (t2 - t) + (time.perf_counter() - t3)
                    stats.compute_s += t3 - t2
                del step, w  # the stage's weights go before the next stage loads its own
                t = time.perf_counter()
                sha = writer.commit(lambda point, s=stage: _fault(point, s))
                loaded.update(ck.loaded_digests())
                stats.activation_bytes = max(stats.activation_bytes, writer.offset)
                _atomic_json({"format": MANIFEST_FORMAT, "job": job, "identity": identity, "stages_done": stage + 1,
                              "stage_name": name, "acts": writer.path.name, "acts_sha256": sha,
                              "acts_bytes": writer.offset, "table": writer.table, "loaded": loaded,
                              "timing": {k: getattr(stats, k) for k in ("read_s", "compute_s", "io_s")},
                              "largest_stage_weight_bytes": stats.largest_stage_weight_bytes,
                              "largest_stage_name": stats.largest_stage_name,
                              "activation_bytes": stats.activation_bytes},
                             mpath, lambda point, s=stage: _fault(point, s))
                _fault("committed", stage)
                if reader is not None:
                    reader.close()
                    if reader.path != writer.path:
                        reader.path.unlink(missing_ok=True)  # the new stage is durable: the old one is garbage
                reader = writer.reader()
                del writer
                stats.io_s += time.perf_counter() - t
                _release_file_handles(ck)
                if buffers.in_use():  # a reference cycle still holds this stage's weights: collect it
                    gc.collect()  # (a full collection costs 0.1-0.4 s with torch loaded, so only then)
                buffers.reclaim()  # the stage's arrays nothing references any more serve the next stage
                malloc.trim()
            record = _head_stage(ck, panel, reader, opts, stats, bar, loaded)
    finally:
        readahead.wait()
        bar.close()
    reader.close()
    stats.peak_rss_kib = _status_kib("VmHWM")
    stats.total_s = time.perf_counter() - t_start
    record.provenance.extra["run"] = dataclasses.asdict(stats)
    return record


def run_to_file(ck: Checkpoint, panel: PanelInput, out: str | os.PathLike, work: str | os.PathLike | None = None,
                opts: RunOptions = RunOptions(), token_map: np.ndarray | None = None) -> Record:
    """`run_panel`, then write the record atomically and (unless keep_work) delete the work dir."""
    out = Path(out)
    work = Path(work) if work is not None else out.with_name(out.name + ".work")
    rec = run_panel(ck, panel, work, opts, token_map)
    rec.save(out)
    if not opts.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    return rec


def moe_groups(seqs: Sequence[PanelSequence], cfg, limit_bytes: int = MOE_GROUP_BYTES) -> list[list[int]]:
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


def _embed_step(embed: Embedding, hc: int, opts: RunOptions):
    def step(group: list[PanelSequence], _states):
        out = []
        for seq in group:
            ids = torch.tensor([seq.token_ids], dtype=torch.int64)
            h = embed(ids).unsqueeze(2).repeat(1, 1, hc, 1)  # 4 identical copies (§7)
            pre = torch.zeros(1, len(seq.token_ids), hc)
            pre[..., 0] = 1.0  # one-hot on copy 0
            out.append(_capture(ModelState(num=Numerics(opts.precision), batch=1), h, pre))
        return out
    return step


def _layer_step(block: Block, engram: Engram | None, hasher: NgramHasher | None, opts: RunOptions):
    """Block(L) over a group of sequences: the attention part per sequence, then ONE MoE call over the
    concatenated FFN inputs (the MoE is per token and every op is row-independent, so this is bit-identical
    to a call per sequence; tested against the in-memory forward). The router's tie counts of the group
    are credited to its first sequence: the run's totals are exact."""
    def step(group: list[PanelSequence], states):
        runs, ffn_inputs = [], []
        for seq, state in zip(group, states):
            st, h, pre = _restore(*state, opts.precision, opts.device)
            if engram is not None:
                with torch.device("cpu"):  # the hasher's tables live on the CPU
                    ids = torch.tensor([seq.token_ids], dtype=torch.int64)
                    hashes, _ = hasher(ids, hasher.new_history(1), 0)
                h = engram(h, hashes[:, :, engram.index].to(opts.device), None, st.num)
            ffn_in, pending = block.attention_part(h, pre, StepContext(0, st))
            runs.append((st, pending))
            ffn_inputs.append(ffn_in)
            del h, pre
        lengths = [x.shape[1] for x in ffn_inputs]
        y = block.ffn(torch.cat(ffn_inputs, dim=1), None, runs[0][0].num)
        del ffn_inputs
        out = []
        for (st, pending), y_seq in zip(runs, torch.split(y, lengths, dim=1)):
            h, pre = block.ffn_part(y_seq, pending, st.num)
            out.append(_capture(st, h, pre))
        return out
    return step


def _head_stage(ck, panel: PanelInput, reader: StageReader, opts: RunOptions, stats: RunStats, bar, loaded) -> Record:
    cfg = ck.model_config
    bar.begin("head", 1 + cfg.n_layers)
    t = time.perf_counter()
    w, nbytes = _load_named(ck, {"norm.weight": "tensor", "head.weight": "linear"}, opts.device)
    head = Head(cfg).load(w)
    stats.read_s += time.perf_counter() - t
    if nbytes > stats.largest_stage_weight_bytes:
        stats.largest_stage_weight_bytes, stats.largest_stage_name = nbytes, "head"
    t = time.perf_counter()
    scores, ties = [], TieStats()
    for i, seq in enumerate(panel.sequences):
        st, h, pre = _restore(*reader.get(i), opts.precision, opts.device)
        logits = head(hc_pre(h, pre, st.num), st.num)[0]
        scores.append(sequence_scores(seq, logits, opts.top_k, opts.full_logprobs))
        for site, n in st.num.ties.counts.items():
            ties.add(site, n, st.num.ties.rows[site])
        bar.step()
    stats.head_s = time.perf_counter() - t
    del head, w
    loaded.update(ck.loaded_digests())
    _release_file_handles(ck)
    stats.ties = {"total": ties.total, "counts": dict(sorted(ties.counts.items()))}
    return Record.from_sequences(_provenance(ck, panel, opts, loaded, stats.ties), scores, k=opts.top_k)


def weights_read_hash(loaded: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(sorted(loaded.items())).encode()).hexdigest()


def _provenance(ck: Checkpoint, panel: PanelInput, opts: RunOptions, loaded: dict, ties: dict) -> Provenance:
    n = opts.panel_sequences or len(panel.sequences)
    return Provenance(
        side="oracle", panel_name=panel.panel_name, panel_version=panel.panel_version, panel_hash=panel.panel_hash,
        tokenizer_hash=panel.tokenizer_hash,
        source={"oracle": "oracle.dsv41", "checkpoint": str(ck.dir.resolve()),
                "pack": str(ck.pack_dir.resolve()) if ck.pack_dir else None,
                # the build's identity (config, index, plan, every header): taken before any read, so equal
                # across resumed and sharded runs
                "checkpoint_hash": _identity_hash(ck),
                "weights_read_sha256": weights_read_hash(loaded), "tensors_read": len(loaded)},
        precision=opts.precision, code_version=code_version(), created=Provenance.now(),
        extra={"top_k": opts.top_k, "index_k": opts.index_k, "device": opts.device,
               "threads": opts.threads, "torch": torch.__version__,
               "log_softmax_dtype": "float64", "shard": list(opts.shard) if opts.shard else None,
               "panel_sequences": n,
               "seq_indices": list(opts.seq_indices) if opts.seq_indices is not None else list(range(n)),
               "ties": ties})


def _identity_hash(ck: Checkpoint) -> str:
    saved = ck._loaded, ck._rows_read
    ck._loaded, ck._rows_read = {}, {}
    try:
        return ck.provenance_hash()
    finally:
        ck._loaded, ck._rows_read = saved


# ----------------------------------------------------------------------------------------------------------
# The in-memory forward (the independent reference the streamed runner is tested against)


def full_weights(ck: Checkpoint) -> dict[str, torch.Tensor]:
    w = dict(ck.load_top())
    for L in range(ck.model_config.n_layers):
        w.update({f"layers.{L}.{k}": v for k, v in ck.load_layer(L).items()})
    return w


def forward_in_memory(ck: Checkpoint, panel: PanelInput, precision: str = "fp32", top_k: int = TOP_K,
                      full_logprobs: bool = False, device: str = "cpu", threads: int = 0,
                      token_map: np.ndarray | None = None) -> tuple[list[SequenceScores], TieStats]:
    """Every sequence through `Model.forward` with all weights in memory (small checkpoints only)."""
    cfg = ck.model_config
    _check_ids(panel, cfg.vocab_size)
    if token_map is None:
        token_map = engram_token_map(ck, panel)
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


# ----------------------------------------------------------------------------------------------------------
# Shards


class MergeError(RunnerError):
    """Shards that do not form one panel run."""


def _record_sequences(rec: Record) -> list[SequenceScores]:
    out = []
    starts = np.searchsorted(rec.pos_seq, np.arange(rec.n_sequences + 1))
    for i, (sid, dom) in enumerate(zip(rec.seq_ids, rec.domains)):
        a, b = int(starts[i]), int(starts[i + 1])
        lo, hi = int(rec.seq_offsets[i]), int(rec.seq_offsets[i + 1])
        opt = lambda arr: None if arr is None else arr[a:b]  # noqa: E731
        out.append(SequenceScores(sid, dom, rec.token_ids[lo:hi], rec.scored[lo:hi], rec.topk_ids[a:b],
                                  rec.topk_logprobs[a:b], rec.actual_logprob[a:b], rec.actual_rank[a:b],
                                  logsumexp=opt(rec.logsumexp), full_logprobs=opt(rec.full_logprobs),
                                  ambiguous=opt(rec.ambiguous)))
    return out


def merge_records(paths: Sequence[str | os.PathLike]) -> Record:
    """Join `--shard I/N` records into the record an unsharded run writes (same arrays, same order)."""
    if not paths:
        raise MergeError("merge: no shard records given")
    recs = [(Path(p), Record.load(p)) for p in paths]
    p0, r0 = recs[0]
    a = r0.provenance
    same = ("side", "panel_name", "panel_version", "panel_hash", "tokenizer_hash", "source", "precision")
    shard_n = None
    by_index: dict[int, SequenceScores] = {}
    seen_shards = set()
    ties = TieStats()
    for p, r in recs:
        b = r.provenance
        diff = [k for k in same if getattr(a, k) != getattr(b, k)]
        if r.k != r0.k:
            diff.append("k")
        if diff:
            raise MergeError(f"{p}: differs from {p0} in {diff}; these shards are not one panel run")
        ex = b.extra
        if not ex.get("shard") or "seq_indices" not in ex:
            raise MergeError(f"{p}: not a shard record (no provenance extra.shard)")
        i, n = ex["shard"]
        if shard_n is None:
            shard_n, total = n, ex["panel_sequences"]
        if n != shard_n or ex["panel_sequences"] != total:
            raise MergeError(f"{p}: shard {i}/{n} of {ex['panel_sequences']} sequences; {p0} is one of {shard_n} "
                             f"shards of {total}")
        if i in seen_shards:
            raise MergeError(f"{p}: shard {i}/{n} given twice")
        seen_shards.add(i)
        if len(ex["seq_indices"]) != r.n_sequences:
            raise MergeError(f"{p}: provenance names {len(ex['seq_indices'])} sequences, the record holds {r.n_sequences}")
        for idx, s in zip(ex["seq_indices"], _record_sequences(r)):
            by_index[idx] = s
        for site, c in ex.get("ties", {}).get("counts", {}).items():
            ties.add(site, c, 0)
    missing = sorted(set(range(shard_n)) - seen_shards)
    if missing or sorted(by_index) != list(range(total)):
        raise MergeError(f"merge: shards {missing} of {shard_n} are missing "
                         f"({total - len(by_index)} of {total} sequences absent)")
    extra = {k: v for k, v in a.extra.items() if k not in ("shard", "seq_indices", "ties", "run")}
    extra.update({"shard": None, "panel_sequences": total, "seq_indices": list(range(total)),
                  "ties": {"total": ties.total, "counts": dict(sorted(ties.counts.items()))},
                  "merged_from": [{"file": str(p), "shard": r.provenance.extra["shard"],
                                   "run": r.provenance.extra.get("run")} for p, r in recs]})
    prov = dataclasses.replace(a, created=Provenance.now(), extra=extra)
    return Record.from_sequences(prov, [by_index[i] for i in range(total)], k=r0.k)
