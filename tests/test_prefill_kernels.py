"""page-local's prefill kernels (csrc/upstream.patch, docs/design.md section 6.2): the Q4_1 matmul
(ggml-cpu.c, arch/x86/quants.c) and the conversions in flash attention's tiled prefill kernel (ops.cpp).

On x86 with AVX2 a prompt's Q4_1 matmuls take one weight row against four tokens per pass, and the tiled
flash-attention kernel converts its mask and K rows with ggml's vector F16->F32 routine; each output is
computed with llama.cpp's own operations in llama.cpp's order, so a prompt's logits must be bit-identical
with page-local's code and with llama.cpp's ($PAGE_LOCAL_MATMUL=llama.cpp, $PAGE_LOCAL_FA_KERNEL=llama.cpp,
read once per process: hence one subprocess per side). Lengths are chosen to leave remainders: 301 tokens (not a multiple of 4 or 16) and a
follow-up batch of 7 after 2 single-token steps, on the embedded SmolLM2 (Q4_1).
"""

from __future__ import annotations

import functools
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from page_local_bindings import loader

X86 = platform.machine().lower() in ("x86_64", "amd64")

SCRIPT = r"""
import hashlib, json, sys
import numpy as np
from page_local.native.runtime import Context, ContextConfig, Model
path, fa = sys.argv[1], sys.argv[2]
toks = np.random.default_rng(3).integers(100, 4000, size=311).tolist()
out = {}
with Model(path) as m, Context(m, ContextConfig(n_ctx=512, threads=2, flash_attn=fa)) as c:
    c.decode(toks[:301], 0, logits="all")
    out["prompt"] = hashlib.sha256(np.stack([c.logits(i) for i in range(301)]).tobytes()).hexdigest()
    c.decode(toks[301:302], 301)
    c.decode(toks[302:303], 302)
    c.decode(toks[303:310], 303, logits="all")
    out["batch7"] = hashlib.sha256(np.stack([c.logits(i) for i in range(7)]).tobytes()).hexdigest()
print(json.dumps(out))
"""


SWITCHES = ("PAGE_LOCAL_MATMUL", "PAGE_LOCAL_FA_KERNEL")


@functools.lru_cache(maxsize=None)  # page-local's own digests serve every switch's comparison
def _logit_digests(model: str, fa: str, llama_cpps: str | None) -> dict:
    """llama_cpps: the switch set to llama.cpp's code, or None for page-local's."""
    env = {k: v for k, v in os.environ.items() if k not in SWITCHES}
    if llama_cpps:
        env[llama_cpps] = "llama.cpp"
    res = subprocess.run([sys.executable, "-c", SCRIPT, model, fa], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("fa,switch", [("on", "PAGE_LOCAL_MATMUL"), ("off", "PAGE_LOCAL_MATMUL"),
                                       ("on", "PAGE_LOCAL_FA_KERNEL")])
def test_the_prefill_kernels_give_llama_cpps_logits_bit_for_bit(smollm2_path, fa, switch):
    ours = _logit_digests(str(smollm2_path), fa, None)
    theirs = _logit_digests(str(smollm2_path), fa, switch)
    assert ours["prompt"] == theirs["prompt"]
    if switch == "PAGE_LOCAL_MATMUL":  # the FA switch also swaps the one-token decode kernel (section 6.1),
        assert ours["batch7"] == theirs["batch7"]  # whose F32 sums differ: the batch after two steps does


def _avx2() -> bool:
    try:
        return " avx2" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not (X86 and _avx2()), reason="the kernel is compiled for x86 with AVX2 only")
def test_the_kernel_is_in_the_built_library():
    """Without it the test above would compare llama.cpp's loop with itself."""
    d = loader.library_dir()
    lib = next(p for p in sorted(d.glob("libggml-cpu*")) if p.is_file() and not p.is_symlink())
    data = lib.read_bytes()
    assert b"ggml_page_vec_dot_q4_1_q8_1_x4" in data and b"PAGE_LOCAL_MATMUL" in data, lib
