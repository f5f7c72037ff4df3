"""The divergence localizer's planted-fault table: one engine process, the fault-injection plugin moved between
cases through LLM.apply_model (first / middle / last layer x attn / mlp, 1e-3 relative, plus the fault off).

    .venv/bin/python benchmarks/localize_planted.py --profile vllm-cpu-fp32 --panel-item knowledge-02-printing

Writes benchmarks/results/localize_planted-<profile>.json (the table, every verdict, the timings)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.atomic import write_json_atomic  # noqa: E402
from core.localize import summary_rows  # noqa: E402
from ds41gates.localize import (n_decoder_layers, planted_cases, planted_table, prompt_ids,  # noqa: E402
                                run_localize)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default="vllm-cpu-fp32")
    ap.add_argument("--panel-item", default="knowledge-02-printing")
    ap.add_argument("--max-prompt-tokens", type=int, default=None)
    ap.add_argument("--clean-only", action="store_true", help="only the unperturbed case")
    ap.add_argument("--scale", type=float, default=1e-3, help="the planted fault's relative size")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    ids, source = prompt_ids(a.profile, panel_item=a.panel_item, max_tokens=a.max_prompt_tokens)
    cases = planted_cases(n_decoder_layers(a.profile), a.scale)
    if a.clean_only:
        cases = cases[:1]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        recs = run_localize(a.profile, ids, source, Path(work), cases=cases)
    wall = time.perf_counter() - t0
    rows = planted_table(recs, cases)
    for r in rows:
        print(json.dumps(r))
    tag = "" if a.scale == 1e-3 else f"-scale{a.scale:g}"
    out = Path(a.out or ROOT / "benchmarks" / "results" / f"localize_planted-{a.profile}{tag}.json")
    write_json_atomic(out, {"profile": a.profile, "scale": a.scale, "prompt": source, "n_tokens": len(ids), "cases": len(cases),
                            "wall_s": round(wall, 1), "table": rows,
                            "timings": {n: r.timings for n, r in recs.items()},
                            "verdicts": {n: r.to_dict()["verdict"] for n, r in recs.items()},
                            "per_layer_prefill": {n: summary_rows(r) for n, r in recs.items()}})
    print(f"{out}  ({wall:.1f} s, all exact: {all(r['exact'] for r in rows)})")
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
