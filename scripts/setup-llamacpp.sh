#!/usr/bin/env bash
# Builds the llama-cpp-python 0.3.36 engine environment outside the checkout (cached across clones).
#
# docs/engines.md §11.3: PyPI has only the sdist. A default (-march=native) build compiles AMX
# paths that die with SIGILL inside VMs that do not enable AMX state, so the native code is built
# portable (GGML_NATIVE=OFF + explicit AVX2/FMA/F16C/BMI2). It is not compiled here: the package's
# shared libraries (libllama, libggml*, libmtmd) are the ones scripts/setup-llama-server.sh builds from
# the llama.cpp tree vendored in the same pinned sdist, together with the C++ llama-server. This script
# installs the Python package from that very sdist with LLAMA_BUILD=OFF/LLAVA_BUILD=OFF (scikit-build-core
# configures an empty CMake project and compiles nothing), refuses a package that ships its own libraries,
# and copies the built libraries into the package's llama_cpp/lib, where llama_cpp loads them. One source,
# one build: the bindings and the libraries cannot disagree on the ABI.
#
# The venv is ready only when its .ds41-ready stamp holds the key (version + the llama.cpp build's key,
# which hashes the sdist and its CMake flags), written last: a venv from another build, or an interrupted
# one, is rebuilt.
#
# Prints the venv path on stdout (everything else goes to stderr). Idempotent; fast when cached.
set -euo pipefail
version="0.3.36"
here="$(cd "$(dirname "$0")" && pwd)"
cache="${DS41_CACHE:-$HOME/.cache/ds41-gates}"
pip_cmake_args="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF"
venv="$cache/venvs/llama-cpp-python-$version"
stamp="$venv/.ds41-ready"
log() { echo "[setup-llamacpp] $*" >&2; }

# The one llama.cpp build (cached; builds on first use) and its key.
binary="$(bash "$here/setup-llama-server.sh")"
build="$(dirname "$(dirname "$binary")")"
build_key="$(cat "$build/.ds41-ready")"
key="$(printf '%s|%s|%s' "$version" "$build_key" "$pip_cmake_args" | sha256sum | cut -c1-12)"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ]; then echo "$venv"; exit 0; fi

mkdir -p "$cache/venvs" "$cache/locks"
exec 9>"$cache/locks/llama-cpp-python.lock"
if ! flock -n 9; then
  log "another set-up holds $cache/locks/llama-cpp-python.lock; waiting"
  flock 9
fi
# Another process may have finished while we waited.
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ]; then echo "$venv"; exit 0; fi

py="${PYTHON:-python3.11}"; command -v "$py" >/dev/null || py=python3
sdist="$(bash "$here/setup-llama-server.sh" --sdist)"   # the pinned, sha256-checked sdist the libraries came from

t0=$(date +%s)
log "creating venv $venv"
rm -rf "$venv"
"$py" -m venv "$venv"
log "installing llama-cpp-python $version from $sdist without its C++ build (CMAKE_ARGS=$pip_cmake_args)"
CMAKE_ARGS="$pip_cmake_args" "$venv/bin/pip" install -q --no-cache-dir "${sdist}[server]" openai 1>&2
pkg="$("$venv/bin/python" -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("llama_cpp").origin))')"
if [ -n "$(find "$pkg" \( -name '*.so' -o -name '*.so.*' \) -print -quit)" ]; then
  log "ERROR: the installed package $pkg ships native libraries of its own (was it built with LLAMA_BUILD on?)"
  exit 1
fi
# Copy under a shared lock on the build, so a concurrent rebuild cannot swap lib/ under us.
exec 8>"$cache/locks/llama-server.lock"
flock -s 8
if [ "$(cat "$build/.ds41-ready" 2>/dev/null)" != "$build_key" ]; then
  log "ERROR: the llama.cpp build in $build changed while installing; run again"; exit 1
fi
mkdir -p "$pkg/lib"
cp -a "$build/lib/." "$pkg/lib/"
exec 8>&-
# The installed package must load the libraries we built (and nothing from elsewhere).
"$venv/bin/python" - "$version" "$pkg/lib" 1>&2 <<'PY'
import os, sys
os.environ.pop("LLAMA_CPP_LIB_PATH", None)
import llama_cpp
want, libdir = sys.argv[1], os.path.realpath(sys.argv[2])
if llama_cpp.__version__ != want:
    raise SystemExit(f"llama_cpp {llama_cpp.__version__} installed, expected {want}")
import llama_cpp.server.app  # the [server] extra imports
import llama_cpp.mtmd_cpp    # libmtmd, loaded lazily by the multimodal chat handlers
loaded = {os.path.realpath(l.split()[-1]) for l in open("/proc/self/maps") if "/lib" in l and (" /" in l)}
ours = sorted(p for p in loaded if os.path.basename(p).startswith(("libllama", "libggml", "libmtmd")))
stray = [p for p in ours if os.path.dirname(p) != libdir]
if stray or not ours:
    raise SystemExit(f"llama_cpp loaded {ours}; expected only files under {libdir}")
print("llama_cpp", llama_cpp.__version__, "libs:", [os.path.basename(p) for p in ours])
print("system_info:", llama_cpp.llama_print_system_info().decode())
PY
printf '%s\n' "$key" > "$stamp.tmp"
mv "$stamp.tmp" "$stamp"
log "installed in $(( $(date +%s) - t0 )) s, libraries from $build/lib"
log "ready: $venv"
echo "$venv"
