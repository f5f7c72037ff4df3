"""Wall time to score the default panel through llama.cpp engines (and any other profile).

    .venv/bin/python benchmarks/bench_llama_scoring.py llama-server-f32 llama-server-q4_1 [llamacpp-f32 ...]

Each profile is started through engine.launcher (start-up not counted), the default panel is encoded
for SmolLM2 and scored exactly as the demo does (engine.endpoint.score_engine, k = 20, concurrency 1);
the scoring wall time, the number of HTTP requests, the summed round-trip time, the sequences and
positions scored and the ambiguous positions are written to benchmarks/results/llama_scoring.json
(merged by profile, so profiles can be measured in separate runs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.atomic import write_json_atomic  # noqa: E402
from ds41gates import pipeline  # noqa: E402
from engine.client import ScoreStats  # noqa: E402
from engine.endpoint import DEFAULT_ENGINE_K, endpoint_for_server, score_engine  # noqa: E402
from engine.launcher import EngineServer, load_profile  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "llama_scoring.json"


def measure(profile_name: str, k: int) -> dict:
    model_dir = pipeline.default_model_dir()
    encoded = pipeline.encode_default_panel(pipeline.DEFAULT_PANEL, model_dir)
    prof = load_profile(profile_name)
    t_start = time.perf_counter()
    with EngineServer(prof) as server:
        started_s = time.perf_counter() - t_start
        stats = ScoreStats()
        load0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        rec = score_engine(endpoint_for_server(server, prof, model_dir), encoded, k, stats=stats)
        wall = time.perf_counter() - t0
        load1 = os.getloadavg()[0]
    return {
        "profile": profile_name, "engine": prof.engine, "k": k,
        "score_wall_s": round(wall, 2), "start_s": round(started_s, 2),
        "requests": stats.requests, "http_s": round(stats.http_s, 2),
        "sequences": stats.sequences, "positions": stats.positions, "ambiguous": stats.ambiguous,
        "excluded_sequences": sorted(rec.provenance.extra.get("excluded_sequences", {})),
        "loadavg_1min_before_after": [round(load0, 2), round(load1, 2)],
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profiles", nargs="+")
    ap.add_argument("--k", type=int, default=DEFAULT_ENGINE_K)
    args = ap.parse_args()
    results = json.loads(OUT.read_text())["runs"] if OUT.exists() else {}
    for name in args.profiles:
        row = measure(name, args.k)
        print(json.dumps(row), flush=True)
        results[name] = row
        write_json_atomic(OUT, {"host": platform.node(), "cpus": os.cpu_count(), "runs": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
