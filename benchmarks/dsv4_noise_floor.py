"""The bf16 noise floor of the dsv4-ci panel on the tiny DeepSeek-V4 checkpoint: transformers'
DeepseekV4ForCausalLM run in bf16 (the modules transformers keeps in fp32 for V4 — mHC, norms, sinks,
compressor position biases, router bias — kept fp32, as transformers' own bf16 load does) against the same
model in fp32, scored with the KL-panel metrics an engine record gets (top-20 on the bf16 side, as the engine
is asked for). The vllm-cpu-dsv4 bands in gates/bands.toml sit at >= 3x these floors (gates.md §2.7).

    .venv/bin/python benchmarks/dsv4_noise_floor.py --checkpoint DIR [--out benchmarks/results/dsv4_noise_floor.json]

Also writes the fp32 reference record beside the JSON (``--save-reference``) for the report.

    .venv/bin/python benchmarks/dsv4_noise_floor.py --from-records REF_FP32 REF_BF16 [--label deepseek_oracle]

scores two existing oracle records (the DeepSeek oracle's fp32 and reference-bf16 runs of the panel,
``ds41gate oracle run ... [--precision reference-bf16]``) the same way and merges the result into the JSON
under ``--label``: the floor the gates.md §2.7 bands are derived from.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", type=Path)
    ap.add_argument("--from-records", nargs=2, type=Path, metavar=("REF_FP32", "REF_BF16"))
    ap.add_argument("--label", default="deepseek_oracle")
    ap.add_argument("--panel", default="dsv4-ci")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/dsv4_noise_floor.json"))
    ap.add_argument("--save-reference", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)

    import panels
    from core.atomic import write_json_atomic
    from core.metrics import panel_metrics
    from engine.endpoint import DEFAULT_ENGINE_K
    from oracle.hf import HFOracle, HFPanelOracle
    from oracle.hf_dsv4 import to_transformers_bf16

    def row(g):
        return {"positions": g.n_positions, "kl_part_mean": g.kl_part.mean, "kl_part_p99": g.kl_part.p99,
                "kl_part_max": g.kl_part.max, "top1": g.top1, "top1_decided": g.top1_decided,
                "ln_ppl_ratio": g.perplexity.get("ln_ratio")}

    if a.from_records:
        from core.records import Record

        ref, bf = (Record.load(p) for p in a.from_records)
        pm = panel_metrics(ref, bf)
        old = json.loads(a.out.read_text()) if a.out.exists() else {}
        old[a.label] = {"reference": str(a.from_records[0]), "floor_record": str(a.from_records[1]),
                        "precisions": [ref.provenance.precision, bf.provenance.precision],
                        "overall": row(pm.overall), "domains": {k: row(v) for k, v in sorted(pm.domains.items())}}
        write_json_atomic(a.out, old)
        print(json.dumps(old[a.label], indent=1))
        return 0
    if a.checkpoint is None:
        ap.error("--checkpoint or --from-records is required")
    enc = panels.encode_panel(panels.load_panel(a.panel), panels.load_tokenizer("deepseek"))
    t0 = time.perf_counter()
    orc = HFOracle.load(a.checkpoint, threads=a.threads)
    t_load = time.perf_counter() - t0
    ref = HFPanelOracle(a.checkpoint, top_k=256, oracle=orc).score(enc)
    t_fp32 = time.perf_counter() - t0 - t_load
    if a.save_reference:
        ref.save(a.save_reference)
    to_transformers_bf16(orc.model)
    bf = HFPanelOracle(a.checkpoint, top_k=DEFAULT_ENGINE_K, oracle=orc).score(enc)
    t_bf16 = time.perf_counter() - t0 - t_load - t_fp32
    pm = panel_metrics(ref, bf)

    out = {"what": "transformers DeepseekV4 bf16 (fp32-kept modules as transformers) vs fp32, dsv4-ci panel",
           "checkpoint": str(a.checkpoint), "model_hash": orc.model_hash, "panel": f"{enc.panel_name}@{enc.panel_version}",
           "panel_hash": enc.panel_hash, "engine_k": DEFAULT_ENGINE_K, "threads": a.threads,
           "seconds": {"load": round(t_load, 1), "fp32": round(t_fp32, 1), "bf16": round(t_bf16, 1)},
           "overall": row(pm.overall), "domains": {k: row(v) for k, v in sorted(pm.domains.items())}}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(a.out, out)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
