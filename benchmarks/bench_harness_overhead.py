"""Harness overhead of engine.client.score_panel against the real vLLM CPU server.

    .venv/bin/python benchmarks/bench_harness_overhead.py [--url http://127.0.0.1:PORT] [--k 20] [--repeats 2]

Without ``--url`` the vllm-cpu-fp32 profile is started through engine.launcher (and stopped). The default
panel is encoded for SmolLM2 and scored with one request in flight (concurrency 1), so the run's wall
time splits cleanly into

* engine time — the sum of HTTP round trips (httpx ``elapsed``: request sent → body received), and
* harness overhead — everything else: request building (openai client), strict JSON decoding,
  validation, canonical rows, record building, thread-pool hand-off.

The goal is overhead ≤ 5 % of engine time. On a shared 2-core machine the wall-clock overhead also holds
time the harness spent waiting for a core, so the harness's own CPU time is reported next to it. Writes benchmarks/results/harness_overhead.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.client import ClientConfig, EngineClient, EngineSource, ScoreStats, score_panel  # noqa: E402
from panels import encode_panel, load_panel  # noqa: E402


@contextlib.contextmanager
def server(url: str | None):
    if url:
        yield url.rstrip("/"), "external"
        return
    from engine.launcher import EngineServer, load_profile

    with EngineServer(load_profile("vllm-cpu-fp32")) as srv:
        yield srv.base_url, "vllm-cpu-fp32"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default=None)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "harness_overhead.json"))
    args = ap.parse_args(argv)

    panel = encode_panel(load_panel("default"), "smollm2")
    runs = []
    with server(args.url) as (url, profile):
        client = EngineClient(ClientConfig(url, "smollm2", vocab_size=49152, timeout_s=600, max_concurrency=1))
        src = EngineSource(url=url, model="smollm2", profile=profile, flags={}, precision="fp32")
        score_panel(client, panel, args.k, src, progress=False)          # warm-up (compile caches, pools)
        for _ in range(args.repeats):
            st = ScoreStats()
            t0 = time.process_time()
            rec = score_panel(client, panel, args.k, src, progress=False, stats=st)
            cpu = time.process_time() - t0
            overhead = st.wall_s - st.http_s
            runs.append({
                "wall_s": round(st.wall_s, 4), "engine_http_s": round(st.http_s, 4),
                "overhead_s": round(overhead, 4), "overhead_fraction": round(overhead / st.http_s, 5),
                "record_build_s": round(st.build_s, 4), "harness_process_cpu_s": round(cpu, 4),
                "harness_cpu_fraction": round(cpu / st.http_s, 5),
                "requests": st.requests, "positions": st.positions,
            })
            print(json.dumps(runs[-1]), flush=True)
        client.close()
    fractions = [r["overhead_fraction"] for r in runs]
    result = {
        "benchmark": "harness_overhead",
        "what": "score_panel on panel default (SmolLM2 encoding) against vLLM CPU fp32, concurrency 1; "
                "overhead = wall - sum of HTTP round trips",
        "panel": {"name": panel.panel_name, "version": panel.panel_version, "sequences": len(panel.sequences),
                  "tokens": sum(len(s.token_ids) for s in panel.sequences), "positions": runs[-1]["positions"]},
        "k": args.k, "engine_profile": profile,
        "runs": runs,
        "overhead_fraction_median": statistics.median(fractions),
        "harness_cpu_fraction_median": statistics.median(r["harness_cpu_fraction"] for r in runs),
        "load_average_1m_at_end": __import__("os").getloadavg()[0],
        "goal": 0.05, "meets_goal": statistics.median(fractions) <= 0.05,
        "machine": {"python": platform.python_version(), "cpus": __import__("os").cpu_count(),
                    "platform": platform.platform()},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"overhead {result['overhead_fraction_median']:.2%} of engine time (goal <= 5%) -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
