#!/usr/bin/env bash
# GPU fp32 mode check for the layer-streamed DeepSeek-V4.1 oracle (run on a CUDA machine, e.g. an H200):
# generates the tiny and tiny-large checkpoints, scores one random panel on --device cpu and --device cuda
# (TF32 off, deterministic algorithms, CUBLAS_WORKSPACE_CONFIG=:4096:8), twice on cuda, and prints per
# checkpoint and precision: max relative difference cpu vs cuda (full-vocab logprobs, logsumexp), top-1
# agreement, cuda run-to-run bit-identity, and the speed ratio (cpu panel time / cuda panel time).
#
#   bash scripts/gpu_oracle_check.sh [WORKDIR] [N_SEQS] [N_TOKENS]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
py="${PYTHON:-$root/.venv/bin/python}"
dir="${1:-/tmp/ds41-gpu-oracle-check}"
nseq="${2:-4}"
ntok="${3:-128}"
export CUBLAS_WORKSPACE_CONFIG=:4096:8
mkdir -p "$dir"
"$py" - "$dir" "$nseq" "$ntok" <<'EOF'
import json, subprocess, sys, time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, "benchmarks")
from bench_dsv41_runner import TINY_LARGE  # noqa: E402
from core.records import Record  # noqa: E402
from oracle.dsv41.checkpoint import Checkpoint  # noqa: E402
from oracle.dsv41.tiny import write_tiny_checkpoint  # noqa: E402

d, nseq, ntok = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
if not torch.cuda.is_available():
    sys.exit("gpu_oracle_check: torch sees no CUDA device")
print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
for name, over in (("tiny", {}), ("tiny-large", TINY_LARGE)):
    ck = d / name
    if not (ck / "config.json").exists():
        write_tiny_checkpoint(ck, seed=0, config_overrides=over)
    vocab = Checkpoint(ck).model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    panel = d / f"{name}-panel.json"
    panel.write_text(json.dumps([torch.randint(0, vocab, (ntok,), generator=g).tolist() for _ in range(nseq)]))
    for precision in ("fp32", "reference-bf16"):
        recs, secs = {}, {}
        for tag, device in (("cpu", "cpu"), ("cuda", "cuda"), ("cuda2", "cuda")):
            out = d / f"{name}-{precision}-{tag}.safetensors"
            t = time.perf_counter()
            subprocess.run([sys.executable, "-m", "oracle.cli", "run", "--checkpoint", str(ck), "--panel", str(panel),
                            "--out", str(out), "--precision", precision, "--device", device, "--restart",
                            "--full-logprobs", "--no-progress"], check=True)
            secs[tag] = time.perf_counter() - t
            recs[tag] = Record.load(out)
        a, b, c = recs["cpu"], recs["cuda"], recs["cuda2"]
        rel = float(np.abs(a.full_logprobs - b.full_logprobs).max() / np.abs(a.full_logprobs).max())
        lse = float(np.abs(a.logsumexp - b.logsumexp).max() / np.abs(a.logsumexp).max())
        top1 = float((a.topk_ids[:, 0] == b.topk_ids[:, 0]).mean())
        same = bool(np.array_equal(b.full_logprobs, c.full_logprobs) and np.array_equal(b.topk_ids, c.topk_ids))
        run_a, run_b = a.provenance.extra["run"]["total_s"], b.provenance.extra["run"]["total_s"]
        print(f"{name:10s} {precision:14s} max rel diff full logprobs {rel:.3e}  logsumexp {lse:.3e}  "
              f"top-1 agreement {top1:.4f}  cuda repeat bit-identical {same}  "
              f"speed cpu/cuda {run_a / run_b:.2f}x (panel {run_a:.1f}s vs {run_b:.1f}s; "
              f"process {secs['cpu']:.1f}s vs {secs['cuda']:.1f}s)")
EOF
