"""Markdown tables of an exllamav3 GPU session (benchmarks/gpu_exllamav3_session.py output), as quoted in
docs/EXLLAMAV3.md and docs/BENCHMARKS.md.

    python benchmarks/exllamav3_tables.py benchmarks/results/exllamav3_session_h200.json \
        [--kernels benchmarks/results/gpu_kernels_h200.json]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def _f(x, fmt=".3g"):
    return "–" if x is None else format(x, fmt)


def kl_tables(session: dict) -> list[str]:
    out = []
    for label, run in session.get("gates", {}).items():
        kl = (run.get("results") or {}).get("kl_panel")
        if not kl:
            continue
        out += [f"**{label}** — KL panel {'PASS' if kl['passed'] else 'FAIL'} (positions "
                f"{kl['summary']['positions']}, mean KL_part {kl['summary']['kl_part_mean']:.4g}, "
                f"top-1 {kl['summary']['top1']:.3f})", "",
                "| domain | positions | KL_part mean | top-1 (decided) | PPL ratio |", "|---|---|---|---|---|"]
        for name, d in sorted(kl["metrics"]["domains"].items()):
            out.append(f"| {name} | {d['n_positions']} | {_f(d['kl_part']['mean'], '.4f')} | "
                       f"{_f(d['top1_decided'], '.3f')} | {_f(d['perplexity']['ratio'], '.3f')} |")
        out.append("")
    return out


def verdict_table(session: dict) -> list[str]:
    rows = ["| profile | KL panel | self-consistency (mean KL_part, top-1 decided) | batch invariance (mismatches) | "
            "prefix cache (counts) | can-fails detected on the live engine |", "|---|---|---|---|---|---|"]
    for label, run in session.get("gates", {}).items():
        r = run.get("results") or {}
        kl, sc, bi, pc = (r.get(k) or {} for k in ("kl_panel", "self_consistency", "batch_invariance", "prefix_cache"))
        yes = lambda v: "PASS" if v.get("passed") else ("FAIL" if v else "–")
        scs = sc.get("summary", {})
        bis = bi.get("summary", {})
        can = []
        for key, name in (("self_consistency_violation", "SC wrong context"),
                          ("batch_invariance_violation", "batch changed request")):
            v = r.get(key)
            if v is not None:
                can.append(f"{name}: {'yes' if v.get('detected') else 'NO'}")
        tests = " ".join(run.get("tests", []))
        pv = "PASSED gates/test_prefix_cache.py::test_prefix_cache_detects" in tests
        can.append(f"prefix mismatch + missing hit: {'yes' if pv else 'NO'}")
        rows.append(f"| {label} | {yes(kl)} ({_f(kl.get('summary', {}).get('kl_part_mean'), '.4f')}) | {yes(sc)} "
                    f"({_f(scs.get('kl_part_mean'))}, {_f(scs.get('top1_decided'), '.3f')}) | {yes(bi)} "
                    f"({bis.get('mismatches', '–')}/{bis.get('comparisons', '–')}) | {yes(pc)} "
                    f"({', '.join(f'{k} {v}' for k, v in (pc.get('counts') or {}).items() if v)}) | "
                    f"{'; '.join(can)} |")
    return rows


def canfail_table(session: dict) -> list[str]:
    rows = session.get("kl_canfail") or []
    if not rows:
        return []
    out = ["| engine | reference weights | KL_part mean | top-1 | gate |", "|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['engine']} | {r['reference_weights']} | {r['kl_part_mean']:.4f} | {r['top1']:.3f} | "
                   f"{'PASS (not detected)' if r['passed'] else 'FAIL (detected)'} |")
    return out


def kernel_table(k: dict) -> list[str]:
    groups = defaultdict(list)
    for c in k["cases"]:
        groups[(c.get("exl3_int8_gemv"), c["kernel"], c["codebook"], c.get("planted"))].append(c)
    out = ["| EXL3_INT8_GEMV | kernel | codebook | planted | K | max rel err (range) | floor (range) | err/floor max | "
           "verdicts |", "|---|---|---|---|---|---|---|---|---|"]
    for (mode, kern, cb, planted), cs in sorted(groups.items(), key=lambda x: (-(x[0][0] or 0), x[0][1], x[0][2],
                                                                               x[0][3] or "")):
        ks = ",".join(str(c["k"]) for c in cs)
        e = [c["max_rel_err"] for c in cs]
        f = [c["floor"] for c in cs]
        v = defaultdict(int)
        for c in cs:
            v[c["verdict"]] += 1
        out.append(f"| {mode} | {kern} | {cb} | {planted or '–'} | {ks} | {min(e):.2e} – {max(e):.2e} | "
                   f"{min(f):.2e} – {max(f):.2e} | {max(c['ratio'] for c in cs):.2f} | "
                   f"{', '.join(f'{n} {x}' for x, n in sorted(v.items()))} |")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("session")
    ap.add_argument("--kernels")
    a = ap.parse_args(argv)
    s = json.load(open(a.session))
    print("\n".join(verdict_table(s) + [""] + kl_tables(s) + canfail_table(s)))
    if a.kernels:
        print("\n".join([""] + kernel_table(json.load(open(a.kernels)))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
