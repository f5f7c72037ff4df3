#!/usr/bin/env bash
# The release-size layer benchmark on a CUDA host (one call): writes the generated release-size checkpoint
# on that machine's disk (nothing large travels), runs every stage on the CPU (all host cores) and then on
# the GPU, and compares them. Needs .bench/ (benchmarks/bench_dsv41_release_layers.py prepare, run where the
# deepseek tokenizer is installed).
#
#   bash scripts/gpu/release_layers.sh OUT_DIR [EXPERTS] [SEQS] [EXL3_EXPERTS]
set -uo pipefail
out="${1:?OUT_DIR}"; experts="${2:-48}"; seqs="${3:-5}"; exl3="${4:-8}"
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
mkdir -p "$out"
{ nvidia-smi -L; lscpu | grep -E "^Model name|^CPU\(s\)|^Thread|^Flags" | cut -c1-300; free -g; df -h /tmp; \
  python3 -c "import torch, numba, safetensors; print(torch.__version__, numba.__version__, safetensors.__version__)"; \
} 2>&1 | tee "$out/host.txt"
python3 benchmarks/bench_dsv41_release_layers.py run --device cuda --compare-cpu --threads "$(nproc)" \
    --experts "$experts" --dspark-experts 16 --exl3-experts "$exl3" --seqs "$seqs" --work /tmp/ds41-release-layers \
    --out "$out/dsv41_release_layers_h200.json" 2>&1 | tee "$out/release_layers_h200.log"
