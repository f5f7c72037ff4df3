#!/usr/bin/env bash
# README command 2: set up everything, then run the project's tests and the gate suite
# against the real vLLM CPU server. pytest's exit code 5 ("no tests ran") fails this script too.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
export DS41_REQUIRE_ENGINES=1   # engine tests must run here, never skip
.venv/bin/python -m pytest tests gates -m "not gpu and not reference and not long" "$@"
