"""Real engine start time, memory and the engines.md §12.7 canary values, one profile at a time.

    .venv/bin/python benchmarks/bench_engine_canary.py vllm-cpu-fp32 llamacpp-f32 \
        [--cold] [--out benchmarks/results/engine_canary.json]

For each profile: start the server through engine.launcher (``--cold`` points VLLM_CACHE_ROOT at a
fresh empty folder first, so vLLM's torch.compile cache is cold), record the seconds until
/v1/models answers and the summed RSS of the server's process group, send one canary request,
stop, and check nothing of the group is left. vLLM: token-id prompt with ``prompt_logprobs``.
llama-cpp-python: text prompt with echo + logprobs, read with its one-position shift
(abetlen/llama-cpp-python#1983; position 1, " capital", is not available there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.launcher import EngineServer  # noqa: E402
from engine.profiles import load_profile  # noqa: E402
from engine.supervise import group_members  # noqa: E402

PROMPT = "The capital of France is"
IDS = [504, 3575, 282, 4649, 314]
REFERENCE = {"capital": -11.5393, "France": -2.4387, "Paris": -0.2581}


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def group_rss_mb(pgid: int) -> float:
    total = 0
    for pid in group_members(pgid):
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def group_pss_mb(pgid: int) -> float:
    """Proportional set size summed over the group: shared pages counted once overall."""
    total = 0
    for pid in group_members(pgid):
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def canary_vllm(base: str) -> dict:
    t0 = time.monotonic()
    r = _post(base + "/v1/completions", {"model": "smollm2", "prompt": IDS, "max_tokens": 1, "temperature": 0,
                                          "prompt_logprobs": 5, "logprobs": 5})
    c = r["choices"][0]
    return {
        "request_s": round(time.monotonic() - t0, 3),
        "capital": c["prompt_logprobs"][1]["3575"]["logprob"],
        "capital_rank": c["prompt_logprobs"][1]["3575"]["rank"],
        "France": c["prompt_logprobs"][3]["4649"]["logprob"],
        "Paris": c["logprobs"]["top_logprobs"][0][" Paris"],
        "generated": c["text"],
    }


def canary_llamacpp(base: str) -> dict:
    t0 = time.monotonic()
    r = _post(base + "/v1/completions", {"model": "smollm2", "prompt": PROMPT, "max_tokens": 1, "temperature": 0,
                                          "echo": True, "logprobs": 5})
    top = r["choices"][0]["logprobs"]["top_logprobs"]
    return {
        "request_s": round(time.monotonic() - t0, 3),
        "capital": None,  # position 1 is lost by the shift
        "France": top[2][" France"],
        "Paris": top[4][" Paris"],
    }


def run_one(name: str, cold: bool, extra_env: dict[str, str], flags: list[str]) -> dict:
    profile = load_profile(name)
    env = dict(extra_env)
    cold_dir = None
    if cold and profile.engine == "vllm":
        cold_dir = tempfile.mkdtemp(prefix="vllm-cold-cache-")
        env["VLLM_CACHE_ROOT"] = cold_dir
    with EngineServer(profile, overrides={"extra_env": env} if env else None, flags=flags) as srv:
        rss = group_rss_mb(srv.pid)
        pss = group_pss_mb(srv.pid)
        values = canary_vllm(srv.base_url) if profile.engine == "vllm" else canary_llamacpp(srv.base_url)
        pgid = srv.pid
        start_s = srv.start_seconds
        log = str(srv.log_path)
    left = group_members(pgid)
    return {
        "profile": name,
        "compile_cache": ("cold" if cold_dir else env.get("VLLM_CACHE_ROOT", "~/.cache/vllm"))
        if profile.engine == "vllm" else None,
        "extra_env": env,
        "flags": flags,
        "start_s": round(start_s or 0.0, 1),
        "group_rss_mb": round(rss),
        "group_pss_mb": round(pss),
        "left_after_stop": left,
        "log": log,
        **values,
        "delta_vs_reference": {k: (None if values.get(k) is None else round(values[k] - v, 6))
                               for k, v in REFERENCE.items()},
        "loadavg_after": os.getloadavg(),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("profiles", nargs="+")
    ap.add_argument("--cold", action="store_true", help="fresh VLLM_CACHE_ROOT for vLLM profiles")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="extra environment entry for the server (repeatable)")
    ap.add_argument("--flag", action="append", default=[], help="profile flag to turn on (repeatable)")
    ap.add_argument("--out", type=Path, default=None, help="append results to this JSON list file")
    args = ap.parse_args()
    extra_env = dict(kv.split("=", 1) for kv in args.env)
    results = []
    for name in args.profiles:
        res = run_one(name, args.cold, extra_env, args.flag)
        print(json.dumps(res), flush=True)
        results.append(res)
    if args.out:
        old = json.loads(args.out.read_text()) if args.out.exists() else []
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_name(args.out.name + ".partial")
        tmp.write_text(json.dumps(old + results, indent=2) + "\n")
        os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
