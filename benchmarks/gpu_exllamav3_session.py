"""The exllamav3 gate session on a CUDA GPU, in one process tree (scripts/gpu/exllamav3_session.sh runs it).

Stages (each timed; results written after every stage, so a killed run keeps what it measured):

1. ``models``  — the tiny DeepSeek-V4 (release layout for the oracle, unquantized for exllamav3) and exllamav3's
   own EXL3 conversions at each ``--bits`` (engine/exllamav3_models.py), each translated into an oracle pack
   (oracle/dsv41/exllamav3_pack.py);
2. ``refs``    — the DeepSeek oracle's fp32 references of the dsv4-ci panel on the GPU (RunOptions device cuda):
   the release checkpoint (for bf16), and the release checkpoint + each EXL3 pack (the same weights served);
3. ``kernels`` — the EXL3 kernel gate (engine/exllamav3_kernels.py) → gpu_kernels_h200.json;
4. ``gates``   — per profile, ``pytest -m gate --engine-profile P --reference REF`` over the KL panel,
   self-consistency, batch invariance and prefix cache gates (each with its can-fail test on the live engine);
5. ``kl_canfail`` — the KL gate's can-fail: each engine record judged against a reference of *other* weights
   (an EXL3 engine against the unquantized reference, 2-bit against 4-bit): must FAIL.

    python benchmarks/gpu_exllamav3_session.py --out OUT [--bits 4 2] [--stages models refs kernels gates kl_canfail]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROFILES = {"bf16": ("exllamav3-dsv4-bf16", "dsv4-tiny-bf16")}
GATE_FILES = ["gates/test_kl_panel.py", "gates/test_self_consistency.py", "gates/test_batch_invariance.py",
              "gates/test_prefix_cache.py"]


def profile_for(bits: float) -> tuple[str, str]:
    return ("exllamav3-dsv4-exl3" if bits == 4 else f"exllamav3-dsv4-exl3-b{bits:g}", f"dsv4-tiny-exl3-b{bits:g}")


class Session:
    def __init__(self, out: Path, work: Path):
        self.out, self.work = out, work
        self.res: dict = {"stages": {}, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self.log_f = open(out / "session.log", "a")

    def log(self, msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        self.log_f.write(line + "\n")
        self.log_f.flush()

    def save(self) -> None:
        (self.out / "exllamav3_session_h200.json").write_text(json.dumps(self.res, indent=1, default=str))

    def stage(self, name: str, fn, *a):
        t0 = time.time()
        self.log(f"== stage {name}")
        try:
            got = fn(*a)
            self.res["stages"][name] = {"seconds": round(time.time() - t0, 1), "ok": True}
            return got
        except Exception as exc:
            import traceback

            traceback.print_exc()
            self.res["stages"][name] = {"seconds": round(time.time() - t0, 1), "ok": False,
                                        "error": f"{type(exc).__name__}: {exc}"[-2000:]}
            self.log(f"stage {name} FAILED: {type(exc).__name__}: {str(exc)[-800:]}")
            return None
        finally:
            self.save()


def stage_models(s: Session, bits: list[float]) -> dict:
    from engine.dsv4_model import ensure_dsv4_tiny, ensure_dsv4_tiny_bf16
    from engine.exllamav3_models import model_dir, oracle_pack

    t = time.time()
    rel = ensure_dsv4_tiny()
    bf16 = ensure_dsv4_tiny_bf16()
    s.log(f"tiny V4 release {rel} and bf16 {bf16}: {time.time() - t:.1f} s")
    out = {"release": str(rel), "bf16": str(bf16), "exl3": {}}
    for b in bits:
        name = f"dsv4-tiny-exl3-b{b:g}"
        t = time.time()
        d = model_dir(name, log=s.log)
        conv = time.time() - t
        t = time.time()
        pack = oracle_pack(name)
        desc = json.loads((pack / "ds41_exllamav3_pack.json").read_text())
        size = sum(f.stat().st_size for f in d.glob("*.safetensors"))
        out["exl3"][f"{b:g}"] = {"dir": str(d), "pack": str(pack), "convert_s": round(conv, 1),
                                 "pack_s": round(time.time() - t, 1), "bytes": size, "pack_desc": desc,
                                 "quantization_config": json.loads((d / "config.json").read_text()).get(
                                     "quantization_config")}
        s.log(f"{name}: converted in {conv:.1f} s ({size / 1e6:.1f} MB), pack {desc['exl3_linears']} EXL3 linears, "
              f"K {desc['K']}, stacked {desc['stacked']}")
    s.res["models"] = out
    return out


def stage_refs(s: Session, models: dict, bits: list[float]) -> dict:
    from core.records import Record
    from oracle.dsv41.checkpoint import Checkpoint
    from oracle.dsv41.runner import RunOptions, run_panel
    from panels import encode_panel, load_panel, load_tokenizer

    enc = encode_panel(load_panel("dsv4-ci"), load_tokenizer("deepseek"))
    refdir = s.work / "refs"
    refdir.mkdir(exist_ok=True)
    refs = {}
    jobs = [("bf16", None)] + [(f"{b:g}", models["exl3"][f"{b:g}"]["pack"]) for b in bits]
    for tag, pack in jobs:
        path = refdir / f"ref-{tag}.safetensors"
        if not path.exists():
            t = time.time()
            ck = Checkpoint(models["release"], pack_dir=pack)
            rec = run_panel(ck, enc, refdir / f"work-{tag}", RunOptions(precision="fp32", device="cuda", top_k=256,
                                                                         progress=False))
            rec.save(path)
            s.log(f"reference {tag}: {len(enc.sequences)} sequences, {rec.n_positions} positions, "
                  f"{time.time() - t:.1f} s (pack {pack})")
        refs[tag] = str(path)
    s.res["refs"] = {"panel": "dsv4-ci", "sequences": len(enc.sequences), "paths": refs,
                     "positions": Record.load(refs["bf16"]).n_positions}
    return refs


def stage_kernels(s: Session, modes: list[int]) -> dict:
    """The kernel gate once per EXL3_INT8_GEMV mode (exllamav3 reads it once per process: 2 is its CUDA default,
    plain int8 activations in the m = 1 mul1 GEMV; 1 int8 + residual pass; 0 off), merged into one table."""
    merged, summaries = None, {}
    for mode in modes:
        path = s.work / f"kernels-int8gemv{mode}.json"
        env = dict(os.environ, EXL3_INT8_GEMV=str(mode))
        r = subprocess.run([sys.executable, "-m", "engine.exllamav3_kernels", "--out", str(path)], cwd=ROOT,
                           capture_output=True, text=True, timeout=240, env=env)
        (s.work / f"kernels-int8gemv{mode}.log").write_text(r.stdout + r.stderr)
        s.log(f"kernel gate EXL3_INT8_GEMV={mode} rc {r.returncode}: "
              f"{r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-500:]}")
        if not path.exists():
            raise RuntimeError(f"kernel gate wrote nothing: {r.stderr[-1500:]}")
        data = json.loads(path.read_text())
        summaries[str(mode)] = data["summary"]
        if merged is None:
            merged = dict(data, cases=[], runs={})
        merged["cases"] += data["cases"]
        merged["runs"][f"EXL3_INT8_GEMV={mode}"] = {"summary": data["summary"], "seconds": data["seconds"]}
    merged.pop("summary", None)
    merged.pop("exl3_int8_gemv", None)
    merged["exl3_int8_gemv_modes"] = modes
    (s.out / "gpu_kernels_h200.json").write_text(json.dumps(merged, indent=1))
    s.res["kernels"] = summaries
    return merged


def stage_prefix_probe(s: Session) -> list:
    """Where exllamav3's DeepSeek-V4 prefix reuse starts: a prime of L ids generating G tokens under a salt, then
    the same 256 ids + a 24-id turn under that salt; cached_tokens of the warm request (in process, bf16 model)."""
    from engine.exllamav3_models import model_dir
    from engine.exllamav3_server import Exl3Backend, Front

    front = Front(Exl3Backend(str(model_dir("dsv4-tiny-bf16")), cache_tokens=16384, max_batch_size=4),
                  "dsv4-tiny", 4096)
    rows = []
    try:
        base = [1000 + (i * 37) % 5000 for i in range(600)]
        turn = [7000 + i for i in range(24)]
        for L, G in ((256, 1), (256, 2), (256, 8), (257, 1), (300, 1), (512, 1), (513, 1)):
            salt = f"probe-{L}-{G}-{time.time()}"
            front.completion({"prompt": base[:L], "max_tokens": G, "ignore_eos": True, "cache_salt": salt})
            for W in (256, 512):
                if W > L:
                    continue
                warm = front.completion({"prompt": base[:W] + turn, "max_tokens": 1, "ignore_eos": True,
                                         "cache_salt": salt})
                rows.append({"prime_len": L, "prime_gen": G, "warm_shared": W,
                             "cached_tokens": warm["usage"]["prompt_tokens_details"]["cached_tokens"]})
                s.log(f"prefix probe: prime {L} ids + {G} generated, warm shares {W}: "
                      f"cached_tokens {rows[-1]['cached_tokens']}")
    finally:
        front.close()
    s.res["prefix_probe"] = rows
    return rows


def stage_gates(s: Session, refs: dict, bits: list[float], timeout: int, flags: list[str],
                with_bf16: bool) -> dict:
    runs = s.res.get("gates", {})
    plan = ([("bf16",) + PROFILES["bf16"]] if with_bf16 else []) + [(f"{b:g}",) + profile_for(b) for b in bits]
    for tag, profile, _model in plan:
        label = "+".join([profile, *flags])
        res_dir = s.work / f"gates-{label}"
        cmd = [sys.executable, "-m", "pytest", *GATE_FILES, "-m", "gate", "--engine-profile", profile,
               "--reference", refs[tag], "--results", str(res_dir), "-p", "no:cacheprovider", "-q", "-rA",
               "--timeout", str(timeout)] + [x for f in flags for x in ("--engine-flag", f)]
        t = time.time()
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout + 60)
        (s.work / f"gates-{label}.log").write_text(r.stdout + r.stderr)
        wall = time.time() - t
        summary = [ln for ln in r.stdout.splitlines() if ln.startswith(("PASSED", "FAILED", "ERROR", "XFAIL", "SKIPPED"))]
        got = {"rc": r.returncode, "seconds": round(wall, 1), "tests": summary,
               "tail": (r.stdout + r.stderr)[-1500:]}
        rj = res_dir / "results.json"
        if rj.exists():
            got["results"] = json.loads(rj.read_text())
        runs[label] = got
        s.log(f"gates {label}: rc {r.returncode} in {wall:.1f} s; " + "; ".join(summary))
        s.res["gates"] = runs
        s.save()
    return runs


def stage_kl_canfail(s: Session, refs: dict, bits: list[float]) -> list:
    from core.records import Record
    from core.verdicts import judge
    from gates import BANDS_FILE

    rows = []
    recs = {}
    for tag, (profile, _m) in [("bf16", PROFILES["bf16"])] + [(f"{b:g}", profile_for(b)) for b in bits]:
        p = s.work / f"gates-{profile}" / f"engine-{profile}.safetensors"
        if p.exists():
            recs[tag] = (profile, Record.load(p))
    tags = list(recs)
    for eng_tag in tags:
        for ref_tag in [t for t in refs if t != eng_tag]:
            profile, rec = recs[eng_tag]
            result, gate = judge(Record.load(refs[ref_tag]), rec, profile, label=f"{profile} vs ref {ref_tag}",
                                 bands_file=BANDS_FILE)
            rows.append({"engine": profile, "reference_weights": ref_tag, "passed": gate.passed,
                         "detected": not gate.passed, "kl_part_mean": gate.summary["kl_part_mean"],
                         "top1": gate.summary["top1"], "failures": gate.failures[:4]})
            s.log(f"KL can-fail: {profile} against the {ref_tag} reference: passed={gate.passed} "
                  f"KL mean {gate.summary['kl_part_mean']:.4g}")
    s.res["kl_canfail"] = rows
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True, help="results: session JSON, kernel table, logs")
    ap.add_argument("--work", type=Path, default=Path("/tmp/exl3-session"), help="references, gate results")
    ap.add_argument("--bits", type=float, nargs="+", default=[4, 2])
    ap.add_argument("--stages", nargs="+", default=["models", "refs", "kernels", "gates", "kl_canfail",
                                                        "prefix_probe"])
    ap.add_argument("--gate-timeout", type=int, default=150)
    ap.add_argument("--gate-flags", nargs="*", default=[], help="--engine-flag for every gated profile")
    ap.add_argument("--no-bf16-gates", action="store_true", help="gate only the EXL3 profiles")
    ap.add_argument("--kernel-modes", type=int, nargs="+", default=[2, 1, 0], help="EXL3_INT8_GEMV modes")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    a.work.mkdir(parents=True, exist_ok=True)
    s = Session(a.out, a.work)
    import torch

    s.res["host"] = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if torch.cuda.is_available()
                     else None, "bits": a.bits, "cache": os.environ.get("DS41_CACHE")}
    try:
        import exllamav3

        s.res["host"]["exllamav3"] = getattr(exllamav3, "__version__", None) or "1.6.5 (wheel)"
    except Exception as exc:
        s.res["host"]["exllamav3_import_error"] = str(exc)
    models = refs = None
    if "models" in a.stages:
        models = s.stage("models", stage_models, s, a.bits)
    if "kernels" in a.stages:
        s.stage("kernels", stage_kernels, s, a.kernel_modes)
    if "refs" in a.stages and models:
        refs = s.stage("refs", stage_refs, s, models, a.bits)
    if "gates" in a.stages and refs:
        s.stage("gates", stage_gates, s, refs, a.bits, a.gate_timeout, a.gate_flags, not a.no_bf16_gates)
    if "prefix_probe" in a.stages and models:
        s.stage("prefix_probe", stage_prefix_probe, s)
    if "kl_canfail" in a.stages and refs:
        s.stage("kl_canfail", stage_kl_canfail, s, refs, a.bits)
    s.res["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    s.save()
    s.log("session done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
