"""Per-domain table for vLLM CPU DeepSeek-V4 (bf16) against the DeepSeek oracle's V4 fp32 reference, with the
oracle's own reference-bf16 noise floor and transformers' fp32 DeepseekV4 (the second opinion) beside it:
KL_part mean, top-1 (decided positions) and PPL ratio of each against the same reference, and the engine's
KL as a multiple of the floor.

    .venv/bin/python benchmarks/dsv4_report_table.py REF ENGINE FLOOR TRANSFORMERS \
        [--out benchmarks/results/dsv4_report_table]      # writes .json and .md

(`ds41gate report REF ENGINE --noise-floor FLOOR` writes the full report; it takes engine-side records only,
so the transformers column is this script's.)
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("reference", type=Path)
    ap.add_argument("engine", type=Path)
    ap.add_argument("floor", type=Path)
    ap.add_argument("transformers", type=Path)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/dsv4_report_table"))
    a = ap.parse_args(argv)

    from core.atomic import write_json_atomic
    from core.metrics import panel_metrics
    from core.records import Record

    ref = Record.load(a.reference)
    sides = {name: panel_metrics(ref, Record.load(p)) for name, p in
             (("engine", a.engine), ("floor", a.floor), ("transformers", a.transformers))}

    def cell(g):
        return {"kl_part": g.kl_part.mean, "top1_decided": g.top1_decided, "ppl_ratio": g.perplexity.get("ratio"),
                "positions": g.n_positions}

    domains = sorted(sides["engine"].domains)
    rows = {d: {k: cell(v.domains[d]) for k, v in sides.items()} for d in domains}
    rows["overall"] = {k: cell(v.overall) for k, v in sides.items()}
    out = {"reference": str(a.reference), "engine": str(a.engine), "floor": str(a.floor),
           "transformers": str(a.transformers), "rows": rows}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(a.out.with_suffix(".json"), out)

    def f(x, spec=".3g"):
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)

    lines = ["| domain | n | engine KL_part | floor KL_part | engine / floor | transformers KL_part | engine top-1 | "
             "floor top-1 | transformers top-1 | engine PPL ratio | floor PPL ratio | transformers PPL ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for d, r in rows.items():
        e, fl, t = r["engine"], r["floor"], r["transformers"]
        mult = e["kl_part"] / fl["kl_part"] if fl["kl_part"] else math.nan
        lines.append(f"| {d} | {e['positions']} | {f(e['kl_part'])} | {f(fl['kl_part'])} | {f(mult, '.2f')} | "
                     f"{f(t['kl_part'])} | {f(e['top1_decided'])} | {f(fl['top1_decided'])} | "
                     f"{f(t['top1_decided'])} | {f(e['ppl_ratio'], '.4f')} | {f(fl['ppl_ratio'], '.4f')} | "
                     f"{f(t['ppl_ratio'], '.4f')} |")
    a.out.with_suffix(".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    print(json.dumps({k: v for k, v in rows["overall"].items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
