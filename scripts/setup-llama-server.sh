#!/usr/bin/env bash
# Builds llama.cpp's own C++ `llama-server` from the llama.cpp tree vendored in the llama-cpp-python
# 0.3.36 sdist (vendor/llama.cpp, docs engines.md §11.4), outside the checkout and cached across clones.
#
# The same portable flags as the llama-cpp-python wheel (scripts/setup-llamacpp.sh): a -march=native
# build compiles AMX paths that die with SIGILL in VMs without AMX state. Static libraries, so the
# installed binary is one relocatable file with no RPATH into a build tree. No curl/OpenSSL (the harness
# only loads local GGUFs), only the server target.
#
# The sdist is kept under $DS41_CACHE/sdists/ and checked against its pinned sha256; the install dir is
# $DS41_CACHE/engines/llama-server-<version>/ and is ready only when its .ds41-ready stamp holds the key
# (sdist hash + CMake flags), so a build from another sdist or with other flags is never picked up and an
# interrupted build is redone.
#
# Prints the path of the llama-server binary on stdout (everything else on stderr). Idempotent.
set -euo pipefail
version="0.3.36"
sdist_name="llama_cpp_python-$version.tar.gz"
sdist_sha256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
cache="${DS41_CACHE:-$HOME/.cache/ds41-gates}"
cmake_args=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON)
key="$(printf '%s|%s' "$sdist_sha256" "${cmake_args[*]}" | sha256sum | cut -c1-12)"
dest="$cache/engines/llama-server-$version"
binary="$dest/bin/llama-server"
stamp="$dest/.ds41-ready"
jobs="${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
log() { echo "[setup-llama-server] $*" >&2; }

ready() { [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ] && [ -x "$binary" ]; }
if ready; then echo "$binary"; exit 0; fi

mkdir -p "$cache/sdists" "$cache/engines" "$cache/locks"
exec 9>"$cache/locks/llama-server.lock"
if ! flock -n 9; then
  log "another set-up holds $cache/locks/llama-server.lock; waiting"
  flock 9
fi
if ready; then echo "$binary"; exit 0; fi

sdist="$cache/sdists/$sdist_name"
if [ ! -f "$sdist" ]; then
  py="${PYTHON:-python3.11}"; command -v "$py" >/dev/null || py=python3
  log "downloading the llama-cpp-python $version sdist"
  dl="$cache/sdists/.partial-$$"
  rm -rf "$dl"; mkdir -p "$dl"
  "$py" -m pip download --no-deps --no-binary :all: --no-cache-dir "llama-cpp-python==$version" -d "$dl" 1>&2
  if [ ! -f "$dl/$sdist_name" ]; then log "ERROR: pip download left no $sdist_name in $dl"; exit 1; fi
  mv "$dl/$sdist_name" "$sdist"
  rm -rf "$dl"
fi
got="$(sha256sum "$sdist" | cut -d' ' -f1)"
if [ "$got" != "$sdist_sha256" ]; then
  log "ERROR: $sdist has sha256 $got, expected $sdist_sha256 (delete it to download again)"
  exit 1
fi

work="$cache/engines/.build-llama-server-$key"
rm -rf "$work"; mkdir -p "$work"
trap 'rm -rf "$work"' EXIT
log "building llama-server from $sdist_name vendor/llama.cpp (portable flags, -j$jobs; ~7 min on 2 cores)"
log "cmake ${cmake_args[*]}"
t0=$(date +%s)
tar -xzf "$sdist" -C "$work" "llama_cpp_python-$version/vendor/llama.cpp"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
cmake -S "$src" -B "$work/build" "${cmake_args[@]}" 1>&2
cmake --build "$work/build" --target llama-server -j "$jobs" 1>&2
built="$work/build/bin/llama-server"
if [ ! -x "$built" ]; then log "ERROR: the build produced no $built"; exit 1; fi
# The binary must start here: a build that compiled an unsupported instruction set fails this, not a run.
"$built" --version 1>&2

rm -rf "$dest"
mkdir -p "$dest/bin"
cp "$built" "$dest/bin/llama-server.partial"
mv "$dest/bin/llama-server.partial" "$binary"
printf '%s\n' "${cmake_args[*]}" > "$dest/CMAKE_ARGS"
printf '%s\n' "$key" > "$stamp.tmp"
mv "$stamp.tmp" "$stamp"
log "built in $(( $(date +%s) - t0 )) s: $binary"
echo "$binary"
