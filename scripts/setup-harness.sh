#!/usr/bin/env bash
# Creates (or refreshes) the harness virtual environment at .venv/ in the repo root.
# Idempotent: a stamp holding the hash of pyproject.toml skips the install when nothing changed.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null || py=python3
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
stamp=".venv/.ds41-installed"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
# torch first and pinned: a range would pull a multi-GB CUDA build (docs/engines.md §11.2).
.venv/bin/pip install -q "torch==2.13.0"
.venv/bin/pip install -q -e ".[dev,cluster]"
echo "$want" > "$stamp"
