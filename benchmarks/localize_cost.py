"""The yardstick of the localizer's cost: ONE oracle forward and ONE engine forward of the same prompt, each with
its own start-up, as whole processes (the localizer's command is timed the same way beside it):

    A: .venv/bin/ds41gate localize --engine-profile vllm-cpu-fp32 \\
           --prompt-file benchmarks/data/localize_prompt.txt --max-prompt-tokens 512 --out /tmp/loc-cost
    B: .venv/bin/python benchmarks/localize_cost.py --max-prompt-tokens 512

B: the transformers oracle (oracle/hf.py, fp32) loads SmolLM2 and runs one forward of the prompt; the engine
(vLLM CPU, the profile's arguments) starts in its own venv through the localizer's runner with no hooks, no fault
plugin state and no decode step, and runs one prefill of the same ids. docs/BENCHMARKS.md quotes A/B."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ds41gates.localize import oracle_for, prompt_ids  # noqa: E402
from engine.localize import engine_invocation, run_engine_captures  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default="vllm-cpu-fp32")
    ap.add_argument("--prompt-file", default=str(ROOT / "benchmarks" / "data" / "localize_prompt.txt"))
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    a = ap.parse_args()
    ids, _ = prompt_ids(a.profile, prompt=Path(a.prompt_file).read_text(encoding="utf-8"),
                        max_tokens=a.max_prompt_tokens)
    t0 = time.perf_counter()
    from oracle.hf import HFOracle

    _, model_dir, _ = oracle_for(a.profile)
    HFOracle.load(model_dir, threads=1).logits(ids)
    t1 = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        rep = run_engine_captures(engine_invocation(a.profile), ids, [{"name": "plain", "perturb": "env"}],
                                  Path(work), decode=False, sites=[])
    print(f"{len(ids)} tokens: oracle load+forward {t1 - t0:.1f} s; engine process {rep['wall_s']:.1f} s "
          f"(load {rep['load_s']:.1f} s, forward {rep['cases']['plain']['generate_s']:.2f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
