"""In-place compaction (llama_page_compact) on the real patched library, with the embedded SmolLM2
(one plain cache) and a tiny gemma3 (iSWA: a full-attention and a sliding-window cache).

Where every position sits in the cache is read back through the attention probe: armed for one
token, it leaves per layer a graph output `page_probe-<il>` of F32 [n_kv, n_head] (the softmax per
cell), and its result holds the same numbers per position (rows, divided by n_query = 1, exactly).
Matching the two gives the position -> cell map of every layer, flash attention on or off.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_model as tm  # noqa: E402

from page_local.native import pageops as native  # noqa: E402
from page_local.native.pageops import UnsupportedModel  # noqa: E402
from tests.capture import tensor_capture  # noqa: E402
from tests.conftest import on_gpu, random_tokens  # noqa: E402

N_CTX, PROMPT, EXTRA = 1024, 600, 24


# The token decoded after the cache (SmolLM2: the one test_native uses; 250 fits the tiny vocabulary).
# Where cells sit changes the order of the sums over the cache; with an f16 cache some tokens amplify
# that rounding (SmolLM2's token 7: ~0.3 in the logits, with llama.cpp's own state save/restore as
# much as with compaction, see test_compact_equals_state_save_restore; an f32 cache stays exact).
def query_token(model) -> int:
    return 500 if model.n_vocab > 500 else 250


def probe_capture():
    """A cb_eval callback keeping a copy of every `page_probe-<il>` tensor: {il: f32 (n_head, n_kv)}."""
    cb, captured, _armed = tensor_capture("page_probe-", dims=2)
    return cb, captured


def read_layout(ctx, captured, seq_id):
    """Decode query_token() after seq_id's newest position with the probe armed, then remove it again.
    Returns (cells, query_cell, logits): cells[il] = {position: cell} of what layer il sees (a
    sliding-window layer sees its window only), query_cell[il] the cell the new token landed in."""
    q = ctx.seq_pos_max(seq_id) + 1
    captured.clear()
    ctx.page.arm_probe(seq_id, 1, keep_rows=True)
    ctx.decode([query_token(ctx.model)], q, seq_id)
    logits = ctx.logits()
    r = ctx.page.read_probe()
    ctx.seq_rm(seq_id, q, -1)
    cells, query_cell = [], []
    for il in range(r.rows.shape[0]):
        sums = captured[il]  # (n_head, n_kv)
        by_column = {}
        for c in np.flatnonzero(sums.any(axis=0)):
            key = sums[:, c].tobytes()
            assert key not in by_column, f"layer {il}: two cells with identical scores"
            by_column[key] = int(c)
        m = {int(p): by_column[r.rows[il, :, i].tobytes()]
             for i, p in enumerate(r.positions) if r.rows[il, :, i].any()}
        query_cell.append(m.pop(q))
        cells.append(m)
    return cells, query_cell, logits


def assert_same_outputs(after, before, flash_attn, type_kv):
    """Logits of the same cache contents in another cell layout. Where cells sit changes the order
    of the sums over the cache. FA off with an f16 cache this has been bit-identical (test_native
    relies on it too); the f32 kernels round differently (~1e-6). FA on, the CPU kernel accumulates
    V in f16: the distribution stays close (~5e-3 here at worst) with the same argmax. On a GPU, flash attention
    off too (cuBLAS sums in another order per layout: logits 0.4 apart on an H200, the same check as on)."""
    if flash_attn == "off" and type_kv == "f16" and not on_gpu():
        np.testing.assert_array_equal(after, before)
    elif flash_attn == "off" and not on_gpu():
        assert np.max(np.abs(after - before)) <= 1e-5 * np.max(np.abs(before))
    else:
        p, q = (np.exp(x - x.max()) / np.exp(x - x.max()).sum() for x in (before, after))
        assert np.max(np.abs(p - q)) <= 2e-2
        assert np.argmax(after) == np.argmax(before)


def save_state(ctx) -> bytes:
    """The whole context's state (every cell with all its sequences, in cell order)."""
    lc = native.llama_cpp()
    size = lc.llama_state_get_size(ctx.ptr)
    buf = (ctypes.c_uint8 * size)()
    assert lc.llama_state_get_data(ctx.ptr, buf, size) == size
    return bytes(buf)


def load_state(ctx, data: bytes) -> None:
    """Restore save_state(): llama.cpp writes the cells back from cell 0 on, in their saved order,
    each with all its sequences: what compaction does in place."""
    lc = native.llama_cpp()
    buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
    assert lc.llama_state_set_data(ctx.ptr, buf, len(data)) == len(data)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    w = tm.write_tiny_llama(tmp_path_factory.mktemp("compact") / "gemma3.gguf", n_layer=4, n_head=4, n_head_kv=2,
                            sliding_window=32)
    from page_local.native.runtime import Model

    with Model(w.path) as m:
        yield m, w.swa_layers


