"""Model loading on the real library: --n-gpu-layers / Engine(n_gpu_layers=...) and where the layers and
the KV cache end up (it must say CPU on a CPU build), n_ctx beyond the trained context refused with both
numbers (and allowed with the override), and llama.cpp's log routed to the `page_local.llama` logger:
warnings and errors shown, the rest quiet, `page-local run` clean."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_model as tm  # noqa: E402
from tests.conftest import one_line_error  # noqa: E402
from page_local.native import llama_log  # noqa: E402
from page_local.engine.engine import Engine  # noqa: E402
from page_local.native.runtime import ALL_LAYERS, ContextTooLong, Model, ModelError, default_n_gpu_layers, gpu_devices, parse_n_gpu_layers, supports_gpu_offload

SMALL = ["--max-tokens", "2", "--n-ctx", "256", "--threads", "1"]
PROMPT = "The capital of France is"
LOGGER = llama_log.LOGGER_NAME


@pytest.fixture
def no_gpu():
    """These tests describe a CPU build (or a GPU build on a machine without a device)."""
    if supports_gpu_offload():
        pytest.skip(f"this library offloads to {gpu_devices()}: scripts/check-gpu.sh covers GPU builds")


def truncated(src, dst, size=1 << 20):
    with open(src, "rb") as f, open(dst, "wb") as g:
        g.write(f.read(size))
    return dst


# --- n_gpu_layers ---------------------------------------------------------------------------------

@pytest.mark.parametrize("value, want", [("all", ALL_LAYERS), ("ALL", ALL_LAYERS), (" 12 ", 12), ("0", 0), (0, 0),
                                         (999, 999), ("-1", ALL_LAYERS), (-1, ALL_LAYERS)])
def test_parse_n_gpu_layers(value, want):
    assert parse_n_gpu_layers(value) == want


@pytest.mark.parametrize("value", ["-2", "some", "1.5", "", 1.5, -3, True, None])
def test_bad_n_gpu_layers_refused_before_loading(value, tmp_path):
    with pytest.raises(ValueError, match="number of layers"):
        parse_n_gpu_layers(value)
    if value is not None:  # the engine checks it before anything is loaded (the file does not exist)
        with pytest.raises(ValueError, match="n_gpu_layers must be a number of layers"):
            Engine(tmp_path / "missing.gguf", n_gpu_layers=value)


def test_default_n_gpu_layers(monkeypatch):
    monkeypatch.delenv("PAGE_LOCAL_N_GPU_LAYERS", raising=False)
    assert default_n_gpu_layers() == (ALL_LAYERS if supports_gpu_offload() else 0)
    monkeypatch.setenv("PAGE_LOCAL_N_GPU_LAYERS", "all")
    assert default_n_gpu_layers() == ALL_LAYERS
    monkeypatch.setenv("PAGE_LOCAL_N_GPU_LAYERS", "7")
    assert default_n_gpu_layers() == 7
    monkeypatch.setenv("PAGE_LOCAL_N_GPU_LAYERS", "every")
    with pytest.raises(ValueError, match=r"\$PAGE_LOCAL_N_GPU_LAYERS must be"):
        default_n_gpu_layers()


def test_engine_on_cpu_with_n_gpu_layers_zero(smollm2_path):
    with Engine(smollm2_path, n_ctx=256, gate="never", threads=1, n_gpu_layers=0) as eng:
        assert eng.model.n_gpu_layers == 0
        res = eng.generate(PROMPT, max_tokens=2)
        assert res.text.startswith(" Paris")
        p = eng.placement
    assert p["layers"] == p["kv_cache"] == "CPU" and p["gpu_layers"] == 0 and p["n_gpu_layers"] == 0
    assert p["n_layer"] == 30


def test_all_layers_on_a_cpu_build_stay_on_cpu(smollm2_path, no_gpu, monkeypatch):
    monkeypatch.setenv("PAGE_LOCAL_N_GPU_LAYERS", "all")  # the default honours the variable
    assert gpu_devices() == []
    with Engine(smollm2_path, n_ctx=256, gate="never", threads=1) as eng:
        assert eng.model.n_gpu_layers == ALL_LAYERS
        assert eng.placement == {"layers": "CPU", "kv_cache": "CPU", "n_gpu_layers": "all", "gpu_layers": 0,
                                 "n_layer": 30, "gpu": None}


def test_cli_n_gpu_layers_all_says_cpu(cli, no_gpu):
    res = cli("run", "--prompt", PROMPT, "--n-gpu-layers", "all", "--json", *SMALL)
    assert res.exit_code == 0, res.output
    dev = json.loads(res.stdout)["device"]
    assert dev["layers"] == "CPU" and dev["kv_cache"] == "CPU" and dev["n_gpu_layers"] == "all"
    res = cli("run", "--prompt", PROMPT, "--n-gpu-layers", "all", *SMALL)
    assert res.exit_code == 0 and res.stderr.strip().endswith("; layers and KV cache on CPU]"), res.stderr
    res = cli("bench", "probe", "--tokens", "64", "--repeats", "1", "--threads", "1", "--n-gpu-layers", "all",
              "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["device"]["layers"] == "CPU"
    res = cli("inspect", "--prompt", "hello there", "--n-ctx", "256", "--threads", "1", "--n-gpu-layers", "3",
              "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["device"] == {"layers": "CPU", "kv_cache": "CPU", "n_gpu_layers": 3,
                                                "gpu_layers": 0, "n_layer": 30, "gpu": None}


@pytest.mark.parametrize("cmd", [["run", "--prompt", "hi"], ["chat"], ["inspect", "--prompt", "hi"], ["calibrate"],
                                 ["eval", "run", "--tasks", "vt"], ["bench", "probe"], ["bench", "decode"],
                                 ["bench", "lorekv"], ["bench", "memory"], ["bench", "peer"]])
@pytest.mark.parametrize("bad", ["-2", "lots", "2.5"])
def test_bad_n_gpu_layers_is_a_usage_error(cli, cmd, bad):
    one_line_error(cli(*cmd, "--n-gpu-layers", bad), 2, "--n-gpu-layers", repr(bad), "nor 'all'")


def test_bad_n_gpu_layers_variable_is_one_line(cli, monkeypatch):
    monkeypatch.setenv("PAGE_LOCAL_N_GPU_LAYERS", "most")
    one_line_error(cli("run", "--prompt", PROMPT, *SMALL), 2, "$PAGE_LOCAL_N_GPU_LAYERS", "'most'")


# --- n_ctx beyond the trained context -------------------------------------------------------------

def test_n_ctx_beyond_training_refused(smollm2_path, smollm2):
    train = smollm2.n_ctx_train
    assert train == 8192
    with pytest.raises(ContextTooLong) as e:
        Engine(smollm2_path, n_ctx=2 * train, threads=1)
    assert isinstance(e.value, ValueError) and (e.value.n_ctx, e.value.n_ctx_train) == (2 * train, train)
    msg = str(e.value)
    assert "\n" not in msg and "n_ctx 16384" in msg and "trained context 8192" in msg
    assert "--allow-long-context" in msg and "allow_long_context=True" in msg
    with Engine(smollm2_path, n_ctx=train, threads=1, gate="never") as eng:  # the trained length itself is fine
        assert eng.n_ctx == train


def test_n_ctx_beyond_training_allowed_with_override(tmp_path, caplog):
    w = tm.write_tiny_llama(tmp_path / "tiny.gguf", n_ctx_train=256)
    with pytest.raises(ContextTooLong, match="n_ctx 512 is larger than this model's trained context 256"):
        Engine(w.path, n_ctx=512, threads=1, gate="never")
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with Engine(w.path, n_ctx=512, threads=1, gate="never", allow_long_context=True) as eng:
        assert eng.n_ctx == 512
        eng.generate([5, 6, 7, 8], max_tokens=2)
    # llama.cpp's own warning about it reached the logger, as a WARNING
    hits = [r for r in caplog.records if r.name == LOGGER and "n_ctx_train (256)" in r.getMessage()]
    assert hits and all(r.levelno == logging.WARNING for r in hits), caplog.records
    assert "possible training context overflow" in hits[0].getMessage()


def test_cli_n_ctx_beyond_training(cli):
    one_line_error(cli("run", "--prompt", PROMPT, "--n-ctx", "16384", "--max-tokens", "2", "--threads", "1"), 1,
                   "n_ctx 16384", "trained context 8192", "--allow-long-context")
    one_line_error(cli("inspect", "--prompt", PROMPT, "--n-ctx", "9000", "--threads", "1"), 1,
                   "n_ctx 9000", "8192")
    res = cli("run", "--prompt", PROMPT, "--raw", "--n-ctx", "8448", "--allow-long-context", "--max-tokens", "2",
              "--threads", "1")
    assert res.exit_code == 0 and res.stdout.startswith(" Paris"), res.output
    # the override runs, and llama.cpp's warning is shown once, on stderr, with what it is
    warn = [ln for ln in res.stderr.splitlines() if ln.startswith("llama.cpp warning: ")]
    assert len(warn) == 1 and "n_ctx_seq (8448) > n_ctx_train (8192)" in warn[0], res.stderr


# --- llama.cpp's log ------------------------------------------------------------------------------

def test_bridge_joins_fragments_and_maps_levels(caplog):
    b = llama_log._Bridge()
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    b(llama_log.GGML_LOG_LEVEL_WARN, b"load: part one", None)
    b(llama_log.GGML_LOG_LEVEL_CONT, b", part two\n", None)
    b(llama_log.GGML_LOG_LEVEL_INFO, b"loading\n", None)
    for _ in range(3):
        b(llama_log.GGML_LOG_LEVEL_CONT, b".", None)
    b(llama_log.GGML_LOG_LEVEL_CONT, b"\n", None)  # the loader's progress dots: no record
    b(llama_log.GGML_LOG_LEVEL_ERROR, b"e1\ne2\npartial", None)
    b(llama_log.GGML_LOG_LEVEL_DEBUG, b"dbg\n", None)  # a new message ends the partial line above
    b(llama_log.GGML_LOG_LEVEL_NONE, "caf\xe9 \xff\n".encode("latin-1"), None)  # not UTF-8: replaced, no crash
    got = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOGGER]
    assert got == [(logging.WARNING, "load: part one, part two"), (logging.INFO, "loading"),
                   (logging.ERROR, "e1"), (logging.ERROR, "e2"), (logging.ERROR, "partial"),
                   (logging.DEBUG, "dbg"), (logging.INFO, "caf\ufffd \ufffd")]


def test_bridge_is_quiet_below_warning_by_default(caplog):
    if llama_log.verbose():
        pytest.skip("PAGE_LOCAL_VERBOSE is set")
    b = llama_log._Bridge()
    caplog.set_level(logging.WARNING)  # what an unconfigured process shows (the last-resort handler's level)
    b(llama_log.GGML_LOG_LEVEL_INFO, b"chatter\n", None)
    b(llama_log.GGML_LOG_LEVEL_DEBUG, b"more chatter\n", None)
    b(llama_log.GGML_LOG_LEVEL_WARN, b"a warning\n", None)
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER] == ["a warning"]


def test_truncated_gguf_error_reaches_the_logger(smollm2_path, tmp_path, caplog):
    p = truncated(smollm2_path, tmp_path / "truncated.gguf")
    caplog.set_level(logging.ERROR, logger=LOGGER)
    with pytest.raises(ModelError) as e:
        Model(p)
    errors = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.ERROR]
    assert errors, "llama.cpp's load errors did not reach the page_local.llama logger"
    assert any("failed to load model" in r.getMessage() for r in errors)
    assert all(getattr(r, "page_local_reported", None) is True for r in errors)  # quoted in the exception
    assert "truncated, corrupt" in str(e.value) and f"(llama.cpp: {errors[0].getMessage()})" in str(e.value)


def test_cli_truncated_gguf_is_one_line(cli, smollm2_path, tmp_path):
    p = truncated(smollm2_path, tmp_path / "truncated.gguf", size=50_000_000)  # the header is whole: tensors are cut
    one_line_error(cli("run", "--prompt", PROMPT, "--model", p, *SMALL), 1, "truncated, corrupt",
                   "data is not within the file bounds")


def _page_local(*args, env=None):
    e = {k: v for k, v in os.environ.items()
         if k not in ("PAGE_LOCAL_VERBOSE", "PAGE_LOCAL_N_GPU_LAYERS", "PAGE_LOCAL_MODEL")}
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "page_local.cli", *map(str, args)], capture_output=True, text=True,
                          env=e, timeout=300)


def test_run_output_is_clean(tmp_path):
    """No llama.cpp chatter on the real stdout/stderr file descriptors (CliRunner would not see C's)."""
    p = _page_local("run", "--prompt", PROMPT, "--raw", *SMALL, env={"PAGE_LOCAL_HOME": str(tmp_path)})
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(" Paris") and p.stdout.count("\n") == 1, p.stdout
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("[full cache kept: "), p.stderr


def test_verbose_shows_every_level(tmp_path):
    p = _page_local("run", "--prompt", PROMPT, "--raw", *SMALL, env={"PAGE_LOCAL_HOME": str(tmp_path),
                                                            "PAGE_LOCAL_VERBOSE": "1"})
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(" Paris")
    lines = p.stderr.splitlines()
    assert any(ln.startswith("llama.cpp info: llama_model_loader: loaded meta data") for ln in lines), lines[:5]
    assert any(ln.startswith("llama.cpp debug: ") for ln in lines)
