"""Shared fixtures: the real patched library and real GGUF models (embedded SmolLM2, tiny f32 models)."""

from __future__ import annotations

import os
import tempfile

# `make test` runs test files in parallel processes (pytest-xdist). llama.cpp's CPU threads meet at an
# OpenMP barrier after every op; libgomp's waiting threads spin by default, and with two processes' threads
# on 2 cores a spinning waiter holds the core its peer needs (a decode step then takes 10-100x as long).
# Passive waiting sleeps instead. Set before the library is first loaded (nothing loads it at import);
# servers and other children inherit it. No test is timed, so what it costs a single process does not matter.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# A user's first run on a model measures the attention paths once (engine/attention.py first_use, up to
# 30 s); the suite's engines skip it (tests/test_attention.py runs it on purpose).
os.environ.setdefault("PAGE_LOCAL_AUTOTUNE", "off")
# the disk cache of prompt prefixes (chat, run and serve keep long prompts on disk by default): one folder per run,
# never the user's
os.environ.setdefault("PAGE_LOCAL_KV_CACHE_DIR", tempfile.mkdtemp(prefix="page-local-kv-"))

import numpy as np
import pytest
from click.testing import CliRunner

from page_local.store import models
from page_local.cli import main
from page_local.native.runtime import Context, ContextConfig, Model


def cpu_summary() -> str:
    """The CPU this run is on: its name, family/model and the SIMD extensions the suite's figures depend on."""
    info = {}
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            k, _, v = line.partition(":")
            info.setdefault(k.strip(), v.strip())
            if not line.strip():
                break
    except OSError:
        import platform
        return platform.processor() or platform.machine()
    flags = set(info.get("flags", "").split())
    simd = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                        "amx_tile") if f in flags]
    return (f"{info.get('model name', '?')} (vendor {info.get('vendor_id', '?')}, family {info.get('cpu family', '?')} "
            f"model {info.get('model', '?')}; {' '.join(simd) or 'no AVX2'})")


def pytest_sessionstart(session):
    """The report's header names the CPU and what the loaded library was built for (greedy ties and rounding
    differ across CPU families), also under -q, where pytest's own header is left out."""
    config = session.config
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or hasattr(config, "workerinput"):  # an xdist worker: the controller tells it
        return
    for line in report_lines():
        reporter.write_line(line)


def report_lines() -> list[str]:
    lines = [f"cpu: {cpu_summary()}"]
    try:
        from page_local.native import pageops
        lines.append("library: " + pageops.llama_cpp().llama_print_system_info().decode().strip())
    except Exception as e:  # noqa: BLE001 -- a header, not a test: the tests say what is wrong
        lines.append(f"library: not loaded ({e})")
    return lines


@pytest.fixture(scope="session")
def smollm2_path():
    try:
        return models.smollm2_path()
    except models.ModelNotInstalled as e:
        pytest.skip(f"SmolLM2 is not installed ({e})")


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    with Model(smollm2_path) as m:
        yield m


@pytest.fixture
def make_ctx():
    """make_ctx(model, **ContextConfig fields) -> Context, closed at the end of the test."""
    made = []

    def make(model, cb_eval=None, **kw):
        kw.setdefault("threads", 2)
        ctx = Context(model, ContextConfig(**kw), cb_eval=cb_eval)
        made.append(ctx)
        return ctx

    yield make
    for c in reversed(made):
        c.close()


def on_gpu() -> bool:
    """Whether the models the tests open put layers on a GPU (a CUDA build with a device, and
    $PAGE_LOCAL_N_GPU_LAYERS not 0: scripts/check-gpu.sh). There the arithmetic is the GPU's (cuBLAS, other
    kernels): tests that hold the CPU build to bit-identity or to 1e-4 take the bound measured on a GPU."""
    from page_local.native.runtime import default_n_gpu_layers, supports_gpu_offload

    return supports_gpu_offload() and default_n_gpu_layers() != 0


def random_tokens(n: int, seed: int = 0, lo: int = 100, hi: int = 4000) -> list[int]:
    return np.random.default_rng(seed).integers(lo, hi, size=n).tolist()


@pytest.fixture
def cli(smollm2_path, tmp_path, monkeypatch):
    """invoke(*args) -> click Result; the model is the embedded one and the user directory is empty."""
    monkeypatch.setenv("PAGE_LOCAL_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("PAGE_LOCAL_MODEL", raising=False)
    # the model stores page-local reads (store/discover.py) empty too: what this machine keeps is not listed
    for var in ("HF_HUB_CACHE", "LLAMA_CACHE", "OLLAMA_MODELS"):
        monkeypatch.setenv(var, str(tmp_path / "stores" / var.lower()))
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    runner = CliRunner()

    def invoke(*args):
        res = runner.invoke(main, [str(a) for a in args])
        assert not isinstance(res.exception, Exception) or isinstance(res.exception, SystemExit), res.exception
        assert "Traceback" not in res.output
        return res

    return invoke


def one_line_error(res, code: int, *needles: str) -> str:
    """Assert an error exit: `code`, and a last stderr line 'Error: ...' containing every needle."""
    assert res.exit_code == code, res.output
    err = res.stderr.strip()
    if code == 1:
        assert err.count("\n") == 0, err  # runtime errors: exactly one line
    last = err.splitlines()[-1]  # usage errors: click's usage line, then the one-line message
    assert last.startswith("Error: ")
    for n in needles:
        assert n in last, last
    return last


# --- recorded durations (tests/durations.py): heaviest test files first under xdist, `slow` from the record ---
import durations as _durations  # noqa: E402  (tests/ is on sys.path: pytest's rootdir-less conftest import)


def pytest_collection_modifyitems(config, items):
    _durations.mark_slow(items)


if _durations.HAVE_XDIST:  # a hook pytest does not know (no pytest-xdist) would be refused
    def pytest_xdist_make_scheduler(config, log):
        return _durations.make_scheduler(config, log)