# (model, KV cache type, flash attention): SmolLM2 f16 with V transposed (FA off) and not, SmolLM2
# q8_0 rows (needs FA), tiny gemma3 iSWA with an f32 cache
CONFIGS = [("smollm2", "f16", "off"), ("smollm2", "f16", "on"), ("smollm2", "q8_0", "on"),
           ("gemma3", "f32", "off"), ("gemma3", "f32", "on")]
# host staging (bytes), each on the same cache: the default (one chunk per tensor); 5000: K rows in
# many chunks, transposed V lanes in groups of 2-3; 1000: shorter than one transposed V lane, so each
# lane is chunked by cells
STAGING = [None, 5000, 1000]


def setup_model(request, name):
    if name == "smollm2":
        model = request.getfixturevalue("smollm2")
        return model, (False,) * model.n_layer
    return request.getfixturevalue("gemma3")


@pytest.mark.parametrize("name,type_kv,flash_attn", CONFIGS, ids=["-".join(c) for c in CONFIGS])
def test_compact_packs_cells_keeps_order_sharing_and_outputs(request, make_ctx, monkeypatch, name, type_kv,
                                                             flash_attn):
    model, swa = setup_model(request, name)
    cb, captured = probe_capture()
    ctx = make_ctx(model, cb_eval=cb, n_ctx=N_CTX, n_seq_max=2, flash_attn=flash_attn, type_kv=type_kv)
    ctx.decode(random_tokens(PROMPT, seed=12, hi=min(4000, model.n_vocab)), 0, 0, logits="none")
    prompt = save_state(ctx)  # cell i holds position i, as after the prefill
    logits = []
    for staging in STAGING:
        if staging is None:
            monkeypatch.delenv("PAGE_LOCAL_COMPACT_STAGING", raising=False)
        else:
            monkeypatch.setenv("PAGE_LOCAL_COMPACT_STAGING", str(staging))
        load_state(ctx, prompt)
        logits.append(check_compaction(ctx, captured, swa, flash_attn, type_kv))
    for other in logits[1:]:  # the staging size changes how the bytes travel, not where they land
        for s in (0, 1):
            np.testing.assert_array_equal(other[s], logits[0][s])


def check_compaction(ctx, captured, swa, flash_attn, type_kv) -> dict[int, np.ndarray]:
    """Two sequences with holes and shared cells, compacted; returns each one's next-token logits."""
    rng = np.random.default_rng(11)
    # seq 1 shares the prompt's cells; each sequence then loses its own random positions (sinks and
    # the last tokens stay), and seq 1 gets tokens of its own, which land in freed cells
    ctx.seq_cp(0, 1)
    for s in (0, 1):
        ctx.page.evict(s, rng.choice(np.arange(4, PROMPT - 8), size=250, replace=False))
    ctx.decode(random_tokens(EXTRA, seed=13, hi=min(4000, ctx.model.n_vocab)), PROMPT, 1, logits="none")
    held = {s: ctx.page.positions(s).tolist() for s in (0, 1)}
    before = {s: read_layout(ctx, captured, s) for s in (0, 1)}
    state = save_state(ctx)

    ctx.page.compact(0)

    after = {s: read_layout(ctx, captured, s) for s in (0, 1)}
    load_state(ctx, state)  # the reference: llama.cpp's own whole-cache save and restore
    ref = {s: read_layout(ctx, captured, s) for s in (0, 1)}
    glob = [il for il, is_swa in enumerate(swa) if not is_swa]
    n_used = len(set(held[0]) | set(held[1]))  # shared positions are one cell each
    for s in (0, 1):
        assert ctx.page.positions(s).tolist() == held[s]
        cells_a, query_a, logits_a = after[s]
        assert_same_outputs(logits_a, before[s][2], flash_attn, type_kv)
        # the reference holds every cell where compaction put it, in every layer (the SWA cache too)
        assert cells_a == ref[s][0]
        if not any(swa):  # then also the next token's cell: bit for bit, flash attention on or off
            np.testing.assert_array_equal(logits_a, ref[s][2])
        else:  # the restore restarts the SWA cache's search at cell 0: the token reuses a cell out of the window
            assert_same_outputs(logits_a, ref[s][2], flash_attn, type_kv)
        for il in glob:
            assert set(cells_a[il]) == set(held[s])
            assert query_a[il] == n_used  # the next token lands right after the packed cells
    for il in glob:
        # the used cells are exactly the lowest ones, in their previous order, and still shared
        b = {**before[0][0][il], **before[1][0][il]}
        a = {**after[0][0][il], **after[1][0][il]}
        assert max(b.values()) >= n_used  # eviction had left holes
        assert sorted(a.values()) == list(range(n_used))
        order = sorted(b, key=b.get)
        assert [a[p] for p in order] == list(range(n_used))
        shared = set(held[0]) & set(held[1])
        assert all(after[0][0][il][p] == after[1][0][il][p] for p in shared)
    for il in (il for il, is_swa in enumerate(swa) if is_swa):
        # the sliding-window cache has its own cells (new tokens may reuse cells that left the window):
        # its next token lands right after its packed cells, the window keeps its order and sharing
        q = after[0][1][il]
        assert after[1][1][il] == q <= n_used
        for s in (0, 1):
            a, b = after[s][0][il], before[s][0][il]
            assert set(a) == set(b) and all(c < q for c in a.values())
            assert sorted(a.values()) == [a[p] for p in sorted(b, key=b.get)]
        shared = set(after[0][0][il]) & set(after[1][0][il])
        assert all(after[0][0][il][p] == after[1][0][il][p] for p in shared)
    return {s: after[s][2] for s in (0, 1)}


