"""vLLM CPU DeepSeek-V4 (bf16) against the DeepSeek oracle (fp32), per domain, beside the oracle's own noise floor
and beside transformers' fp32 opinion (issue 16, "A report").

    .venv/bin/python benchmarks/dsv4_engine_report.py ENGINE_RECORD [--out benchmarks/results/dsv4_engine_report]

ENGINE_RECORD is the engine record a gate run wrote (``engine-vllm-cpu-dsv4.safetensors`` in its results
folder: ``pytest gates/test_kl_panel.py -m gate --engine-profile vllm-cpu-dsv4 --results DIR``). The oracle
reference is the plugin's cached one (built if missing); the transformers record is scored here from the same
release-layout checkpoint; the noise floor is benchmarks/results/dsv4_noise_floor.json (``deepseek_oracle``:
the oracle's reference-bf16 mode against its fp32 mode on the same panel). Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PROFILE = "vllm-cpu-dsv4"
FLOOR = REPO / "benchmarks" / "results" / "dsv4_noise_floor.json"


def _row(g) -> dict:
    ratio = g.perplexity.get("ratio")
    return {"positions": g.n_positions, "kl_part_mean": g.kl_part.mean, "top1": g.top1,
            "top1_decided": g.top1_decided, "ppl_ratio": ratio,
            "ln_ppl_ratio": math.log(ratio) if ratio and ratio > 0 else None}


def _table(result) -> dict:
    return {"domains": {d: _row(g) for d, g in result.domains.items()}, "overall": _row(result.overall)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("engine_record", type=Path)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "dsv4_engine_report")
    args = ap.parse_args(argv)

    from core.atomic import atomic_write_text, write_json_atomic
    from core.metrics import panel_metrics
    from core.records import Record
    from ds41gates import pipeline
    from engine.target import resolve_gate_target
    from oracle.hf import HFPanelOracle

    engine = Record.load(args.engine_record)
    target = resolve_gate_target(PROFILE)
    encoded, model_dir = target.encoded, target.model_dir
    t0 = time.perf_counter()
    reference, ref_path = pipeline.ensure_reference(encoded, model_dir, oracle=target.oracle,
                                                    precision=target.precision)
    t_ref = time.perf_counter() - t0
    t0 = time.perf_counter()
    hf = HFPanelOracle(model_dir, top_k=pipeline.ORACLE_TOP_K, threads=1).score(encoded)
    t_hf = time.perf_counter() - t0
    floor = json.loads(FLOOR.read_text())["deepseek_oracle"]
    # the attribution: the same oracle with its activation QDQ (fp8 act quant into every fp8 / fp4 GEMM) off,
    # which the served unquantized form does not do; its fp8 KV emulation stays on (the engine's KV is fp8)
    from benchmarks.dsv4_oracle_vs_transformers import emulation_off
    from oracle.dsv41.checkpoint import Checkpoint
    from oracle.dsv41.runner import RunOptions, run_to_file

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dsv4-report-") as work, emulation_off({"act"}):
        oracle_no_act = run_to_file(Checkpoint(model_dir), encoded, Path(work) / "oracle-act-qdq-off.safetensors",
                                    Path(work) / "run", RunOptions(precision="fp32", threads=1,
                                                                   top_k=pipeline.ORACLE_TOP_K, progress=False))
    t_no_act = time.perf_counter() - t0

    vs_oracle = _table(panel_metrics(reference, engine))
    vs_hf = _table(panel_metrics(hf, engine))
    hf_vs_oracle = _table(panel_metrics(reference, hf))
    vs_no_act = _table(panel_metrics(oracle_no_act, engine))
    doc = {"what": "vLLM CPU DeepSeek-V4 (bf16) vs the DeepSeek oracle V4 fp32, beside the oracle's reference-bf16 "
                   "noise floor and transformers' DeepseekV4 fp32", "profile": PROFILE,
           "panel": f"{encoded.panel_name}@{encoded.panel_version}", "engine_record": str(args.engine_record),
           "engine_source": engine.provenance.source,
           "reference": str(ref_path), "seconds": {"reference": round(t_ref, 1), "transformers": round(t_hf, 1),
                                                             "oracle_act_qdq_off": round(t_no_act, 1)},
           "engine_vs_oracle": vs_oracle, "engine_vs_transformers": vs_hf, "transformers_vs_oracle": hf_vs_oracle,
           "engine_vs_oracle_act_qdq_off": vs_no_act,
           "oracle_noise_floor": floor}
    write_json_atomic(args.out.with_suffix(".json"), doc)

    lines = ["| domain | positions | KL_part engine vs oracle | noise floor (oracle bf16 vs fp32) | "
             "KL_part engine vs oracle, act QDQ off | KL_part engine vs transformers fp32 | "
             "KL_part transformers vs oracle | top-1 engine vs oracle (floor) | PPL ratio engine / oracle (floor) |",
             "|---|---|---|---|---|---|---|---|---|"]
    def row(table: dict, d: str) -> dict | None:
        return table.get("overall") if d == "overall" else table["domains"].get(d)

    for d in [*vs_oracle["domains"], "overall"]:
        e, h, t, a = (row(x, d) for x in (vs_oracle, vs_hf, hf_vs_oracle, vs_no_act))
        f = row(floor, d)
        fk = f"{f['kl_part_mean']:.4f}" if f else "—"
        ft = f"{f['top1']:.3f}" if f else "—"
        fp = f"{math.exp(f['ln_ppl_ratio']):.3f}" if f and f.get("ln_ppl_ratio") is not None else "—"
        lines.append(f"| {d} | {e['positions']} | {e['kl_part_mean']:.4f} | {fk} | {a['kl_part_mean']:.4f} | {h['kl_part_mean']:.4f} | "
                     f"{t['kl_part_mean']:.2e} | {e['top1']:.3f} ({ft}) | {e['ppl_ratio']:.3f} ({fp}) |")
    atomic_write_text(args.out.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
