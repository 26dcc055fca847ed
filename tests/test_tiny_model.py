"""The tiny GGUF writer + float64 reference (tests/tiny_model.py) against the real patched libllama."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny_model as tm  # noqa: E402

# the folder page_local loads the patched library from (one library in the process)
os.environ.setdefault("LLAMA_CPP_LIB_PATH", str(tm.default_lib_path()))
_LIB_DIR = Path(os.environ["LLAMA_CPP_LIB_PATH"])
_HAVE_LIB = any(_LIB_DIR.glob("libllama.so*")) or any(_LIB_DIR.glob("libllama*.dylib")) or any(
    _LIB_DIR.glob("llama.dll")
)
needs_lib = pytest.mark.skipif(
    not _HAVE_LIB, reason=f"patched libllama not built: no libllama in {_LIB_DIR} (build with cmake first)"
)

N_TOKENS = 200


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max |want|, per row, then the worst row."""
    got, want = np.atleast_2d(got), np.atleast_2d(want)
    return float((np.abs(got - want).max(-1) / np.abs(want).max(-1)).max())


def _tokens(w: tm.TinyWeights, n: int = N_TOKENS, seed: int = 1) -> list[int]:
    return np.random.default_rng(seed).integers(tm.N_SPECIAL, w.n_vocab, size=n).tolist()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tm.write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf")


@pytest.fixture(scope="module")
def tiny_swa(tmp_path_factory):
    return tm.write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-gemma3.gguf", n_layer=4, sliding_window=32)


# ---------------------------------------------------------------- pure numpy (no library needed)


def test_written_weights_round_trip(tiny):
    gguf = pytest.importorskip("gguf")
    r = gguf.GGUFReader(str(tiny.path))
    tensors = {t.name: t for t in r.tensors}
    assert len(tensors) == 3 + 9 * tiny.n_layer
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in tensors.values())
    np.testing.assert_array_equal(np.asarray(tensors["token_embd.weight"].data, dtype=np.float64), tiny.tok_embd)
    np.testing.assert_array_equal(np.asarray(tensors["blk.1.attn_k.weight"].data, dtype=np.float64), tiny.layers[1].wk)
    # ggml dims are numpy's reversed: a map n_in -> n_out is ne = {n_in, n_out}
    assert list(tensors["blk.0.ffn_gate.weight"].shape) == [tiny.n_embd, tiny.n_ff]
    assert list(tensors["blk.0.ffn_down.weight"].shape) == [tiny.n_ff, tiny.n_embd]


