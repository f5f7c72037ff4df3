"""The table of docs/ORACLE.md "DSpark in DeepSeek-V4 mode": the oracle's V4 DSpark drafter against the independent
re-derivation of tests/oracle/test_dsv4_dspark.py (its own functions), per weight seed, fp32 and reference-bf16.

    python benchmarks/dsv4_dspark_table.py [--seeds 1 2] [--work /tmp/dsv4-dspark-table] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "oracle")]


def rel_max(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def row(T, ck: Path) -> dict:
    import torch

    t0 = time.time()
    m, w = T._model(ck, "fp32")
    ids = torch.randint(0, m.cfg.vocab_size, (2, T.PREFILL + T.DECODES), generator=torch.Generator().manual_seed(5))
    trunk: list = []
    drafts = T._run(m, ids, m.mtp.forward_spec, trunk)
    ref = T._rederived_run(m, w, ids)
    out = {"calls": len(drafts), "ids_equal": all(torch.equal(d.ids, r[0]) for d, r in zip(drafts, ref)),
           "max_abs_dlogit": max(float((d.logits.double() - r[1]).abs().max()) for d, r in zip(drafts, ref)),
           "max_abs_logit": max(float(r[1].abs().max()) for r in ref),
           "max_abs_dconf": max(float((d.confidence.double() - r[2]).abs().max()) for d, r in zip(drafts, ref))}
    for name, kw in (("causal", {"causal": True}), ("one_late", {"shift": 1})):
        wrong = T._rederived_run(m, w, ids, **kw)
        out[f"canfail_{name}_rel"] = max(rel_max(d.logits, r[1]) for d, r in zip(drafts, wrong))
    mb, _ = T._model(ck, "reference-bf16")
    seeds = iter([d.ids[:, 0] for d in drafts])
    trunk_b: list = []
    db = T._run(mb, ids, lambda tok, taps, s, st: mb.mtp.forward_spec(next(seeds), taps, s, st), trunk_b)
    out["bf16_rel_draft_pos0"] = max(rel_max(a.logits[:, 0], b.logits[:, 0]) for a, b in zip(db, drafts))
    out["bf16_rel_trunk"] = max(rel_max(a, b) for a, b in zip(trunk_b, trunk))
    out["bf16_finite"] = all(bool(torch.isfinite(d.logits).all()) for d in db)
    out["bf16_draft_ids_agree"] = (sum(int((a.ids[:, 1:] == b.ids[:, 1:]).sum()) for a, b in zip(db, drafts))
                                   / sum(a.ids[:, 1:].numel() for a in db))
    out["seconds"] = round(time.time() - t0, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--work", type=Path, default=Path("/tmp/dsv4-dspark-table"))
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    import test_dsv4_dspark as T
    import torch

    from oracle.dsv41.tiny_v4 import TinyDSpark, write_tiny_v4_checkpoint

    torch.set_num_threads(1)
    a.work.mkdir(parents=True, exist_ok=True)
    res = {}
    for seed in a.seeds:
        ck = a.work / f"s{seed}"
        if not ck.exists():
            write_tiny_v4_checkpoint(ck, seed=seed, overrides=T.OVERRIDES, dspark=TinyDSpark())
        res[seed] = row(T, ck)
        print(seed, json.dumps(res[seed]), flush=True)
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    return 0 if all(r["ids_equal"] for r in res.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
