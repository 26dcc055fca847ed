"""Benchmark models of the real shapes (store/synth.py, issue 54): written directly in Q4_K_M, loaded and run by the
real patched library, their tensor types the ones llama.cpp's own quantizer gives for Q4_K_M, named as what they
are, and refused where answers are read (chat, run, serve, eval)."""

from __future__ import annotations

import numpy as np
import pytest

from page_local.errors import ModelError, ModelNotInstalled
from page_local.native.runtime import Context, ContextConfig, Model
from page_local.store import gguf as store_gguf
from page_local.store import models, synth
from tests.conftest import one_line_error

# small shapes of the two architectures (8 layers: use_more_bits picks layers 0, 3, 6 and 7)
TINY_LLAMA = synth.Shape("tiny-llama", "a tiny Llama", "llama", 256, 8, 4, 2, 512, 49408, 4096, 500000.0, 1e-5,
                         tied=True, llama3_rope=(8.0, 1.0, 4.0, 1024))
TINY_QWEN = synth.Shape("tiny-qwen", "a tiny Qwen2", "qwen2", 512, 8, 4, 2, 768, 49664, 2048, 1e6, 1e-6,
                        tied=False, qkv_bias=True)


@pytest.fixture(scope="module")
def written(tmp_path_factory, smollm2_path):
    d = tmp_path_factory.mktemp("synth")
    return {s.name: synth.write(s, smollm2_path, d / f"{s.name}.gguf") for s in (TINY_LLAMA, TINY_QWEN)}


@pytest.mark.parametrize("shape", [TINY_LLAMA, TINY_QWEN], ids=lambda s: s.name)
def test_a_synthetic_model_loads_and_decodes_finite_logits(written, shape):
    path = written[shape.name]
    # the tensors' bytes, and the header: SmolLM2's 49K tokens and merges (< 3 MB)
    assert synth.approx_bytes(shape) < path.stat().st_size < synth.approx_bytes(shape) + 3_000_000
    got = store_gguf.gguf_shape(path)
    assert got["n_layer"] == shape.n_layer and got["n_embd"] == shape.n_embd
    assert got["n_head_kv"] == shape.n_head_kv and got["n_ctx_train"] == shape.n_ctx_train
    assert synth.is_synthetic(path) == shape.name
    assert "synthetic" in store_gguf.gguf_metadata(path)["general.name"]
    with Model(path) as m:
        assert m.n_vocab == shape.n_vocab
        toks = m.tokenize("The synthetic model reads a sentence of real text.")
        with Context(m, ContextConfig(n_ctx=256, threads=2)) as ctx:
            ctx.decode(toks, 0, 0, logits="last")
            first = ctx.logits()
            assert first.shape == (shape.n_vocab,) and np.isfinite(first).all()
            for i in range(8):  # a few decode steps: the cache grows, the logits stay finite
                ctx.decode([int(np.argmax(ctx.logits()))], len(toks) + i, 0, logits="last")
                assert np.isfinite(ctx.logits()).all()


def test_the_mix_is_the_one_llamas_quantizer_gives_for_q4_k_m(written, tmp_path):
    """llama.cpp's quantizer, asked for Q4_K_M from the written file, chooses the same type for every tensor."""
    from gguf import GGUFReader

    from page_local.native.quantize import requantize

    for name, path in written.items():
        again = requantize(path, tmp_path / f"{name}-requantized.gguf", "q4_k_m")
        mine = {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}
        theirs = {t.name: t.tensor_type.name for t in GGUFReader(again).tensors}
        assert mine == theirs
        assert {"Q4_K", "Q6_K", "F32"} == set(mine.values())


def test_the_real_shapes_have_the_sizes_of_the_models_they_stand_for():
    """K+V per cell (f16) and file sizes as the models' own GGUFs have them (issue 54's table)."""
    kb = {n: s.kv_bytes_per_cell // 1024 for n, s in synth.SHAPES.items()}
    assert kb == {"llama-3.2-1b": 32, "llama-3.2-3b": 112, "llama-3.1-8b": 128, "mistral-7b": 128, "qwen2.5-7b": 56}
    gb = {n: round(synth.approx_bytes(s) / 1e9, 1) for n, s in synth.SHAPES.items()}
    # Q4_K_M files as published: 1B 0.81 GB, 3B 2.02 GB, 8B 4.92 GB, Mistral-7B 4.37 GB, Qwen2.5-7B 4.68 GB
    assert gb["llama-3.2-1b"] == pytest.approx(0.81, abs=0.06) and gb["llama-3.2-3b"] == pytest.approx(2.02, abs=0.1)
    assert gb["llama-3.1-8b"] == pytest.approx(4.92, abs=0.1) and gb["qwen2.5-7b"] == pytest.approx(4.68, abs=0.1)
    assert gb["mistral-7b"] == pytest.approx(4.37, abs=0.1)


def test_a_shape_not_written_says_how_to_write_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGE_LOCAL_HOME", str(tmp_path))
    with pytest.raises(ModelNotInstalled, match=r"page-local models synth llama-3.2-3b"):
        models.resolve("synth:llama-3.2-3b")
    with pytest.raises(ModelError, match=r"no synthetic model shape 'llama-9b'.*llama-3.2-1b"):
        models.resolve("synth:llama-9b")


def test_chat_run_serve_and_eval_refuse_it_and_bench_runs_it(cli, written):
    path = written[TINY_LLAMA.name]
    for args in (["run", "--prompt", "hello"], ["chat"], ["serve"], ["eval", "longdoc"]):
        res = cli(*args, "--model", path)
        one_line_error(res, 1, "benchmark model", "random weights", "page-local bench")
    res = cli("bench", "probe", "--model", path, "--tokens", 200, "--repeats", 1, "--json")
    assert res.exit_code == 0, res.output
    res = cli("models", "synth", "llama-9b")
    one_line_error(res, 1, "no synthetic model shape", "qwen2.5-7b")
