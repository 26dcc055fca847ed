"""Parking (llama_page_park / llama_page_restore) on the real patched library, with the embedded SmolLM2 (one plain
cache; flash attention on and off, f16 and q8_0) and a tiny gemma3 (iSWA: a full-attention and a sliding-window
cache).

A parked cell stays in memory under a parking sequence and leaves the attended range: the probe's graph output
`page_probe-<il>` is F32 [n_kv, n_head], so its width is the range the attention covered (tests/test_compact.py
reads the position -> cell map the same way). That a decode never reads a parked cell is shown with poison: the
cells' K and V bytes are overwritten with NaN, and the logits stay the same bits (a read with weight 0 would still
give NaN: 0 * NaN), while poisoning one held cell turns them NaN.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from page_local.errors import PageError  # noqa: E402
from page_local.native.pageops import InvalidArgument, InvalidPositions  # noqa: E402
from tests.conftest import random_tokens  # noqa: E402
from tests.test_compact import CONFIGS, gemma3, probe_capture, query_token, read_layout, setup_model  # noqa: E402

__all__ = ["gemma3"]  # the tiny iSWA model fixture, shared with test_compact

N_CTX, PROMPT, PARK = 1024, 600, 2
N_PARKED = 450  # three quarters of the prompt: what a budget of 0.25 parks


def prefill(make_ctx, model, cb=None, **kw):
    ctx = make_ctx(model, cb_eval=cb, n_ctx=N_CTX, n_seq_max=3, **kw)
    ctx.decode(random_tokens(PROMPT, seed=12, hi=min(4000, model.n_vocab)), 0, 0, logits="none")
    return ctx


def chosen(seed: int = 1, n: int = N_PARKED) -> np.ndarray:
    """Positions to park: random, never the first four (sinks) or the last ten."""
    return np.sort(np.random.default_rng(seed).choice(np.arange(4, PROMPT - 10), size=n, replace=False))


def next_logits(ctx, seq_id: int = 0) -> np.ndarray:
    """Logits of query_token() decoded after seq_id's newest position, then removed again."""
    q = ctx.seq_pos_max(seq_id) + 1
    ctx.decode([query_token(ctx.model)], q, seq_id)
    out = ctx.logits()
    ctx.seq_rm(seq_id, q, -1)
    return out


def kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    lp, lq = (x - x.max() - np.log(np.exp(x - x.max()).sum()) for x in (p_logits, q_logits))
    return float(np.sum(np.exp(lp) * (lp - lq)))


def assert_close(after: np.ndarray, before: np.ndarray) -> None:
    """The same cache contents in another cell order: the sums over the cache run in another order, and SmolLM2's
    f16 cache amplifies that rounding for query_token() (tests/test_compact.py). Measured on an Intel Xeon for
    park + restore against never parking: largest logit move 0.42 (flash off) and 0.47 (on), KL 0.002 and 0.004."""
    assert np.isfinite(after).all()
    assert kl(before, after) <= 0.02
    assert np.max(np.abs(after - before)) <= 3.0
    assert np.argmax(after) == np.argmax(before)


@pytest.mark.parametrize("name,type_kv,flash_attn", CONFIGS, ids=["-".join(c) for c in CONFIGS])
def test_park_attends_as_evicted_and_compacted(request, make_ctx, name, type_kv, flash_attn):
    model, swa = setup_model(request, name)
    cb, captured = probe_capture()
    ctx = prefill(make_ctx, model, cb, flash_attn=flash_attn, type_kv=type_kv)
    held = ctx.page.positions(0)
    park = chosen()

    ctx.page.park(0, PARK, park, gap=16)

    assert ctx.page.parked(PARK).tolist() == park.tolist()
    assert ctx.page.positions(0).tolist() == sorted(set(held.tolist()) - set(park.tolist()))
    cells, query_cell, logits = read_layout(ctx, captured, 0)
    n_kv = {il: captured[il].shape[1] for il in captured}
    n_live = PROMPT - N_PARKED
    for il, is_swa in enumerate(swa):
        if not is_swa:  # the full-attention cache: the held cells packed from cell 0, the next token after them
            assert sorted(cells[il].values()) == list(range(n_live))
            assert query_cell[il] == n_live
            assert n_kv[il] == 256  # n_live rounded up as llama.cpp rounds the attended range, not 768

    # the reference: the same positions evicted for good, then compacted
    ref = prefill(make_ctx, model, cb, flash_attn=flash_attn, type_kv=type_kv)
    ref.page.evict(0, park)
    ref.page.compact(0)
    _cells, _query, ref_logits = read_layout(ref, captured, 0)
    assert {il: captured[il].shape[1] for il in captured} == n_kv
    assert_close(logits, ref_logits)


