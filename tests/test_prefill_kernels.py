"""page-local's prefill kernels (csrc/kernels/, docs/design.md section 6.2): the Q4_1 matmul
(page-matmul.c, page-q4_1-x86.inc) and the conversions in flash attention's tiled prefill kernel (page-fa-tile.cpp).

On x86 with AVX2 a prompt's Q4_1 matmuls take one weight row against four tokens per pass, and the tiled
flash-attention kernel converts its mask and K rows with ggml's vector F16->F32 routine; each output is
computed with llama.cpp's own operations in llama.cpp's order, so a prompt's logits must be bit-identical
with page-local's code and with llama.cpp's ($PAGE_LOCAL_MATMUL=llama.cpp, $PAGE_LOCAL_FA_KERNEL=llama.cpp,
read once per process: hence one subprocess per side). Lengths are chosen to leave remainders: 301 tokens (not a multiple of 4 or 16) and a
follow-up batch of 7 after 2 single-token steps, on the embedded SmolLM2 (Q4_1). A quantized cache (q8_0,
q4_0), which page-local's kernels read dequantized to F32, is held to fidelity against the f16 cache instead.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
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


CHUNK_SCRIPT = r"""
import sys
import numpy as np
from page_local.native.runtime import Context, ContextConfig, Model
path, out = sys.argv[1], sys.argv[2]
toks = np.random.default_rng(3).integers(100, 4000, size=320).tolist()
res = {}
for name, threads in (("chunk", 2), ("steps", 1)):
    with Model(path) as m, Context(m, ContextConfig(n_ctx=512, threads=threads, flash_attn="on")) as c:
        c.decode(toks[:301], 0, logits="none")
        if name == "chunk":
            c.decode(toks[301:313], 301, logits="all")
            res[name] = np.stack([c.logits(i) for i in range(12)])
        else:
            rows = []
            for i in range(12):
                c.decode(toks[301 + i:302 + i], 301 + i)
                rows.append(c.logits())
            res[name] = np.stack(rows)
np.savez(out, **res)
"""


def _chunk_and_steps(model: str, tmp_path: Path, llama_cpps: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in SWITCHES}
    if llama_cpps:
        env["PAGE_LOCAL_FA_KERNEL"] = "llama.cpp"
    out = tmp_path / f"chunk-{llama_cpps}.npz"
    res = subprocess.run([sys.executable, "-c", CHUNK_SCRIPT, model, str(out)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return dict(np.load(out))


def test_a_chunk_of_a_few_tokens_is_read_as_one_token_steps(smollm2_path, tmp_path):
    """12 tokens at once (2..63 rows: a short message, the verify check's forced chunk) with flash attention on: each
    row through page-local's row kernel, whole in one thread, is the one-token step's computation over one chunk of
    cells, so the chunk's logits are those of 12 one-token steps with one thread: bit for bit on an AMD Zen 4 (and
    wherever the matmuls of 12 tokens and of one give the same bits). llama.cpp's per-row kernel (the switch) sums V
    in F16 and lands farther from the steps (Zen 4: largest logit move 0.76, KL 0.0055); page-local's rows must stay
    within a quarter of that distance, and within the usual bound of llama.cpp's."""
    ours = _chunk_and_steps(str(smollm2_path), tmp_path, False)
    theirs = _chunk_and_steps(str(smollm2_path), tmp_path, True)["chunk"]
    chunk, steps = ours["chunk"], ours["steps"]
    assert np.isfinite(chunk).all()
    assert not np.array_equal(theirs, chunk)  # the switch still restores llama.cpp's kernel
    assert np.max(np.abs(chunk - steps)) <= 0.25 * np.max(np.abs(theirs - steps))
    lp = chunk - chunk.max(1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(1, keepdims=True))
    lq = theirs - theirs.max(1, keepdims=True)
    lq -= np.log(np.exp(lq).sum(1, keepdims=True))
    assert np.max(np.sum(np.exp(lq) * (lq - lp), axis=1)) <= 0.05
    assert np.max(np.abs(chunk - theirs)) <= 3.0


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


QUANT_SCRIPT = r"""
import json, sys
import numpy as np
from page_local.native.runtime import Context, ContextConfig, Model
path, ct = sys.argv[1], sys.argv[2]
text = " ".join(f"Room {i} holds {i % 7 + 2} red chairs and {i % 5 + 1} green lamps." for i in range(30))
with Model(path) as m, Context(m, ContextConfig(n_ctx=1024, threads=2, flash_attn="on", type_kv=ct)) as c:
    toks = m.tokenize(text + " Room 12 holds")
    c.decode(toks, 0)
    rows, pos = [c.logits().tolist()], len(toks)
    for tok in m.tokenize(" 7 red chairs and 3 green", add_special=False)[:6]:  # the same tokens on every side
        c.decode([tok], pos)  # one-token steps: the cache is past 64 cells, where the one-token kernel takes over
        pos += 1
        rows.append(c.logits().tolist())
print(json.dumps(rows))
"""


@functools.lru_cache(maxsize=None)  # the f16 cache's logits serve both quantized types' comparisons
def _quant_logits(model: str, ct: str, llama_cpps: bool) -> np.ndarray:
    env = {k: v for k, v in os.environ.items() if k not in SWITCHES}
    if llama_cpps:
        env["PAGE_LOCAL_FA_KERNEL"] = "llama.cpp"
    res = subprocess.run([sys.executable, "-c", QUANT_SCRIPT, model, ct], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    out = np.array(json.loads(res.stdout.strip().splitlines()[-1]), dtype=np.float64)
    out.flags.writeable = False  # shared between tests
    return out


def _kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    p = np.exp(p_logits - p_logits.max())
    p /= p.sum()
    q = np.exp(q_logits - q_logits.max())
    q /= q.sum()
    return float(np.sum(p * (np.log(p + 1e-30) - np.log(q + 1e-30))))


@pytest.mark.parametrize("ct", ["q8_0", "q4_0"])
def test_a_quantized_cache_loses_no_more_than_with_llama_cpps_kernels(smollm2_path, ct):
    """A q8_0/q4_0 cache goes through page-local's tiled prompt kernel and one-token kernel (each row
    dequantized to F32) where llama.cpp reads it one query row at a time with Q quantized to the cache's dot
    type: not the same sums, so not bit for bit. What must hold is fidelity: against the f16 cache's next-token
    distributions (the same prompt and the same forced tokens), page-local's reading of the quantized cache is as
    close as llama.cpp's (measured on the AMD EPYC: mean KL 8.1e-4 against 7.2e-4 for q8_0, 0.046 against 0.035
    for q4_0, a lossy cache whose answers part from f16's at near ties with either kernel)."""
    model = str(smollm2_path)
    f16 = _quant_logits(model, "f16", False)
    ours, theirs = _quant_logits(model, ct, False), _quant_logits(model, ct, True)
    assert ours.shape == theirs.shape == f16.shape == (7, f16.shape[1])
    assert not np.array_equal(ours, theirs)  # page-local's kernels did run: llama.cpp's sums differ
    kl_ours = float(np.mean([_kl(r, o) for r, o in zip(f16, ours)]))
    kl_theirs = float(np.mean([_kl(r, t) for r, t in zip(f16, theirs)]))
    assert kl_ours <= 2 * kl_theirs + 1e-3, (kl_ours, kl_theirs)
    if ct == "q8_0":  # a near-lossless cache: the two readings of it agree as two roundings do
        assert max(_kl(t, o) for o, t in zip(ours, theirs)) < 0.01
