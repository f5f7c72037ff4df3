#!/usr/bin/env bash
# Builds the llama-cpp-python 0.3.36 engine environment outside the checkout (cached across clones).
#
# docs/engines.md §11.3: PyPI has only the sdist. A default (-march=native) build compiles AMX
# paths that die with SIGILL inside VMs that do not enable AMX state, so we build portable
# (GGML_NATIVE=OFF + explicit AVX2/FMA/F16C/BMI2) and never let pip reuse a cached native wheel
# (--no-cache-dir). The built wheel is kept under $DS41_CACHE/wheels/<key>/ where <key> hashes the
# CMake flags, so a wheel built with other flags is never picked up. The venv is ready only when
# its .ds41-ready stamp exists; a venv without the stamp is an interrupted build and is rebuilt.
#
# Prints the venv path on stdout (everything else goes to stderr). Idempotent; fast when cached.
set -euo pipefail
version="0.3.36"
cache="${DS41_CACHE:-$HOME/.cache/ds41-gates}"
cmake_args="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
key="$(printf '%s|%s' "$version" "$cmake_args" | sha256sum | cut -c1-12)"
wheel_dir="$cache/wheels/llama-cpp-python-$version-$key"
venv="$cache/venvs/llama-cpp-python-$version"
stamp="$venv/.ds41-ready"
log() { echo "[setup-llamacpp] $*" >&2; }

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ]; then echo "$venv"; exit 0; fi

mkdir -p "$cache/wheels" "$cache/venvs" "$cache/locks"
exec 9>"$cache/locks/llama-cpp-python.lock"
if ! flock -n 9; then
  log "another set-up holds $cache/locks/llama-cpp-python.lock; waiting"
  flock 9
fi
# Another process may have finished while we waited.
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ]; then echo "$venv"; exit 0; fi

py="${PYTHON:-python3.11}"; command -v "$py" >/dev/null || py=python3

find_wheel() { compgen -G "$wheel_dir/llama_cpp_python-$version-*.whl" | head -n1 || true; }
wheel="$(find_wheel)"
if [ -z "$wheel" ]; then
  log "building llama-cpp-python $version from sdist (portable flags; ~7 min on 2 cores)"
  log "CMAKE_ARGS=$cmake_args"
  tmp="$wheel_dir.partial"
  rm -rf "$tmp"
  mkdir -p "$tmp"
  t0=$(date +%s)
  CMAKE_ARGS="$cmake_args" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
    "$py" -m pip wheel --no-deps --no-cache-dir --no-binary llama-cpp-python \
      "llama-cpp-python==$version" -w "$tmp" 1>&2
  built="$(compgen -G "$tmp/llama_cpp_python-$version-*.whl" | head -n1 || true)"
  if [ -z "$built" ]; then log "ERROR: pip wheel produced no llama_cpp_python wheel in $tmp"; exit 1; fi
  printf '%s\n' "$cmake_args" > "$tmp/CMAKE_ARGS"
  rm -rf "$wheel_dir"
  mv "$tmp" "$wheel_dir"
  log "built wheel in $(( $(date +%s) - t0 )) s"
  wheel="$(find_wheel)"
else
  log "using cached wheel $wheel"
fi

log "creating venv $venv"
rm -rf "$venv"
"$py" -m venv "$venv"
"$venv/bin/pip" install -q --no-cache-dir --find-links "$wheel_dir" "${wheel}[server]" openai 1>&2
# The installed package must be the portable wheel we built, never a rebuilt one.
"$venv/bin/python" - "$version" 1>&2 <<'EOF'
import sys, llama_cpp
want = sys.argv[1]
if llama_cpp.__version__ != want:
    raise SystemExit(f"llama_cpp {llama_cpp.__version__} installed, expected {want}")
import llama_cpp.server.app  # the [server] extra imports
print("llama_cpp", llama_cpp.__version__, "system_info:", llama_cpp.llama_print_system_info().decode())
EOF
printf '%s\n' "$key" > "$stamp.tmp"
mv "$stamp.tmp" "$stamp"
log "ready: $venv"
echo "$venv"