@pytest.mark.parametrize("flash_attn,type_kv", [("off", "f16"), ("on", "f16"), ("on", "q8_0")])
def test_a_decode_never_reads_a_parked_cell(smollm2, make_ctx, flash_attn, type_kv):
    ctx = prefill(make_ctx, smollm2, flash_attn=flash_attn, type_kv=type_kv)
    park = chosen()
    ctx.page.park(0, PARK, park, gap=16)
    before = next_logits(ctx)

    ctx.page.debug_poison(PARK, park)  # every parked cell's K and V is NaN now
    np.testing.assert_array_equal(next_logits(ctx), before)

    ctx.page.debug_poison(0, ctx.page.positions(0)[50:51])  # the poison is read where a cell is attended
    assert not np.isfinite(next_logits(ctx)).all()


@pytest.mark.parametrize("flash_attn,type_kv", [("on", "f16"), ("on", "q8_0")])
def test_a_chunk_never_reads_a_cell_its_sequence_does_not_hold(smollm2, make_ctx, flash_attn, type_kv):
    """The verify check's forced chunk: a few tokens read at once on a copy of the sequence with three quarters of
    its positions removed (the cells stay: sequence 0 holds them), inside the attended range. With flash attention
    on, 2..63 rows run page-local's row kernel (csrc/kernels/page-fa-decode.cpp, page_fa_rows). (Flash attention
    off, llama.cpp's KQ softmax reads such cells with weight 0, and 0 * NaN is NaN: parking keeps its cells out of the
    attended range for that reason.)"""
    ctx = prefill(make_ctx, smollm2, flash_attn=flash_attn, type_kv=type_kv)
    gone = chosen()
    ctx.seq_cp(0, 1, -1, -1)
    ctx.page.evict(1, gone)
    chunk = random_tokens(7, seed=5, hi=4000)

    def chunk_logits() -> np.ndarray:
        ctx.decode(chunk, PROMPT, 1, logits="all")
        out = np.stack([ctx.logits(i) for i in range(len(chunk))])
        ctx.seq_rm(1, PROMPT, -1)
        return out

    before = chunk_logits()
    ctx.page.debug_poison(0, gone)  # the cells only sequence 0 holds: K and V NaN
    np.testing.assert_array_equal(chunk_logits(), before)
    ctx.page.debug_poison(0, ctx.page.positions(1)[50:51])  # a cell the copy holds: read, so NaN
    assert not np.isfinite(chunk_logits()).all()


@pytest.mark.parametrize("flash_attn", ["off", "on"])
def test_restore_gives_the_never_parked_outputs(smollm2, make_ctx, flash_attn):
    ctx = prefill(make_ctx, smollm2, flash_attn=flash_attn)
    held = ctx.page.positions(0).tolist()
    norms = ctx.page.key_norms(0, smollm2.n_layer, smollm2.n_head_kv)
    never = next_logits(ctx)
    park = chosen()

    ctx.page.park(0, PARK, park, gap=16)
    parked = next_logits(ctx)
    assert kl(never, parked) > 0.02  # three quarters of the prompt do change the next token's distribution

    ctx.page.restore(0, PARK, park[:100])  # some of them: back in seq 0, the rest stay parked
    assert ctx.page.parked(PARK).tolist() == park[100:].tolist()
    ctx.page.restore(0, PARK)  # the rest
    assert ctx.page.parked(PARK).size == 0
    assert ctx.page.positions(0).tolist() == held
    # every position's key is the same bytes, wherever its cell now sits
    np.testing.assert_array_equal(ctx.page.key_norms(0, smollm2.n_layer, smollm2.n_head_kv), norms)
    assert_close(next_logits(ctx), never)

    # and again: a second park of other positions and a restore
    ctx.page.park(0, PARK, chosen(seed=2, n=300), gap=0)
    ctx.page.restore(0, PARK)
    assert_close(next_logits(ctx), never)

    # in position order again (llama_page_order), the cells are read as never parked: the same bits
    ctx.page.order(0)
    np.testing.assert_array_equal(next_logits(ctx), never)
    np.testing.assert_array_equal(ctx.page.key_norms(0, smollm2.n_layer, smollm2.n_head_kv), norms)


