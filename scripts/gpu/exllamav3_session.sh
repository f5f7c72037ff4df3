#!/usr/bin/env bash
# The exllamav3 gate session on a CUDA GPU in one call (docs/EXLLAMAV3.md): sets up exllamav3 from a kit folder
# (its wheel, its prebuilt extension and the few wheels it and the harness need that the host lacks), then runs
# benchmarks/gpu_exllamav3_session.py: models + EXL3 conversions, oracle references on the GPU, the EXL3 kernel
# gate, the gate suite per profile, the KL can-fail. Results land in OUT_DIR.
#
#   bash scripts/gpu/exllamav3_session.sh OUT_DIR [KIT_DIR=.ex3kit] [WHEELS_DIR=.whl] [-- session args]
#
# KIT_DIR holds wheels/exllamav3-*.whl, wheels/*.whl (pydantic, marisa_trie, llguidance, ...) and, optionally,
# exllamav3_ext.so built for this host's torch (else exllamav3 compiles its extension at first import, ~5 min).
set -uo pipefail
out="${1:?OUT_DIR}"; kit="${2:-.ex3kit}"; whl="${3:-.whl}"
shift $(( $# < 3 ? $# : 3 )); [ "${1:-}" = "--" ] && shift
cd "$(dirname "$0")/../.."
mkdir -p "$out" /tmp/ex3 /tmp/extso /tmp/site
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
t0=$(date +%s)
python3 -m zipfile -e "$kit"/wheels/exllamav3-*.whl /tmp/ex3
extra=$(ls "$kit"/wheels/*.whl | grep -v '/exllamav3-'; ls "$whl"/*.whl 2>/dev/null)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $extra \
    > "$out/pip.log" 2>&1 || { tail -20 "$out/pip.log"; exit 3; }
[ -f "$kit/exllamav3_ext.so" ] && cp "$kit/exllamav3_ext.so" /tmp/extso/
export PYTHONPATH="/tmp/extso:/tmp/ex3:/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export DS41_CACHE="${DS41_CACHE:-/tmp/ds41cache}"
{ nvidia-smi -L; python3 -c "import torch, exllamav3.ext; print('torch', torch.__version__, 'exllamav3 ext ok')"; } \
    2>&1 | tee "$out/host.txt"
echo "setup $(( $(date +%s) - t0 )) s" | tee -a "$out/host.txt"
timeout "${SESSION_TIMEOUT:-3000}" python3 benchmarks/gpu_exllamav3_session.py --out "$out" "$@" 2>&1 | tee "$out/driver.log"
# gate results, engine records, per-profile logs (small) come back as one archive
mkdir -p /tmp/exl3-session && cp -r "$DS41_CACHE/logs" /tmp/exl3-session/engine-logs 2>/dev/null
tar -czf "$out/gates.tgz" -C /tmp/exl3-session --exclude='work-*' --exclude='ref-*' . 2>/dev/null
ls -la "$out"
