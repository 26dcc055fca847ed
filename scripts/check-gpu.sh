#!/usr/bin/env bash
# Build page-local's CUDA variant and check it with every layer on the GPU.
#
#   scripts/check-gpu.sh            # from anywhere; needs nvcc, an NVIDIA GPU and the checkout's .venv
#
# 1. configures and builds the patched library with -DPAGE_BACKEND=cuda into its own folder
#    (build-cuda/, beside the CPU build in build/; ccache makes a second run fast);
# 2. checks that this library sees a CUDA device (llama_supports_gpu_offload) and offloads to it;
# 3. runs the native, probe-fidelity, compaction, verify and engine tests against it with every
#    layer offloaded (PAGE_LOCAL_N_GPU_LAYERS=all: Model/Engine's default honours it);
# 4. prints `page-local bench probe` (probe overhead) and `bench decode` (decode speed-up after
#    eviction) with --json, and keeps the JSON in build-cuda/check-gpu/ for docs/benchmarks.md.
#    The probe against a float64 CPU reference is what tests/test_probe_fidelity.py checks in step 3.
#
# Environment: BUILD_DIR (default build-cuda), JOBS (default nproc), CUDA_ARCH (CMAKE_CUDA_ARCHITECTURES,
# default ggml's: the local GPU with GGML_NATIVE), PYTEST_ARGS (extra pytest options), BENCH_ARGS
# (extra options for both benchmarks, e.g. "--repeats 5").
# Exit codes: 0 all passed; 1 a check failed; 2 nothing was built (no nvcc, no CUDA device, no .venv).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BUILD_DIR="${BUILD_DIR:-build-cuda}"
JOBS="${JOBS:-$(nproc 2>/dev/null || echo 2)}"
CACHE="${HOME}/.cache/page-local"
VENV="$ROOT/.venv"
OUT="$BUILD_DIR/check-gpu"

die() { echo "check-gpu: error: $*" >&2; exit "${2:-2}"; }
step() { echo; echo "== check-gpu: $*"; }

# --- prerequisites: say what is missing before anything is built -----------------------------------
[ -x "$VENV/bin/python" ] || die "no Python environment at $VENV: run \`make setup\` first"
export PATH="$VENV/bin:$PATH"  # cmake, ninja and ccache come from the venv, as in the Makefile
if ! command -v nvcc >/dev/null 2>&1; then
    for d in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda; do
        if [ -n "$d" ] && [ -x "$d/bin/nvcc" ]; then export PATH="$d/bin:$PATH"; break; fi
    done
fi
command -v nvcc >/dev/null 2>&1 \
    || die "nvcc (the CUDA compiler) was not found on PATH, in \$CUDA_HOME or /usr/local/cuda: install the CUDA toolkit; this machine cannot build the CUDA variant"
command -v nvidia-smi >/dev/null 2>&1 \
    || die "nvidia-smi was not found: no NVIDIA driver on this machine, so there is no CUDA device to offload to"
GPUS="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)"
[ "${GPUS:-0}" -ge 1 ] || die "nvidia-smi lists no GPU (driver loaded but no device visible; check CUDA_VISIBLE_DEVICES)"
echo "check-gpu: $(nvcc --version | tail -n 1); $(nvidia-smi -L | head -n 1)$( [ "$GPUS" -gt 1 ] && echo " (+$((GPUS - 1)) more)")"

