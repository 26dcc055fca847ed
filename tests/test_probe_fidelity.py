"""Probe fidelity: per-head scores equal a float64 numpy forward pass of a tiny f32 GGUF model.

The models are written by tests/tiny_model.py (random weights, GQA, f32 everything, f32 KV
cache). The probe computes softmax(q k^T * scale + mask) in f32 from the f32 cache, so it must match
the float64 reference to 1e-4 relative, with flash attention off and on. With flash attention on,
llama.cpp's main attention path rounds K/V to f16, which changes the hidden states the later layers
see; the reference emulates that rounding (fa_f16=True) so that the comparison stays exact. On a GPU
(scripts/check-gpu.sh) the forward pass is cuBLAS's and the CUDA kernels': the bounds there are measured (1e-2).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_model as tm  # noqa: E402

from page_local.native.runtime import Context, ContextConfig, Model  # noqa: E402
from tests.conftest import on_gpu  # noqa: E402

PREFIX, W = 300, 32
THREADS = 2


@pytest.fixture(scope="module", params=tm.FIDELITY_MODELS)
def tiny(request, tmp_path_factory):
    return tm.write_fidelity_model(request.param, tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize("flash_attn", ["off", "on"], ids=["flash-off", "flash-on"])
@pytest.mark.parametrize("rides", [0, 100], ids=["window-apart", "last-of-batch"])
def test_probe_equals_float64_reference(tiny, flash_attn, rides):
    """rides: the armed batch also carries that many earlier tokens, which the probe skips (last=W: the
    engine's prefill arms the prompt's last ubatch so)."""
    tokens = np.random.default_rng(7).integers(tm.N_SPECIAL, tiny.n_vocab, size=PREFIX + W).tolist()
    ref = tm.reference_forward(tiny, tokens, fa_f16=flash_attn == "on", fa_split=[PREFIX - rides, rides + W],
                               fa_n_threads=THREADS)
    want = tm.window_scores(ref, PREFIX, PREFIX + W)  # (n_layer, n_head, n_tokens)

    with Model(tiny.path) as model, Context(model, ContextConfig(
            n_ctx=1024, n_batch=512, n_ubatch=512, threads=THREADS, flash_attn=flash_attn, type_kv="f32")) as ctx:
        ctx.decode(tokens[:PREFIX - rides], 0, logits="none")
        ctx.page.arm_probe(0, top_k=16, keep_rows=True, last=W if rides else 0)
        ctx.decode(tokens[PREFIX - rides:], PREFIX - rides)
        r = ctx.page.read_probe()

    n = PREFIX + W
    assert r.positions.tolist() == list(range(n))
    assert r.queries.tolist() == list(range(PREFIX, n))
    assert r.rows.shape == (tiny.n_layer, tiny.n_head, n)
    # positions a sliding-window layer cannot see score exactly 0, on both sides
    if any(tiny.swa_layers):
        il = tiny.swa_layers.index(True)
        assert np.all(want[il, :, :PREFIX - 64 + 1] == 0) and np.all(r.rows[il, :, :PREFIX - 64 + 1] == 0)

    # llama: 1e-4 (the bound). gemma3: its GELU runs through ggml's fp16 lookup table, which
    # the reference emulates only up to rounding-boundary cases (~3e-4 on the logits); that error is
    # in the forward pass the probe reads, not in the probe, so the bound there is 2e-3.
    tol = 1e-4 if tiny.arch == "llama" else 2e-3
    if on_gpu():  # the forward pass on a GPU (cuBLAS): 2.6e-3 (llama) and 4.9e-3 (gemma3) on an H200
        tol = 1e-2
    big = want > 1e-6
    rel = np.abs(r.rows.astype(np.float64) - want)[big] / want[big]
    assert rel.max() <= tol, f"max relative error {rel.max():.2e}"
    np.testing.assert_allclose(r.mean, want.mean(axis=1), rtol=tol, atol=1e-9)

    # identical top-k sets, ties aside: every reported position scores at least the k-th best
    eps = 1e-5 if tiny.arch == "llama" else 5e-3
    for il in range(tiny.n_layer):
        for h in range(tiny.n_head):
            order = np.argsort(-want[il, h], kind="stable")
            kth = want[il, h, order[15]]
            got = set(r.topk_pos[il, h].tolist())
            sure = {int(p) for p in order[:16] if want[il, h, p] > kth * (1 + eps)}
            assert sure <= got
            assert all(want[il, h, p] >= kth * (1 - eps) for p in got)


def test_a_probe_on_the_last_queries_skips_the_others_and_refuses_a_bad_count(tiny):
    from page_local.errors import InvalidArgument

    tokens = np.random.default_rng(3).integers(tm.N_SPECIAL, tiny.n_vocab, size=96).tolist()
    with Model(tiny.path) as model, Context(model, ContextConfig(n_ctx=256, threads=THREADS)) as ctx:
        with pytest.raises(InvalidArgument, match="last must be >= 0"):
            ctx.page.arm_probe(0, top_k=4, last=-1)
        ctx.page.arm_probe(0, top_k=4, last=500)  # more than the batch holds: every query
        ctx.decode(tokens[:40], 0)
        assert ctx.page.read_probe().queries.tolist() == list(range(40))
        ctx.page.arm_probe(0, top_k=4, last=8)
        ctx.decode(tokens[40:], 40)
        assert ctx.page.read_probe().queries.tolist() == list(range(88, 96))


@pytest.mark.parametrize("type_kv", ["f32", "f16"])
def test_key_norms_equal_reference(tiny, type_kv):
    """llama_page_key_norms == ||k|| of the reference's post-RoPE keys, per layer and KV head."""
    tokens = np.random.default_rng(8).integers(tm.N_SPECIAL, tiny.n_vocab, size=200).tolist()
    ref = tm.reference_forward(tiny, tokens)
    want = np.linalg.norm(ref.k, axis=-1).transpose(0, 2, 1)  # (n_layer, n_head_kv, n_tokens)
    with Model(tiny.path) as model, Context(model, ContextConfig(
            n_ctx=512, threads=THREADS, flash_attn="off", type_kv=type_kv)) as ctx:
        ctx.decode(tokens, 0, logits="none")
        ctx.page.evict(0, [10, 11, 50])
        got = ctx.page.key_norms(0, tiny.n_layer, tiny.n_head_kv)
        held = ctx.page.positions(0)
    assert got.shape == (tiny.n_layer, tiny.n_head_kv, 197)
    # on a GPU the keys come from cuBLAS's projections: 4.5e-4 (f32) on an H200
    np.testing.assert_allclose(got, want[:, :, held], rtol=(1e-3 if on_gpu() else 1e-4) if type_kv == "f32" else 2e-3)
