"""A long cache without a long prefill (bench/fill.py, issue 54): llama.cpp's sequence state parsed and written
back byte for byte on both V layouts, repeated to more cells than were read and restored by the real library, a
slot file that stock llama-server restores (when it is built), and `bench decode --fill state`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from page_local.bench import fill
from page_local.native.runtime import Context, ContextConfig
from tests.conftest import one_line_error, random_tokens

PEER = Path(__file__).resolve().parents[1] / "build-peer" / "bin" / "llama-server"


@pytest.mark.parametrize("fa", ["on", "off"])
def test_a_state_is_parsed_and_written_back_byte_for_byte(smollm2, fa):
    with Context(smollm2, ContextConfig(n_ctx=1024, threads=2, flash_attn=fa)) as ctx:
        ctx.decode(random_tokens(200), 0, 0)
        state = ctx.seq_state(0)
        parsed = fill.parse(state)
        assert parsed.cells == 200 and parsed.positions.tolist() == list(range(200))
        assert len(parsed.k) == len(parsed.v) == smollm2.n_layer
        assert bytes(fill.repeat_to(parsed, 200, v_trans=fa == "off")) == bytes(state)


@pytest.mark.parametrize("fa", ["on", "off"])
def test_repeated_cells_restore_as_a_longer_cache_that_decodes(smollm2, fa):
    with Context(smollm2, ContextConfig(n_ctx=2048, threads=2, flash_attn=fa)) as ctx:
        toks = random_tokens(128, seed=3)
        ctx.decode(toks, 0, 0)
        seed = fill.parse(ctx.seq_state(0))
        ctx.clear()
        ctx.set_seq_state(fill.repeat_to(seed, 1500, v_trans=fa == "off"), 0)
        assert ctx.cells_used(0) == 1500
        again = fill.parse(ctx.seq_state(0))  # what llama.cpp holds now: the seed's cells in order, repeated
        assert again.positions.tolist() == list(range(1500))
        for (_, k0), (_, k1) in zip(seed.k, again.k):
            assert np.array_equal(k1[128:256], k0) and np.array_equal(k1[1408:1500], k0[:92])
        ctx.decode([42], 1500, 0)
        assert np.isfinite(ctx.logits()).all()


def test_what_is_not_a_state_is_refused(smollm2):
    with Context(smollm2, ContextConfig(n_ctx=512, threads=1)) as ctx:
        ctx.decode(random_tokens(40), 0, 0)
        state = bytes(ctx.seq_state(0))
    for bad, why in ((state[:-7], "ends early"), (state + b"\0" * 3, "bytes after"), (b"\0" * 64, "magic"),
                     (state[:8] + (2).to_bytes(4, "little") + state[12:], "streams")):
        with pytest.raises(ValueError, match=why):
            fill.parse(bad)
    with pytest.raises(ValueError, match="not a sequence state"):
        fill.write_slot_file("/dev/null", [1], b"\0" * 16)


def test_bench_decode_fill_state_needs_stock_llama_server(cli, monkeypatch, tmp_path):
    monkeypatch.setenv("PAGE_LOCAL_PEER_BIN", str(tmp_path))  # no stock build
    one_line_error(cli("bench", "decode", "--tokens", "200", "--fill", "state", "--threads", "1"), 1,
                   "make peer-server")


@pytest.mark.skipif(not PEER.is_file(), reason="stock llama-server is not built: `make peer-server` (not part of "
                    "`make test`)")
def test_bench_decode_fill_state_against_stock_llama_server(cli):
    """Both engines decode over the same repeated cells: stock restores them from its slot file and reads only the
    probe's window (else measure_filled raises), and their greedy tokens agree."""
    r = json.loads(cli("bench", "decode", "--tokens", "900", "--fill", "state", "--new-tokens", "4", "--repeats", "1",
                       "--threads", "1", "--json").stdout)
    assert r["fill"] == "state" and r["ttft_s"] is None and r["ttft_vs_stock_best"] is None
    assert r["stock_source"].endswith("slot file") and all(p["decode_tok_s"] > 0 for p in r["stock_paths"].values())
    assert r["tokens_agreeing_with_stock"]["on"] >= 1 and r["kept"] < r["tokens"]
    assert r["bound"] > 1 and r["rss_mb"] > 0 and r["stock_rss_mb"] > 0
