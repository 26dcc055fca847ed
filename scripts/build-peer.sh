#!/usr/bin/env bash
# Stock llama.cpp as the peer for benchmarks: llama-server and llama-bench built from the same pinned
# upstream tree page-local patches (csrc/UPSTREAM), *without* page-local's patch, for this machine
# (-march=native, as page-local's own build). Used by `page-local bench decode/chat/serve --peer-bin`.
#   scripts/build-peer.sh [BUILD_DIR]     (default: build-peer/; `make peer-server` runs it)
# Needs the venv's cmake and ninja (make setup) and the cached sdist (the native build fetched it).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root/build-peer}"
cache="${PAGE_CACHE_DIR:-$HOME/.cache/page-local}"
export PATH="$root/.venv/bin:$PATH"           # cmake, ninja and ccache come from the venv (make setup)
export CCACHE_DIR="${CCACHE_DIR:-$cache/ccache}"
version="$(sed -n 's/^version=//p' "$root/csrc/UPSTREAM")"
sdist="$cache/llama_cpp_python-$version.tar.gz"
if [ ! -f "$sdist" ]; then
    echo "build-peer: $sdist is missing; run 'make setup' first (it downloads the pinned sdist)" >&2
    exit 2
fi
src="$out/src/llama_cpp_python-$version/vendor/llama.cpp"
if [ ! -f "$src/CMakeLists.txt" ]; then
    rm -rf "$out/src" && mkdir -p "$out/src"
    tar -xzf "$sdist" -C "$out/src"
fi
# as page-local's own build: -march=native without AMX (its kernels crash with SIGILL on Xeons that report it)
noamx=""
if [ "$(uname -m)" = x86_64 ]; then
    for f in amx-tile amx-int8 amx-bf16 amx-fp16 amx-complex; do
        if echo 'int main(void){return 0;}' | cc -x c -mno-$f -o /dev/null - 2>/dev/null; then noamx="$noamx -mno-$f"; fi
    done
fi
cmake -S "$src" -B "$out/cmake" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_C_FLAGS="$noamx" -DCMAKE_CXX_FLAGS="$noamx" \
    -DGGML_NATIVE=ON -DGGML_CCACHE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_APP=OFF -DBUILD_SHARED_LIBS=OFF >/dev/null
cmake --build "$out/cmake" -j "${JOBS:-$(nproc)}" --target llama-server llama-bench
mkdir -p "$out/bin"
cp "$out/cmake/bin/llama-server" "$out/cmake/bin/llama-bench" "$out/bin/"
echo "build-peer: $out/bin/llama-server, $out/bin/llama-bench (llama.cpp $(sed -n 's/^llama_cpp_commit=//p' "$root/csrc/UPSTREAM"), unpatched)"
