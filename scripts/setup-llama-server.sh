#!/usr/bin/env bash
# Builds the llama.cpp tree vendored in the llama-cpp-python 0.3.36 sdist (vendor/llama.cpp, docs
# engines.md §11.4) ONCE, outside the checkout and cached across clones, for both llama.cpp engines:
#   bin/llama-server      llama.cpp's own C++ server (profiles llama-server-*);
#   lib/lib*.so*          the shared libraries (llama, ggml, ggml-base, ggml-cpu, mtmd, and the server's
#                         own), which scripts/setup-llamacpp.sh places into the llama-cpp-python package
#                         (profiles llamacpp-*) instead of compiling the same tree a second time.
# One build of one source, so the Python bindings and the server share the ABI by construction.
#
# Portable flags: a -march=native build compiles AMX paths that die with SIGILL in VMs without AMX state.
# Shared libraries with RPATH $ORIGIN/../lib, so bin/llama-server finds lib/ wherever the install dir is
# moved, and each library finds its siblings in any directory named lib (here, or llama_cpp/lib in the
# venv). No curl/OpenSSL (the harness only loads local GGUFs); only the targets named below.
#
# The sdist is kept under $DS41_CACHE/sdists/ and checked against its pinned sha256; the install dir is
# $DS41_CACHE/engines/llama-server-<version>/ and is ready only when its .ds41-ready stamp holds the key
# (sdist hash + CMake flags), written last, so a build from another sdist or with other flags is never
# picked up and an interrupted build is redone.
#
# Prints the path of the llama-server binary on stdout (everything else on stderr). Idempotent.
# `setup-llama-server.sh --sdist` only fetches/verifies the pinned sdist and prints its path.
set -euo pipefail
version="0.3.36"
sdist_name="llama_cpp_python-$version.tar.gz"
sdist_sha256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
cache="${DS41_CACHE:-$HOME/.cache/ds41-gates}"
cmake_args=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON
  '-DCMAKE_INSTALL_RPATH=$ORIGIN/../lib' -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON)
# llama-server, plus every library llama-cpp-python 0.3.36 loads (llama_cpp.py: llama; _ggml.py: ggml;
# mtmd_cpp.py: mtmd, imported by the multimodal chat handlers) and what they link (ggml-base, ggml-cpu).
targets=(llama-server llama ggml ggml-base ggml-cpu mtmd)
python_libs=(libllama.so libggml.so libggml-base.so libggml-cpu.so libmtmd.so)
key="$(printf '%s|%s|%s' "$sdist_sha256" "${cmake_args[*]}" "${targets[*]}" | sha256sum | cut -c1-12)"
dest="$cache/engines/llama-server-$version"
binary="$dest/bin/llama-server"
stamp="$dest/.ds41-ready"
jobs="${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
log() { echo "[setup-llama-server] $*" >&2; }

sdist="$cache/sdists/$sdist_name"
fetch_sdist() {
  mkdir -p "$cache/sdists"
  if [ ! -f "$sdist" ]; then
    local py="${PYTHON:-python3.11}"; command -v "$py" >/dev/null || py=python3
    log "downloading the llama-cpp-python $version sdist"
    local dl="$cache/sdists/.partial-$$"
    rm -rf "$dl"; mkdir -p "$dl"
    "$py" -m pip download --no-deps --no-binary :all: --no-cache-dir "llama-cpp-python==$version" -d "$dl" 1>&2
    if [ ! -f "$dl/$sdist_name" ]; then log "ERROR: pip download left no $sdist_name in $dl"; exit 1; fi
    mv "$dl/$sdist_name" "$sdist"
    rm -rf "$dl"
  fi
  local got; got="$(sha256sum "$sdist" | cut -d' ' -f1)"
  if [ "$got" != "$sdist_sha256" ]; then
    log "ERROR: $sdist has sha256 $got, expected $sdist_sha256 (delete it to download again)"
    exit 1
  fi
}
if [ "${1:-}" = "--sdist" ]; then fetch_sdist; echo "$sdist"; exit 0; fi

ready() {
  [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ] && [ -x "$binary" ] || return 1
  local lib; for lib in "${python_libs[@]}"; do [ -e "$dest/lib/$lib" ] || return 1; done
}
if ready; then echo "$binary"; exit 0; fi

mkdir -p "$cache/engines" "$cache/locks"
exec 9>"$cache/locks/llama-server.lock"
if ! flock -n 9; then
  log "another set-up holds $cache/locks/llama-server.lock; waiting"
  flock 9
fi
if ready; then echo "$binary"; exit 0; fi

fetch_sdist

work="$cache/engines/.build-llama-server-$key"
rm -rf "$work"; mkdir -p "$work"
trap 'rm -rf "$work"' EXIT
log "building llama-server + shared libraries from $sdist_name vendor/llama.cpp (portable flags, -j$jobs; ~6 min on 2 cores)"
log "cmake ${cmake_args[*]}"
t0=$(date +%s)
tar -xzf "$sdist" -C "$work" "llama_cpp_python-$version/vendor/llama.cpp"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
cmake -S "$src" -B "$work/build" "${cmake_args[@]}" 1>&2
cmake --build "$work/build" --target "${targets[@]}" -j "$jobs" 1>&2
if [ ! -x "$work/build/bin/llama-server" ]; then log "ERROR: the build produced no $work/build/bin/llama-server"; exit 1; fi

# Install bin/ + lib/ (symlinks kept: libllama.so -> libllama.so.0 -> ...) next to the final place, then
# swap it in; the stamp is written last.
rm -rf "$dest.partial"
mkdir -p "$dest.partial/bin" "$dest.partial/lib"
cp -a "$work/build/bin/llama-server" "$dest.partial/bin/"
cp -a "$work/build/bin/"lib*.so* "$dest.partial/lib/"
for lib in "${python_libs[@]}"; do
  if [ ! -e "$dest.partial/lib/$lib" ]; then log "ERROR: the build produced no $lib"; exit 1; fi
done
rm -rf "$dest"
mv "$dest.partial" "$dest"
# The installed binary must start with only its own lib/ (no LD_LIBRARY_PATH, no build tree): a missing
# library or a build that compiled an unsupported instruction set fails here, not in a run.
env -u LD_LIBRARY_PATH "$binary" --version 1>&2
deps="$(env -u LD_LIBRARY_PATH ldd "$binary")"
own="$(awk '$1 ~ /^lib(llama|ggml|mtmd)/ {print $3}' <<<"$deps" | xargs -r realpath | xargs -r -n1 dirname | sort -u)"
if grep -q 'not found' <<<"$deps" || [ "$own" != "$(realpath "$dest/lib")" ]; then
  printf '%s\n' "$deps" >&2
  log "ERROR: $binary does not resolve its libraries from $dest/lib alone"; exit 1
fi
printf '%s\n' "${cmake_args[*]}" > "$dest/CMAKE_ARGS"
printf '%s\n' "$key" > "$stamp.tmp"
mv "$stamp.tmp" "$stamp"
log "built in $(( $(date +%s) - t0 )) s: $binary (+ $(ls "$dest/lib" | wc -l) files in $dest/lib)"
echo "$binary"
