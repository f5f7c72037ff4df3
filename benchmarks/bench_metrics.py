"""Benchmark: the per-position metrics (metrics.position_metrics) and every panel summary on a large record pair.

1,000,000 scored positions, engine top-20, reference top-32, 8 domains. Times are reported as ratios
to a plain memcpy of the same input arrays (np.copyto into destinations mapped beforehand) measured in
the same run, interleaved with it (memcpy, np.copy, position_metrics, memcpy, ...; best of each), so
that the number means something on a shared, noisy machine. An allocating np.copy (page faults
included, the baseline of earlier runs) is reported beside it. Each call's CPU time (time.thread_time;
all timed work runs on the calling thread) is recorded beside its wall-clock time: on a machine with
more runnable processes than cores the wall clock also counts the time spent waiting for a core. The
goal is position_metrics within 5x the memcpy; the summaries and bootstraps (panel_metrics minus its
position pass) are timed and reported apart. A small panel is scored first, untimed, so that the
numba kernel is loaded from its cache (or compiled, on a first run). Writes
benchmarks/results/metrics.json (atomically) with the load average before and after.

Run: .venv/bin/python benchmarks/bench_metrics.py [--positions N] [--rounds R] [--profile] [--out PATH]
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as _dt
import io
import json
import os
import platform
import pstats
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from core import metrics  # noqa: E402
from core.metrics import kernel  # noqa: E402
from core.records import Provenance, Record  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "metrics.json"
DOMAINS = ("code", "math", "agentic", "knowledge", "multilingual", "chat", "writing", "structured")


def _provenance(side: str) -> Provenance:
    return Provenance(side=side, panel_name="bench", panel_version="1", panel_hash="b" * 64,
                      tokenizer_hash="t" * 64, precision="fp32" if side == "oracle" else "bf16")


def make_records(n_positions: int, seq_len: int = 500, k_ref: int = 32, k_eng: int = 20, vocab: int = 50_000,
                 seed: int = 0) -> tuple[Record, Record]:
    """A reference/engine pair with realistic structure: the engine's top-k is the reference's with noise,
    some engine ids fall outside the reference top-32, the actual token is usually high-ranked."""
    rng = np.random.default_rng(seed)
    n_seq = n_positions // seq_len
    n = n_seq * seq_len
    # Reference: distinct ids per row (a random base id plus distinct offsets), Zipf-ish decaying logprobs.
    base = rng.integers(0, vocab - 4 * k_ref, size=(n, 1))
    offs = np.argsort(rng.random((n, 4 * k_ref)), axis=1)[:, :k_ref]
    ref_ids = base + offs
    steep = rng.uniform(0.3, 3.0, size=(n, 1))
    raw = -steep * np.log1p(np.arange(k_ref))[None, :] - rng.exponential(0.05, size=(n, k_ref)).cumsum(axis=1)
    # Leave tail mass outside the top-32: normalise against an extra "rest" cell.
    rest = np.log(rng.uniform(0.001, 0.2, size=(n, 1)))
    lse = np.logaddexp(np.log(np.exp(raw).sum(axis=1, keepdims=True)), rest)
    ref_lp = raw - lse
    # Engine: the reference logprobs perturbed, re-sorted; its k_eng ids are mostly the reference's,
    # with ~5% of the ranks-(k_eng+) replaced by ids the reference does not list.
    # Renormalised against the same rest cell, so the engine's record is a distribution too (a KL is never
    # negative between distributions, and the metrics refuse one that is).
    q_raw = ref_lp + rng.normal(0, 0.12, size=ref_lp.shape)
    q_raw = q_raw - np.logaddexp(np.log(np.exp(q_raw).sum(axis=1, keepdims=True)), rest - lse)
    order = np.argsort(-q_raw, axis=1, kind="stable")[:, :k_eng]
    eng_ids = np.take_along_axis(ref_ids, order, axis=1)
    eng_lp = np.take_along_axis(q_raw, order, axis=1) - np.log(1.002)
    swap = rng.random((n, k_eng)) < 0.05
    swap[:, :3] = False
    eng_ids = np.where(swap, vocab + np.arange(k_eng)[None, :], eng_ids)  # ids the reference never lists
    # The actual token: mostly the reference top-1..5, sometimes deeper.
    pick = np.minimum(rng.geometric(0.6, size=n) - 1, k_ref - 1)
    actual = ref_ids[np.arange(n), pick]
    ref_actual = ref_lp[np.arange(n), pick]
    eng_actual = q_raw[np.arange(n), pick] - np.log(1.002)
    # Sequence layout: position 0 of each sequence is unscored, so T = n_seq * (seq_len + 1).
    tokens = np.zeros((n_seq, seq_len + 1), dtype=np.int64)
    tokens[:, 1:] = actual.reshape(n_seq, seq_len)
    scored = np.ones((n_seq, seq_len + 1), dtype=bool)
    scored[:, 0] = False
    common = dict(
        k=None, seq_ids=[f"s{i}" for i in range(n_seq)], domains=[DOMAINS[i % len(DOMAINS)] for i in range(n_seq)],
        seq_offsets=np.arange(n_seq + 1, dtype=np.int64) * (seq_len + 1), token_ids=tokens.ravel(),
        scored=scored.ravel(), pos_seq=np.repeat(np.arange(n_seq, dtype=np.int64), seq_len),
        pos_index=np.tile(np.arange(1, seq_len + 1, dtype=np.int64), n_seq),
    )
    ranks = (pick + 1).astype(np.int64)
    ref = Record(provenance=_provenance("oracle"), **{**common, "k": k_ref}, topk_ids=ref_ids.astype(np.int64),
                 topk_logprobs=ref_lp, actual_logprob=ref_actual, actual_rank=ranks)
    eng = Record(provenance=_provenance("engine"), **{**common, "k": k_eng}, topk_ids=eng_ids.astype(np.int64),
                 topk_logprobs=eng_lp, actual_logprob=eng_actual, actual_rank=np.zeros(n, dtype=np.int64))
    return ref, eng


def _arrays(rec: Record) -> list[np.ndarray]:
    return [rec.token_ids, rec.scored, rec.pos_seq, rec.pos_index, rec.topk_ids, rec.topk_logprobs,
            rec.actual_logprob, rec.actual_rank]


def np_copy_inputs(ref: Record, eng: Record) -> None:
    """np.copy of every input array the metrics read (allocating: includes the page faults)."""
    copies = [np.copy(a) for a in _arrays(ref) + _arrays(eng)]
    del copies


def memcpy_targets(ref: Record, eng: Record) -> list[np.ndarray]:
    """Destination arrays for `memcpy_inputs`, written once so that their pages are mapped."""
    targets = [np.empty_like(a) for a in _arrays(ref) + _arrays(eng)]
    for dst, src in zip(targets, _arrays(ref) + _arrays(eng)):
        np.copyto(dst, src)
    return targets


def memcpy_inputs(ref: Record, eng: Record, targets: list[np.ndarray]) -> None:
    """A plain memcpy of every input array into already mapped destinations (no page faults)."""
    for dst, src in zip(targets, _arrays(ref) + _arrays(eng)):
        np.copyto(dst, src)


def timed(fn, *args, **kwargs) -> tuple[float, float, object]:
    """Wall-clock seconds, CPU seconds of this thread (user + system: unaffected by waiting for a core
    on a loaded machine; every timed stage runs on this one thread) and the result."""
    w0, c0 = time.perf_counter(), time.thread_time()
    out = fn(*args, **kwargs)
    return time.perf_counter() - w0, time.thread_time() - c0, out


def time_exp_buffers(ref: Record, eng: Record) -> float:
    """Time of the kernel's vectorised exp of both top-k arrays alone (chunked as the kernel does)."""
    rows = kernel.CHUNK_ROWS
    ref_e, eng_e = np.empty((rows, ref.k)), np.empty((rows, eng.k))
    t0 = time.perf_counter()
    for lo in range(0, ref.n_positions, rows):
        hi = min(ref.n_positions, lo + rows)
        np.exp(ref.topk_logprobs[lo:hi], out=ref_e[:hi - lo])
        np.exp(eng.topk_logprobs[lo:hi], out=eng_e[:hi - lo])
    return time.perf_counter() - t0


