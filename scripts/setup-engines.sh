#!/usr/bin/env bash
# Sets up the real engine stack under ${DS41_CACHE:-~/.cache/ds41-gates} (used by scripts/setup.sh,
# hence CI and the demo): the vLLM CPU venv, the llama-cpp-python venv (portable build, wheel
# cached), llama.cpp's C++ llama-server (portable build, binary cached), and the SmolLM2 model in its
# three forms. Idempotent; a few seconds when all is cached.
# Needs the harness venv (.venv) for the model conversion: run scripts/setup-harness.sh first.
# Prints the cache paths as KEY=VALUE lines on stdout; progress goes to stderr.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
if [ ! -x .venv/bin/python ]; then
  echo "[setup-engines] $root/.venv is missing; run scripts/setup-harness.sh first" >&2
  exit 1
fi
# vLLM and the llama.cpp build each take most of the 2 cores: run them one after the other.
vllm_venv="$(bash scripts/setup-vllm.sh)"
llama_venv="$(bash scripts/setup-llamacpp.sh)"
llama_server="$(bash scripts/setup-llama-server.sh)"
echo "cache=${DS41_CACHE:-$HOME/.cache/ds41-gates}"
echo "vllm_python=$vllm_venv/bin/python"
echo "llama_python=$llama_venv/bin/python"
echo "llama_server=$llama_server"
.venv/bin/python -m engine.models
