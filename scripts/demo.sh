#!/usr/bin/env bash
# README command 1: set up everything, then run the main job on the embedded default
# (SmolLM2-135M + vLLM CPU): oracle reference, engine run, gates, report.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
exec .venv/bin/ds41gate demo "$@"
