"""Requantize a GGUF with llama.cpp's own quantizer (llama_model_quantize), in process.

Used to make local variants of a registered model (`page-local models install smollm2-q8`). The
embedded SmolLM2 is Q4_1, which ggml-cpu's fast prompt GEMM (tinyBLAS) does not cover; a Q8_0 copy
of the same weights is. Requantizing is deterministic (the reference quantizers, row by row; the
result does not depend on the thread count), so the output can be checked against a fixed sha256.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from page_local.errors import ModelInstallError
from page_local.native import llama_log
from page_local.native import pageops as native

# llama_ftype values (llama.h)
FTYPES = {"q4_0": 2, "q4_1": 3, "q8_0": 7, "f16": 1, "q4_k_m": 15}


def requantize(src: str | os.PathLike, dst: str | os.PathLike, ftype: str, threads: int = 2) -> Path:
    """Write `src` requantized to `ftype` (a key of FTYPES) at `dst`; returns dst.

    Raises ValueError for an unknown ftype and RuntimeError when llama.cpp fails."""
    if ftype not in FTYPES:
        raise ValueError(f"unknown quantization {ftype!r}; known: {', '.join(FTYPES)}")
    lc = native.llama_cpp()
    llama_log.install()  # the quantizer's per-tensor lines are INFO: not shown unless PAGE_LOCAL_VERBOSE
    params = lc.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    params.allow_requantize = True  # the source is already quantized (Q4_1 -> Q8_0 keeps its values)
    params.nthread = int(threads)
    rc = lc.llama_model_quantize(os.fsencode(src), os.fsencode(dst), ctypes.byref(params))
    if rc != 0:
        raise ModelInstallError(f"llama.cpp could not requantize {src} to {ftype} (error {rc})")
    return Path(dst)