# --- 1. build ----------------------------------------------------------------------------------------
step "building the CUDA variant in $BUILD_DIR (-j $JOBS)"
export CCACHE_DIR="${CCACHE_DIR:-$CACHE/ccache}"
if [ ! -f "$BUILD_DIR/build.ninja" ] || ! grep -q "^PAGE_BACKEND:STRING=cuda$" "$BUILD_DIR/CMakeCache.txt"; then
    cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPAGE_BACKEND=cuda \
        -DPAGE_CACHE_DIR="$CACHE" -DPython3_EXECUTABLE="$VENV/bin/python" \
        ${CUDA_ARCH:+-DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCH"}
fi
cmake --build "$BUILD_DIR" -j "$JOBS"
LIB_DIR="$ROOT/$BUILD_DIR/bin"
[ -f "$LIB_DIR/libllama.so" ] || die "the build finished without $LIB_DIR/libllama.so" 1
ls "$LIB_DIR"/libggml-cuda.so* >/dev/null 2>&1 || die "$LIB_DIR has no libggml-cuda.so: GGML_CUDA was not built" 1

# every later step loads this library, with every layer offloaded
export PAGE_LOCAL_LIB_DIR="$LIB_DIR" LLAMA_CPP_LIB_PATH="$LIB_DIR" PAGE_LOCAL_N_GPU_LAYERS=all
unset PAGE_LOCAL_VERBOSE

# --- 2. the library offloads -------------------------------------------------------------------------
step "device"
python - <<'EOF' || die "the CUDA build does not offload (see above)" 1
import sys
from page_local.store import models
from page_local.native.runtime import Context, ContextConfig, Model, gpu_devices, supports_gpu_offload
if not supports_gpu_offload() or not gpu_devices():
    sys.exit("llama_supports_gpu_offload() is false or no GPU device is listed: the library sees no CUDA device")
print("GPU devices:", "; ".join(gpu_devices()))
with Model(models.smollm2_path()) as m, Context(m, ContextConfig(n_ctx=256)) as c:
    p = c.placement()
    print("SmolLM2 with PAGE_LOCAL_N_GPU_LAYERS=all:", p)
    if p["gpu_layers"] != m.n_layer or p["layers"] == "CPU" or p["kv_cache"] == "CPU":
        sys.exit(f"not every layer is on the GPU: {p}")
EOF

# --- 3. tests with every layer offloaded ----------------------------------------------------------------
step "tests (every layer on the GPU)"
TESTS=(tests/test_native.py tests/test_probe_fidelity.py tests/test_compact.py tests/test_verify.py tests/test_engine.py)
test_rc=0
python -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-} "${TESTS[@]}" || test_rc=$?

# --- 4. figures -----------------------------------------------------------------------------------------
mkdir -p "$OUT"
step "bench probe (prefill with the probe armed vs unarmed)"
bench_rc=0
page-local bench probe --n-gpu-layers all --json ${BENCH_ARGS:-} | tee "$OUT/bench-probe.json" || bench_rc=$?
step "bench decode (decode tok/s after eviction vs the full cache)"
page-local bench decode --n-gpu-layers all --json ${BENCH_ARGS:-} | tee "$OUT/bench-decode.json" || bench_rc=$?

step "summary"
python - "$OUT" "$test_rc" <<'EOF' || true
import json, sys
from pathlib import Path
out, test_rc = Path(sys.argv[1]), int(sys.argv[2])
def load(name):
    try:
        return json.loads((out / name).read_text().strip().splitlines()[-1])
    except (OSError, ValueError, IndexError):
        return None
probe, dec = load("bench-probe.json"), load("bench-decode.json")
print(f"tests (native, probe fidelity vs the float64 CPU reference, compaction, verify, engine): "
      + ("passed" if test_rc == 0 else f"FAILED (pytest exit {test_rc})"))
if probe:
    print(f"probe overhead: {probe['tokens']}-token prefill, armed/unarmed = {probe['ratio']:.3f} "
          f"({probe['armed_s']:.4f} s vs {probe['unarmed_s']:.4f} s) on {probe['device']['layers']}")
if dec:
    print(f"decode after eviction: {dec['tokens']}-token prompt kept {dec['kept']}: {dec['evicted_tok_s']:.1f} vs "
          f"{dec['full_tok_s']:.1f} tok/s full cache, speed-up {dec['speedup']:.3f} "
          f"(without compaction {dec['speedup_nocompact']:.3f}); KV cache on {dec['device']['kv_cache']}")
print(f"JSON: {out}/bench-probe.json, {out}/bench-decode.json")
EOF

[ "$test_rc" -eq 0 ] || die "tests failed with every layer on the GPU (pytest exit $test_rc)" 1
[ "$bench_rc" -eq 0 ] || die "a benchmark failed (exit $bench_rc)" 1
echo "check-gpu: all passed"