def test_order_refuses_a_stream_it_does_not_hold_alone(smollm2, make_ctx):
    ctx = prefill(make_ctx, smollm2)
    park = chosen()
    ctx.page.park(0, PARK, park, gap=16)
    with pytest.raises(PageError, match="other sequences hold cells"):
        ctx.page.order(0)  # the parked cells are another sequence's
    assert ctx.page.parked(PARK).tolist() == park.tolist()
    ctx.page.restore(0, PARK)
    ctx.seq_cp(0, 1, 0, 10)  # shared cells
    with pytest.raises(PageError, match="shared with another sequence"):
        ctx.page.order(0)
    ctx.seq_rm(1, -1, -1)
    ctx.page.order(0)


def test_compaction_keeps_parked_cells(smollm2, make_ctx):
    ctx = prefill(make_ctx, smollm2, flash_attn="on")
    never = next_logits(ctx)
    park = chosen()
    ctx.page.park(0, PARK, park, gap=16)
    ctx.page.evict(0, ctx.page.positions(0)[20:40])  # holes among the held cells
    norms = ctx.page.key_norms(PARK, smollm2.n_layer, smollm2.n_head_kv)

    ctx.page.compact(0)

    assert ctx.page.parked(PARK).tolist() == park.tolist()
    np.testing.assert_array_equal(ctx.page.key_norms(PARK, smollm2.n_layer, smollm2.n_head_kv), norms)
    gone = set(range(PROMPT)) - set(ctx.page.positions(0).tolist()) - set(park.tolist())
    assert len(gone) == 20
    ctx.page.restore(0, PARK)
    ref = prefill(make_ctx, smollm2, flash_attn="on")
    ref.page.evict(0, sorted(gone))
    assert_close(next_logits(ctx), next_logits(ref))
    assert kl(never, next_logits(ctx)) < 1  # sanity: a cache close to the full one


def test_parking_refuses_bad_arguments_and_changes_nothing(smollm2, make_ctx):
    ctx = prefill(make_ctx, smollm2)
    held = ctx.page.positions(0).tolist()
    with pytest.raises(InvalidArgument, match="park into another sequence"):
        ctx.page.park(0, 0, [5])
    with pytest.raises(InvalidArgument, match="gap must be >= 0"):
        ctx.page.park(0, PARK, [5], gap=-1)
    with pytest.raises(InvalidArgument, match="out of range"):
        ctx.page.park(0, 3, [5])
    with pytest.raises(InvalidPositions, match="position 700 is not in sequence 0"):
        ctx.page.park(0, PARK, [5, 700])
    with pytest.raises(InvalidPositions, match="given twice"):
        ctx.page.park(0, PARK, [5, 5])
    assert ctx.page.positions(0).tolist() == held and ctx.page.parked(PARK).size == 0

    ctx.page.park(0, PARK, [5, 6, 7])
    with pytest.raises(InvalidPositions, match="position 8 is not in sequence 2"):
        ctx.page.restore(0, PARK, [7, 8])
    ctx.seq_rm(0, -1, -1)  # seq 0 read anew up to position 6: the parked 6 must not come back beside it
    ctx.decode(random_tokens(7, seed=4), 0, 0, logits="none")
    with pytest.raises(InvalidPositions, match="already holds position 5"):
        ctx.page.restore(0, PARK)
    assert ctx.page.parked(PARK).tolist() == [5, 6, 7]


def test_the_wall_parked_cells_take_memory_until_dropped(smollm2, make_ctx):
    """Parked cells hold their cells: a cache full of held + parked cells refuses the next token, and dropping parked
    positions for good (llama_page_evict on the parking sequence) makes room."""
    ctx = make_ctx(smollm2, n_ctx=512, n_seq_max=3, flash_attn="on")
    ctx.decode(random_tokens(512, seed=3), 0, 0, logits="none")
    ctx.page.park(0, PARK, np.arange(4, 400))
    from page_local.errors import DecodeError

    with pytest.raises(DecodeError, match="KV cache is full"):
        ctx.decode([500], 512, 0)
    ctx.page.evict(PARK, np.arange(4, 36))
    ctx.decode([500], 512, 0)
    assert np.isfinite(ctx.logits()).all()
    assert ctx.page.parked(PARK).tolist() == list(range(36, 400))
