"""The long-only planted fault (issue 39): a fault the engine carries only at positions >= FROM_POS, which the short
dsv4-ci KL panel (positions below 300) PASSES and a comparison at depth FAILS — in one run of this script.

    .venv/bin/python benchmarks/long_fault_dsv4.py [--long-reference REF.safetensors] [--from-pos 2048]

Route of the plant: the fault injector (engine/vllm_perturb, DS41_PERTURB_LAYER / _MODULE / _SCALE / _FROM_POS) is
refused by gate sessions, profiles, flags and nightly cells (engine/environment.py); this script builds its launch
in Python (`EngineServer(..., overrides={"extra_env": ...})`, which is code, not configuration) outside any gate
session, and judges with the same functions the gates use. Two launches of vllm-cpu-dsv4: clean, then planted.

For each launch:
  * short: the dsv4-ci panel scored and judged by the KL panel rule (core.verdicts.judge, the profile's bands) against
    the DeepSeek oracle's cached dsv4-ci reference;
  * depth vs the clean engine: long prompts (panels.bench prose, exact token counts) scored at every position and
    judged per depth bucket (core.metrics.by_depth + core.bands.judge_depth, the profile's [depth] bands) against
    the clean launch's own record — the engine A/B at depth (the control: the clean launch's second scoring of the
    same prompts against its first);
  * depth vs the oracle (with --long-reference, the oracle's long-context reference record): the same per-bucket
    rule against the oracle.

Writes benchmarks/results/long_fault_dsv4.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROFILE = "vllm-cpu-dsv4"


def _encoded_long(tok, lengths):
    from panels.bench import prefill_prompt
    from panels.model import EncodedPanel, EncodedSequence

    seqs = []
    for n in lengths:
        ids = tuple(int(t) for t in prefill_prompt(tok, n, salt=f"longfault{n:06d}", chat=False).token_ids)
        seqs.append(EncodedSequence(f"prose-{len(ids)}", "prose", ids, (False,) + (True,) * (len(ids) - 1)))
    return EncodedPanel("long-fault-prose", 1, "sha256:" + "0" * 64, tok.hash, tuple(seqs), tok.name)


def _depth(ref, eng, bands):
    from core.bands import judge_depth
    from core.metrics import position_metrics
    from core.metrics.by_depth import depth_reports, depth_rows

    reports = depth_reports(ref, position_metrics(ref, eng), n_boot=500)
    verdict = judge_depth(reports, bands, PROFILE)
    return {"passed": verdict.passed, "failures": verdict.failures(), "buckets": depth_rows(reports)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--from-pos", type=int, default=2048)
    ap.add_argument("--layer", type=int, default=2)
    ap.add_argument("--module", default="attn")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--lengths", default="2560")
    ap.add_argument("--long-reference", default=None)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "long_fault_dsv4.json"))
    a = ap.parse_args()

    from core.atomic import write_json_atomic
    from core.bands import load_depth_bands
    from core.records import Record
    from core.verdicts import judge
    from ds41gates import pipeline
    from engine.endpoint import DEFAULT_ENGINE_K, launch_endpoint, score_engine
    from engine.target import resolve_gate_target
    from panels import encoded_from_record, load_tokenizer

    target = resolve_gate_target(PROFILE)
    short_ref, _ = pipeline.ensure_reference(target.encoded, target.model_dir, oracle=target.oracle,
                                             precision=target.precision)
    tok = load_tokenizer(target.tokenizer)
    long_enc = _encoded_long(tok, [int(x) for x in a.lengths.split(",")])
    depth_bands = load_depth_bands(PROFILE, target.bands)
    oracle_long = Record.load(a.long_reference) if a.long_reference else None
    plant = {"DS41_PERTURB_LAYER": str(a.layer), "DS41_PERTURB_MODULE": a.module,
             "DS41_PERTURB_SCALE": str(a.scale), "DS41_PERTURB_FROM_POS": str(a.from_pos)}
    out: dict = {"profile": PROFILE, "plant": plant, "long_prompts": [len(s.token_ids) for s in long_enc.sequences],
                 "route": "launch built in Python (EngineServer overrides extra_env), outside any gate session",
                 "runs": {}}
    records = {}
    for case, env in (("clean", {}), ("planted", plant)):
        t0 = time.perf_counter()
        server, endpoint = launch_endpoint(PROFILE, target.model_dir, overrides={"extra_env": env} if env else None)
        try:
            t1 = time.perf_counter()
            short_eng = score_engine(endpoint, target.encoded, DEFAULT_ENGINE_K)
            t2 = time.perf_counter()
            long_eng = score_engine(endpoint, long_enc, DEFAULT_ENGINE_K)
            t3 = time.perf_counter()
            if case == "clean":   # the control: the clean engine at depth against its own repeat
                records["clean_repeat"] = score_engine(endpoint, long_enc, DEFAULT_ENGINE_K)
            oracle_eng = score_engine(endpoint, encoded_from_record(oracle_long), DEFAULT_ENGINE_K) \
                if oracle_long is not None else None
        finally:
            server.stop()
        _, gate = judge(short_ref, short_eng, PROFILE, case, target.bands)
        records[case] = long_eng
        run = {"start_s": round(t1 - t0, 1), "short_score_s": round(t2 - t1, 1), "long_score_s": round(t3 - t2, 1),
               "short_panel": {"passed": gate.passed, "failures": list(gate.failures),
                               "kl_part_mean": gate.pair.panel.overall.kl_part.mean,
                               "positions": len(short_ref.pos_index),
                               "max_position": int(short_ref.pos_index.max())}}
        if oracle_eng is not None:
            run["depth_vs_oracle"] = _depth(oracle_long, oracle_eng, depth_bands)
        out["runs"][case] = run
        print(case, json.dumps(run, default=str)[:2000], flush=True)
    for case, other in (("clean", "clean_repeat"), ("planted", "planted")):
        out["runs"][case]["depth_vs_clean_engine"] = _depth(records["clean"], records[other], depth_bands)
    planted, clean = out["runs"]["planted"], out["runs"]["clean"]
    out["demonstrated"] = bool(planted["short_panel"]["passed"] and clean["short_panel"]["passed"]
                               and clean["depth_vs_clean_engine"]["passed"]
                               and not planted["depth_vs_clean_engine"]["passed"])
    write_json_atomic(a.out, out)
    print(json.dumps({k: out[k] for k in ("plant", "demonstrated")}), "->", a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