def time_stage(fn, *args, **kwargs) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - t0, out


def profile_top(fn, *args, n: int = 15, **kwargs) -> list[dict]:
    prof = cProfile.Profile()
    prof.enable()
    fn(*args, **kwargs)
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (file, line, name), (cc, nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{Path(file).name}:{line}:{name}", "calls": nc, "tottime_s": round(tt, 4),
                     "cumtime_s": round(ct, 4)})
    rows.sort(key=lambda r: r["cumtime_s"], reverse=True)
    return rows[:n]


def write_json_atomic(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _numba_version() -> str | None:
    try:
        import numba
    except ImportError:
        return None
    return numba.__version__


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--positions", type=int, default=1_000_000)
    ap.add_argument("--n-boot", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved copy / position_metrics rounds (best of each)")
    ap.add_argument("--profile", action="store_true", help="also record a cProfile of panel_metrics")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)

    t_build, (ref, eng) = time_stage(make_records, args.positions)
    n = ref.n_positions
    input_bytes = sum(a.nbytes for a in _arrays(ref) + _arrays(eng))
    # Warm-up on a small pair: loads (or, on a first run, compiles) the numba kernel; timed apart.
    t_warm, _ = time_stage(metrics.panel_metrics, *make_records(2000, seed=1), n_boot=10)
    targets = memcpy_targets(ref, eng)
    load_before = os.getloadavg()
    wall = {"memcpy": [], "np_copy": [], "position_metrics": []}
    cpu = {"memcpy": [], "np_copy": [], "position_metrics": []}
    for _ in range(args.rounds):  # interleaved, so all three see the same machine load
        for name, fn, fn_args in (("memcpy", memcpy_inputs, (ref, eng, targets)),
                                  ("np_copy", np_copy_inputs, (ref, eng)),
                                  ("position_metrics", metrics.position_metrics, (ref, eng))):
            w, c, _ = timed(fn, *fn_args)
            wall[name].append(w)
            cpu[name].append(c)
    del targets
    t_memcpy, t_copy, t_pos = min(wall["memcpy"]), min(wall["np_copy"]), min(wall["position_metrics"])
    c_memcpy, c_pos = min(cpu["memcpy"]), min(cpu["position_metrics"])
    t_check = time_stage(ref.check_compatible, eng)[0]
    t_exp = time_exp_buffers(ref, eng)  # wall clock
    t_panel, c_panel, panel = timed(metrics.panel_metrics, ref, eng, n_boot=args.n_boot)
    load_after = os.getloadavg()
    ratio = t_pos / t_memcpy
    result = {
        "benchmark": "metrics.position_metrics (+ panel summaries apart)",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "positions": n,
        "sequences": ref.n_sequences,
        "domains": len(set(ref.domains)),
        "k_engine": eng.k,
        "k_reference": ref.k,
        "n_boot": args.n_boot,
        "input_bytes": input_bytes,
        "backend": metrics.backend(),
        "rounds": args.rounds,
        "seconds": {
            "build_records": round(t_build, 3),
            "warmup_small_panel_jit_load": round(t_warm, 3),
            "memcpy_inputs_each_round": [round(t, 4) for t in wall["memcpy"]],
            "np_copy_inputs_each_round": [round(t, 4) for t in wall["np_copy"]],
            "position_metrics_each_round": [round(t, 4) for t in wall["position_metrics"]],
            "memcpy_inputs_best": round(t_memcpy, 4),
            "np_copy_inputs_best": round(t_copy, 4),
            "position_metrics_best": round(t_pos, 4),
            "of_which_check_compatible": round(t_check, 4),
            "of_which_exp_buffers": round(t_exp, 4),
            "panel_metrics_total": round(t_panel, 3),
            "summaries_and_bootstraps": round(t_panel - t_pos, 3),  # panel_metrics minus the best position pass
        },
        "cpu_seconds": {  # thread CPU time of the same calls
            "memcpy_inputs_each_round": [round(t, 4) for t in cpu["memcpy"]],
            "np_copy_inputs_each_round": [round(t, 4) for t in cpu["np_copy"]],
            "position_metrics_each_round": [round(t, 4) for t in cpu["position_metrics"]],
            "panel_metrics_total": round(c_panel, 3),
            "summaries_and_bootstraps": round(c_panel - c_pos, 3),
        },
        "position_metrics_ratio_to_memcpy": round(ratio, 2),
        "position_metrics_cpu_ratio_to_memcpy": round(c_pos / c_memcpy, 2),
        "panel_metrics_cpu_ratio_to_memcpy": round(c_panel / c_memcpy, 2),
        "panel_metrics_ratio_to_memcpy": round(t_panel / t_memcpy, 2),
        "position_metrics_ratio_to_np_copy": round(t_pos / t_copy, 2),
        "panel_metrics_ratio_to_np_copy": round(t_panel / t_copy, 2),
        "goal_ratio": 5.0,
        "within_goal": bool(ratio <= 5.0),  # on the wall-clock ratio
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in load_after],
        "overall_kl_part_mean": panel.overall.kl_part.mean,
        "overall_top1": panel.overall.top1,
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "numba": _numba_version(),
            "cpu_count": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "note": "shared 2-core machine; timings are noisy, the ratio is taken within one run",
        },
        "command": "PYTHONPATH=$PWD /work/main/.venv/bin/python benchmarks/bench_metrics.py"
                   + (" --profile" if args.profile else "") + (f" --rounds {args.rounds}" if args.rounds != 3 else ""),
    }
    if args.profile:
        result["profile_top_cumulative"] = profile_top(metrics.panel_metrics, ref, eng, n_boot=args.n_boot)
    write_json_atomic(args.out, result)
    print(json.dumps({k: result[k] for k in ("positions", "backend", "seconds", "cpu_seconds",
                                             "position_metrics_cpu_ratio_to_memcpy", "position_metrics_ratio_to_memcpy",
                                             "panel_metrics_ratio_to_memcpy", "position_metrics_ratio_to_np_copy",
                                             "within_goal", "load_average_before", "load_average_after")},
                     indent=2))
    return result


if __name__ == "__main__":
    main()
