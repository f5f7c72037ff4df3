"""Cost of the DeepSeek oracle's long-context path against length (issue 39): chunked prefill, head on the scored
rows only (oracle/dsv41/long_context.py), on a tiny checkpoint.

    .venv/bin/python benchmarks/bench_long_context.py --arch v4 --lengths 2048,4096,8192 --threads 2 \\
        --out benchmarks/results/long_context_oracle.json

Each length runs in a fresh process (so its peak RSS is its own): the first L tokens of long@1's longest code item
(real text, DeepSeek tokenizer) for V4; V4.1's tiny vocabulary is 512, so its ids are those tokens mod 512 (said in
the result). Scored positions: long@1's depth choice for L (panels.long.depth_positions). Reported per length:
wall and process CPU seconds (user + sys: the CPU figure is what a loaded, shared box distorts least), both per
token, peak RSS (VmHWM), the load average around the run, and the chunk and thread settings. A result file is
rewritten (atomically) after every length, so a killed run keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _tokens(arch: str, length: int, vocab: int) -> list[int]:
    from panels import encode_panel, load_panel, load_tokenizer
    from panels.long import LONGEST, select

    enc = encode_panel(select(load_panel("long@1"), [LONGEST], ["code"]), load_tokenizer("deepseek"))
    ids = list(enc.sequences[0].token_ids[:length])
    return ids if arch == "v4" else [t % vocab for t in ids]


def _checkpoint(arch: str):
    from oracle.dsv41.checkpoint import Checkpoint

    if arch == "v4":
        from engine.dsv4_model import ensure_dsv4_tiny

        return Checkpoint(ensure_dsv4_tiny())
    from core.paths import cache_dir
    from oracle.dsv41.tiny import write_tiny_checkpoint

    path = cache_dir() / "models" / "dsv41-tiny-bench-s0"
    if not (path / "config.json").is_file():
        write_tiny_checkpoint(path, seed=0)
    return Checkpoint(path)


def one(arch: str, length: int, threads: int, chunk: int, progress: Path | None = None) -> dict:
    """One length in this process; with `progress`, the per-chunk CPU costs so far are rewritten there after every
    chunk (a run stopped early still tells the cost against depth it reached)."""
    import numpy as np
    import torch

    from oracle.dsv41.host import reset_peak_rss, status_kib
    from oracle.dsv41.long_context import ChunkTrace, prefill_scored
    from oracle.dsv41.model import Model
    from oracle.dsv41.runner import engram_token_map, full_weights
    from panels.long import depth_positions

    torch.set_num_threads(threads)
    ck = _checkpoint(arch)
    cfg = ck.model_config
    ids = _tokens(arch, length, cfg.vocab_size)
    if len(ids) != length:
        raise SystemExit(f"only {len(ids)} tokens available, {length} asked")
    model = Model(cfg, full_weights(ck), engram_token_map(ck), with_mtp=False)
    scored = np.asarray(depth_positions(length), dtype=np.int64)
    chunks: list[ChunkTrace] = []
    per_chunk: list[dict] = []   # CPU seconds per chunk: the cost against depth within one run

    def cpu_now() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    last = [0.0]

    def on_chunk(trace: ChunkTrace) -> None:
        now = cpu_now()
        chunks.append(trace)
        per_chunk.append({"start": trace.start, "end": trace.end, "cpu_ms_per_token":
                          round(1000 * (now - last[0]) / (trace.end - trace.start), 3)})
        last[0] = now
        if progress is not None:
            from core.atomic import write_json_atomic

            write_json_atomic(progress, {"arch": arch, "tokens": length, "threads": threads, "chunk": chunk,
                                         "checkpoint": ck.dir.name, "per_chunk": per_chunk})

    reset_peak_rss()
    load0 = os.getloadavg()[0]
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    last[0] = cpu_now()
    with torch.inference_mode():
        stats, _ = prefill_scored(model, ids, scored, chunk, top_k=20, on_chunk=on_chunk)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return {"arch": arch, "checkpoint": ck.dir.name, "tokens": length, "scored": int(scored.size), "chunk": chunk, "threads": threads,
            "chunks": len(chunks), "max_head_rows": max(c.head_rows for c in chunks),
            "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "wall_ms_per_token": round(1000 * wall / length, 3),
            "cpu_ms_per_token": round(1000 * cpu / length, 3), "peak_rss_mib": round(status_kib("VmHWM") / 1024, 1),
            "loadavg_1min": [round(load0, 1), round(os.getloadavg()[0], 1)],
            "ids": "long@1 code-131072 prefix" + ("" if arch == "v4" else " mod vocab 512"),
            "mean_actual_logprob": round(float(stats.actual_logprob.mean()), 4), "per_chunk": per_chunk}


def predict(tiny_path: Path, release_path: Path, tokens: int = 131072, scored: int = 288) -> dict:
    """A 128K-token reference at release size, from the release per-stage measurements (dsv41_release_prediction:
    the default panel, 5,283 tokens in ~200-token sequences, 2 threads on this box) and the tiny V4 long-context
    flatness. Model: the weights are read and decoded once per run whatever the length; the per-token compute
    (attention + MoE + Engram) scales with tokens times the tiny checkpoint's growth of CPU time per token from its
    shortest to its longest measured length (held there beyond it: at most window + top-k + S/128 keys per query);
    the head runs only on the scored rows. Assumes the layer-streamed runner took the chunked attention (not built
    yet: long_context.py holds the weights in memory)."""
    tiny = json.loads(tiny_path.read_text())
    runs = sorted((r for r in tiny["runs"] if r["arch"] == "v4"), key=lambda r: r["tokens"])
    # a ratio under 1 is the box's load falling during the runs, not a cheaper deep token: never below flat
    growth = max(1.0, runs[-1]["cpu_ms_per_token"] / runs[0]["cpu_ms_per_token"])
    rel = json.loads(release_path.read_text())["runs"][0]["totals"]
    n = rel["tokens"]
    weights_s = rel["decode_s"] + rel["load_other_s"] + rel["embed_s"]
    per_token_s = (rel["attention_s"] + rel["moe_s"] + rel["engram_s"]) / n
    compute_s = per_token_s * tokens * growth
    # upper estimate: a deep query attends window 128 + top-512 = 640 keys, a query of the measured ~200-token
    # sequences at most ~230 (128 + up to ~100 compressed): attention per token x 640 / 160 (its mean, rounded up)
    keys_ratio = 640 / 160
    compute_upper_s = (per_token_s + (keys_ratio - 1) * rel["attention_s"] / n) * tokens * growth
    head_s = rel["head_s"] / n * scored
    # activations between streamed stages: h [S, hc, dim] and pre [S, hc] fp32 (release hc 4, dim 5120)
    stage_state_bytes = tokens * (4 * 5120 + 4) * 4
    return {"tokens": tokens, "scored_rows": scored, "from": [str(tiny_path), str(release_path.relative_to(REPO))],
            "release_measured_tokens": n, "tiny_growth_cpu_per_token": round(growth, 3),
            "tiny_growth_between": [runs[0]["tokens"], runs[-1]["tokens"]],
            "weights_read_decode_s": round(weights_s), "compute_s": round(compute_s), "head_s": round(head_s),
            "total_s": round(weights_s + compute_s + head_s),
            "total_days_2_threads": round((weights_s + compute_s + head_s) / 86400, 1),
            "attention_keys_ratio_upper": keys_ratio, "compute_upper_s": round(compute_upper_s),
            "total_upper_days_2_threads": round((weights_s + compute_upper_s + head_s) / 86400, 1),
            "stage_state_gib": round(stage_state_bytes / 2**30, 1),
            "peak_rss_streamed_gib_measured": round(rel["peak_rss_streamed_bytes"] / 2**30, 1)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", choices=("v4", "v4.1"), default="v4")
    ap.add_argument("--lengths", default="2048,4096,8192")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--out", default="benchmarks/results/long_context_oracle.json")
    ap.add_argument("--one", type=int, default=0, help="(internal) run one length here, print its JSON")
    ap.add_argument("--predict", action="store_true", help="the 128K release-size prediction from --out")
    a = ap.parse_args()
    if a.predict:
        from core.atomic import write_json_atomic

        pred = predict(Path(a.out), REPO / "benchmarks/results/dsv41_release_prediction.json")
        write_json_atomic(Path(a.out).with_name("long_context_oracle_release_prediction.json"), pred)
        print(json.dumps(pred, indent=1))
        return 0
    if a.one:
        progress = Path(a.out).with_name(f"long_context_oracle_progress_{a.arch}_{a.one}.json")
        print(json.dumps(one(a.arch, a.one, a.threads, a.chunk, progress)))
        progress.unlink(missing_ok=True)
        return 0
    from core.atomic import write_json_atomic

    out = Path(a.out)
    result = json.loads(out.read_text()) if out.is_file() else {"benchmark": "bench_long_context", "runs": []}
    host = {"cpus": os.cpu_count(), "machine": "the shared 2-core dev box (other helpers' jobs ran beside it)"}
    for length in (int(x) for x in a.lengths.split(",")):
        proc = subprocess.run([sys.executable, __file__, "--arch", a.arch, "--one", str(length), "--threads",
                               str(a.threads), "--chunk", str(a.chunk), "--out", str(out)], capture_output=True,
                              text=True, cwd=REPO)
        if proc.returncode:
            print(proc.stderr[-2000:], file=sys.stderr)
            return proc.returncode
        run = json.loads(proc.stdout.strip().split("\n")[-1])
        result["runs"] = [r for r in result["runs"] if (r["arch"], r["tokens"]) != (a.arch, length)] + [run]
        result["host"] = host
        write_json_atomic(out, result)
        print(json.dumps(run), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
