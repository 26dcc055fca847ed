"""chat's and serve's default context (store/sizing.py): read from the real model file's header, sized by the memory
available and the model's trained context."""

from __future__ import annotations

import pytest

from page_local.store.gguf import gguf_metadata, gguf_shape, model_identity
from page_local.store.sizing import CANDIDATES, cell_bytes, default_n_ctx

GiB = 2**30


def test_the_header_gives_the_attention_shape(smollm2_path):
    shape = gguf_shape(smollm2_path)
    assert shape == {"n_ctx_train": 8192, "n_layer": 30, "n_embd": 576, "n_head": 9, "n_head_kv": 3}
    # K and V of 30 layers x 3 heads x 64 in f16, and 512 queries' f32 scores of 9 heads
    assert cell_bytes(shape) == 30 * 3 * 128 * 2 + 512 * 9 * 4
    assert cell_bytes(shape, "q8_0") < cell_bytes(shape)
    with pytest.raises(ValueError, match="unknown cache type"):
        cell_bytes(shape, "f32")
    # the identity read by the same header walk is unchanged (profiles and tunings are stored under it)
    assert gguf_metadata(smollm2_path)["block_count"] == 30
    assert model_identity(smollm2_path) == "llama-87ce93da25d537b6"


@pytest.mark.parametrize("gib, want", [(0.5, 4096), (2, 4096), (3, 8192), (64, 8192)])
def test_the_context_grows_with_memory_up_to_the_trained_one(smollm2_path, gib, want):
    n, why = default_n_ctx(smollm2_path, available=int(gib * GiB))
    assert n == want and n in CANDIDATES
    assert "trained for 8192" in why


def test_slots_and_the_cache_type_count(smollm2_path):
    assert default_n_ctx(smollm2_path, available=3 * GiB)[0] == 8192
    assert default_n_ctx(smollm2_path, available=3 * GiB, slots=2)[0] == 4096  # two contexts of this size
    assert "x 2 slots" in default_n_ctx(smollm2_path, available=3 * GiB, slots=2)[1]
    # q8_0 halves the cache, not the scratch: 2.5 GiB holds 8192 cells of it, not of f16
    assert default_n_ctx(smollm2_path, available=int(2.5 * GiB))[0] == 4096
    assert default_n_ctx(smollm2_path, available=int(2.5 * GiB), cache_type="q8_0")[0] == 8192


def test_with_a_gpu_the_default_stays(smollm2_path):
    n, why = default_n_ctx(smollm2_path, available=64 * GiB, gpu=True)
    assert n == 4096 and "GPU" in why


def test_chat_without_n_ctx_sizes_it(smollm2_path, tmp_path, monkeypatch):
    """The REPL's banner says the context chosen; --n-ctx still wins."""
    from click.testing import CliRunner

    import page_local.store.sizing as sizing
    from page_local.cli import main

    monkeypatch.setenv("PAGE_LOCAL_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("PAGE_LOCAL_MODEL", raising=False)
    monkeypatch.setattr(sizing, "available_memory", lambda: 3 * GiB)
    for args, want in (([], "n_ctx 8192"), (["--n-ctx", "512"], "n_ctx 512")):
        res = CliRunner().invoke(main, ["chat", "--threads", "1", "--n-gpu-layers", "0", *args], input="/quit\n")
        assert res.exit_code == 0, res.output
        assert want in res.output