@pytest.mark.parametrize("flash_attn", ["off", "on"], ids=["flash-off", "flash-on"])
@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_compact_of_a_compact_cache_is_a_no_op(request, make_ctx, name, flash_attn):
    model, _ = setup_model(request, name)
    cb, captured = probe_capture()
    ctx = make_ctx(model, cb_eval=cb, n_ctx=N_CTX, flash_attn=flash_attn)
    ctx.decode(random_tokens(300, seed=14, hi=min(4000, model.n_vocab)), 0, 0, logits="none")
    fresh = read_layout(ctx, captured, 0)
    ctx.page.compact(0)  # a fresh prefill is already compact
    once = read_layout(ctx, captured, 0)
    ctx.page.evict(0, np.arange(10, 200, 3))
    ctx.page.compact(0)
    twice_a = read_layout(ctx, captured, 0)
    ctx.page.compact(0)
    twice_b = read_layout(ctx, captured, 0)
    for x, y in ((once, fresh), (twice_b, twice_a)):
        assert x[0] == y[0] and x[1] == y[1]
        np.testing.assert_array_equal(x[2], y[2])  # same cells, so bit-identical even with flash attention


def test_compact_moves_a_pending_shift(smollm2, make_ctx):
    """llama_memory_seq_add before the next decode leaves a pending K-shift on the cells; it moves
    with them and is applied at the next decode, exactly as without compaction."""
    lc = native.llama_cpp()
    toks = random_tokens(250, seed=15)
    logits = []
    for compact in (False, True):
        ctx = make_ctx(smollm2, n_ctx=N_CTX, flash_attn="off")
        ctx.decode(toks, 0, 0, logits="none")
        ctx.page.evict(0, np.arange(50, 150))
        lc.llama_memory_seq_add(ctx.mem, 0, 150, -1, -100)  # close the gap: positions 0..149
        if compact:
            ctx.page.compact(0)
        assert ctx.page.positions(0).tolist() == list(range(150))
        ctx.decode([query_token(smollm2)], 150, 0)
        logits.append(ctx.logits())
    np.testing.assert_array_equal(logits[1], logits[0])


def test_compact_refuses_an_unmovable_pending_shift(smollm2, make_ctx):
    lc = native.llama_cpp()
    ctx = make_ctx(smollm2, n_ctx=N_CTX, flash_attn="off")
    ctx.decode(random_tokens(100, seed=16), 0, 0, logits="none")
    ctx.page.evict(0, np.arange(10, 20))
    lc.llama_memory_seq_div(ctx.mem, 0, 50, 100, 3)  # upstream records p - p/3 as the shift: not movable
    held = ctx.page.positions(0).tolist()
    with pytest.raises(UnsupportedModel, match="pending position shift.*nothing was changed"):
        ctx.page.compact(0)
    assert ctx.page.positions(0).tolist() == held
    ctx.decode([query_token(smollm2)], ctx.seq_pos_max(0) + 1, 0)  # the context stays usable
    held = ctx.page.positions(0).tolist()
    ctx.page.compact(0)  # and once the decode has applied the shift, it compacts
    assert ctx.page.positions(0).tolist() == held


@pytest.mark.parametrize("flash_attn", ["off", "on"], ids=["flash-off", "flash-on"])
def test_compact_equals_state_save_restore(smollm2, make_ctx, flash_attn):
    """One sequence: compaction leaves the cache exactly as llama.cpp's own save / clear / restore
    (which writes the cells back from cell 0): bit-identical logits, even for a token that is
    sensitive to where cells sit (7) and with flash attention on."""
    # 320 tokens losing 130 (the packing test's are 600 and 250): both routes write the same cells from cell 0
    prompt, n_evict = 320, 130
    toks = random_tokens(prompt, seed=12)
    evict = np.random.default_rng(11).choice(np.arange(4, prompt - 8), size=n_evict, replace=False)
    logits = []
    for route in ("compact", "state"):
        ctx = make_ctx(smollm2, n_ctx=N_CTX, flash_attn=flash_attn)
        ctx.decode(toks, 0, 0, logits="none")
        ctx.page.evict(0, evict)
        if route == "compact":
            ctx.page.compact(0)
        else:
            state = ctx.seq_state(0)
            ctx.clear()
            ctx.set_seq_state(state, 0)
        ctx.decode([7], prompt, 0)
        logits.append(ctx.logits())
    np.testing.assert_array_equal(logits[0], logits[1])