def test_reference_attention_shape_and_sharpness(tiny):
    toks = _tokens(tiny)
    ref = tm.reference_forward(tiny, toks)
    n = len(toks)
    assert ref.attn.shape == (tiny.n_layer, tiny.n_head, n, n)
    assert ref.logits.shape == (n, tiny.n_vocab)
    np.testing.assert_allclose(ref.attn.sum(-1), 1.0, atol=1e-12)
    assert np.all(np.triu(ref.attn, k=1) == 0.0)  # causal
    # neither uniform nor one-hot: the heaviest key of a late query carries a real but partial share
    late = ref.attn[:, :, n // 2 :, :].max(-1)
    assert 0.05 < late.mean() < 0.9
    s = tm.window_scores(ref, n - 8, n)
    assert s.shape == (tiny.n_layer, tiny.n_head, n)
    np.testing.assert_allclose(s.sum(-1), 1.0, atol=1e-12)
    np.testing.assert_allclose(s, ref.attn[:, :, n - 8 :, :].mean(axis=2))


def test_reference_swa_window(tiny_swa):
    w = tiny_swa
    assert w.arch == "gemma3" and w.swa_layers == (True, False, True, False)
    ref = tm.reference_forward(w, _tokens(w, 100))
    i = np.arange(100)[:, None]
    p = np.arange(100)[None, :]
    outside = (i - p) >= w.sliding_window
    assert np.all(ref.attn[0][:, outside] == 0.0)
    assert np.all(ref.attn[2][:, outside] == 0.0)
    assert ref.attn[1][:, outside].sum() > 0.0  # global layer sees everything


# ---------------------------------------------------------------- against llama.cpp


@needs_lib
def test_llama_logits_match_f32(tiny):
    toks = _tokens(tiny)
    ref = tm.reference_forward(tiny, toks)
    got = tm.llama_cpp_logits(tiny.path, toks, flash_attn=False, all_logits=True)
    assert _rel(got[-1], ref.logits[-1]) < 1e-5
    assert _rel(got, ref.logits) < 1e-5


@needs_lib
def test_llama_logits_match_flash_attn(tiny):
    toks = _tokens(tiny)
    got = tm.llama_cpp_logits(tiny.path, toks, flash_attn=True, all_logits=True)
    emulated = tm.reference_forward(tiny, toks, fa_f16=True)
    # (measured: worst row ~1e-4, last row ~1e-5; f32 reference: ~3e-4)
    assert _rel(got, emulated.logits) < 1e-3
    assert _rel(got[-1], emulated.logits[-1]) < 3e-4
    # the f16 emulation is what makes it match: the f32 reference is measurably further off
    plain = tm.reference_forward(tiny, toks)
    assert _rel(got, plain.logits) > _rel(got, emulated.logits)


@needs_lib
def test_llama_logits_match_flash_attn_single_token_decodes(tiny):
    toks = _tokens(tiny, 120)
    split = [100] + [1] * 20  # tiled kernel for the prompt, page-local's one-token decode kernel (f32) after
    got = tm.llama_cpp_logits(tiny.path, toks, flash_attn=True, all_logits=True, split=split)
    emulated = tm.reference_forward(tiny, toks, fa_f16=True, fa_split=split)
    assert _rel(got, emulated.logits) < 1e-3
    got_f32 = tm.llama_cpp_logits(tiny.path, toks, flash_attn=False, all_logits=True, split=split)
    assert _rel(got_f32, tm.reference_forward(tiny, toks).logits) < 1e-5


@needs_lib
def test_a_small_batch_matches_the_emulation_of_each_kernel(tiny, monkeypatch):
    """A 20-token batch after the prompt: page-local's row kernel (f32) by default, llama.cpp's one-row kernel
    (f16 Q and accumulator) with $PAGE_LOCAL_FA_KERNEL=llama.cpp (read per call); each matches its own emulation
    more closely than the other's."""
    toks = _tokens(tiny, 120)
    split = [100, 20]
    ours = tm.reference_forward(tiny, toks, fa_f16=True, fa_split=split).logits[100:]
    theirs = tm.reference_forward(tiny, toks, fa_f16=True, fa_split=split, fa_kernels="llama.cpp").logits[100:]
    got = tm.llama_cpp_logits(tiny.path, toks, flash_attn=True, all_logits=True, split=split)[100:]
    assert _rel(got, ours) < 1e-4 and _rel(got, ours) < _rel(got, theirs)
    monkeypatch.setenv("PAGE_LOCAL_FA_KERNEL", "llama.cpp")
    got = tm.llama_cpp_logits(tiny.path, toks, flash_attn=True, all_logits=True, split=split)[100:]
    assert _rel(got, theirs) < 1e-3 and _rel(got, theirs) < _rel(got, ours)


@needs_lib
def test_gemma3_swa_logits_match(tiny_swa):
    w = tiny_swa
    toks = _tokens(w)
    ref = tm.reference_forward(w, toks)
    got = tm.llama_cpp_logits(w.path, toks, flash_attn=False, all_logits=True)
    # not 1e-5 like llama: ggml's GELU is an fp16 table lookup, and the few inputs that sit on an
    # fp16 rounding boundary round differently from f32 and f64 activations
    # (measured: last row 1e-5..6e-5, worst row ~3e-4)
    assert _rel(got[-1], ref.logits[-1]) < 5e-4
    assert _rel(got, ref.logits) < 2e-3
    # the window matters: the same model without sliding-window layers is far off
    no_swa = dataclasses.replace(w, swa_layers=tuple(False for _ in w.swa_layers))
    assert _rel(got, tm.reference_forward(no_swa, toks).logits) > 1e-2

    got_fa = tm.llama_cpp_logits(w.path, toks, flash_attn=True, all_logits=True)
    assert _rel(got_fa, tm.reference_forward(w, toks, fa_f16=True).logits) < 3e-3
