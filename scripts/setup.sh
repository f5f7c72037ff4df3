#!/usr/bin/env bash
# All set-up for a fresh machine, idempotent and fast when cached:
# the harness venv (.venv), the engine environments and the converted SmolLM2 model
# (both cached under ${DS41_CACHE:-~/.cache/ds41-gates}).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
bash scripts/setup-harness.sh
if [ -f scripts/setup-engines.sh ]; then
  bash scripts/setup-engines.sh
else
  bash scripts/setup-vllm.sh >/dev/null
fi
bash scripts/setup-evals.sh
