"""LORE-KV: the deletion-cost probe against a float64 reference, the lookahead's futures, the evictor.

The deletion cost of key p for a query with attention a and head output o is
    c = a_p / (1 - a_p) * ||W_O^(h) (v_p - o)||     (docs/algorithms.md §4.2)
summed over heads. The tiny f32 models of tests/tiny_model.py give the exact reference.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_model as tm  # noqa: E402

from page_local.engine.engine import Engine  # noqa: E402
from page_local.evictors import get_evictor  # noqa: E402
from page_local.evictors.base import EvictionInput  # noqa: E402
from page_local.engine.lookahead import run_lookahead, score_answer  # noqa: E402
from page_local.evictors.lorekv import LookaheadSpec  # noqa: E402
from page_local.native.pageops import InvalidArgument, ProbeError  # noqa: E402
from page_local.engine.outproj import context_out_proj_factors, head_factor, out_proj_factors  # noqa: E402
from page_local.native.runtime import Context, ContextConfig, Model  # noqa: E402

from tests.conftest import random_tokens  # noqa: E402

PREFIX, Q = 300, 8
THREADS = 2


@pytest.fixture(scope="module", params=tm.FIDELITY_MODELS)
def tiny(request, tmp_path_factory):
    return tm.write_fidelity_model(request.param, tmp_path_factory.mktemp("tiny"))


def reference_costs(w, ref, queries, keys, mode: str) -> np.ndarray:
    """f64 (n_layer, len(queries), len(keys)): explicit per-head deletion costs summed over heads."""
    out = np.zeros((w.n_layer, len(queries), len(keys)))
    for il in range(w.n_layer):
        for h in range(w.n_head):
            V = ref.v[il][:, h // w.n_rep, :]  # (n_tokens, d)
            blk = w.layers[il].wo[:, h * w.d_head:(h + 1) * w.d_head]
            proj = {"wo": blk, "none": np.eye(w.d_head), "gain": np.linalg.norm(blk) / np.sqrt(w.d_head) * np.eye(w.d_head)}[mode]
            for i, q in enumerate(queries):
                a = ref.attn[il, h, q, :]
                o = a @ V
                c = a / np.maximum(1.0 - a, 1e-6) * np.linalg.norm((V - o) @ proj.T, axis=1)
                out[il, i] += c[keys]
    return out


def _bound(w) -> float:
    # llama: the 1e-4. gemma3: ggml's fp16 GELU table is emulated only approximately by the
    # reference (the same 2e-3 bound as tests/test_probe_fidelity.py)
    return 1e-4 if w.arch == "llama" else 2e-3


@pytest.mark.parametrize("flash_attn", ["off", "on"], ids=["flash-off", "flash-on"])
@pytest.mark.parametrize("mode", ["wo", "none"])
def test_deletion_cost_equals_float64_reference(tiny, mode, flash_attn):
    tokens = np.random.default_rng(7).integers(tm.N_SPECIAL, tiny.n_vocab, size=PREFIX + Q).tolist()
    ref = tm.reference_forward(tiny, tokens, fa_f16=flash_attn == "on", fa_split=[PREFIX, Q], fa_n_threads=THREADS)
    n = PREFIX + Q
    want = reference_costs(tiny, ref, range(PREFIX, n), np.arange(n), mode)
    with Model(tiny.path) as model, Context(model, ContextConfig(
            n_ctx=1024, threads=THREADS, flash_attn=flash_attn, type_kv="f32")) as ctx:
        ctx.page.set_out_proj(out_proj_factors(tiny.path, mode))
        ctx.decode(tokens[:PREFIX], 0, logits="none")
        ctx.page.arm_cost_probe(0)
        ctx.decode(tokens[PREFIX:], PREFIX)
        pos, queries, got = ctx.page.read_costs()
    assert pos.tolist() == list(range(n)) and queries.tolist() == list(range(PREFIX, n))
    assert got.shape == want.shape
    for il in range(tiny.n_layer):
        err = np.abs(got[il] - want[il]).max() / np.abs(want[il]).max()
        assert err <= _bound(tiny), f"layer {il}: relative error {err:.2e}"
    # positions after a query (causal) and outside a sliding window cost exactly 0
    for i in range(Q):
        assert np.all(got[:, i, PREFIX + i + 1:] == 0)
    if any(tiny.swa_layers):
        il = tiny.swa_layers.index(True)
        assert np.all(got[il, :, : PREFIX - 64 + 1] == 0)


def test_costs_of_futures_that_share_the_prompt(tiny):
    """Two sampled-continuation-like sequences share the prompt's cells; each batch holds a token of
    each. Their costs over the prompt equal the reference of prompt + that future, on the first step
    (value norms computed) and the second (value norms reused from the first)."""
    prompt = np.random.default_rng(3).integers(tm.N_SPECIAL, tiny.n_vocab, size=PREFIX).tolist()
    steps = [[tm.N_SPECIAL + 5, tm.N_SPECIAL + 40], [tm.N_SPECIAL + 7, tm.N_SPECIAL + 9]]
    got = []
    with Model(tiny.path) as model, Context(model, ContextConfig(
            n_ctx=1024, n_seq_max=3, threads=THREADS, flash_attn="off", type_kv="f32")) as ctx:
        ctx.page.set_out_proj(out_proj_factors(tiny.path, "wo"))
        ctx.decode(prompt, 0, logits="none")
        for s in (1, 2):
            ctx.seq_cp(0, s)
        for t, ys in enumerate(steps):
            ctx.page.arm_cost_probe(0, reuse_value_norms=t > 0)
            ctx.decode_step(ys, [PREFIX + t] * 2, [1, 2])
            pos, _, c = ctx.page.read_costs()
            assert pos.tolist() == list(range(PREFIX))
            got.append(c)
        assert ctx.cells_used(0) == PREFIX  # the futures' tokens are not in the target sequence
        # a stale cache is never used: after the target changes, "reuse" recomputes
        ctx.page.evict(0, [10])
        ctx.seq_rm(1, PREFIX, -1)
        ctx.seq_rm(2, PREFIX, -1)
        for reuse in (True, False):
            ctx.seq_rm(1, PREFIX, -1)
            ctx.page.arm_cost_probe(0, reuse_value_norms=reuse)
            ctx.decode_step([steps[0][0]], [PREFIX], [1])
            pos, _, c = ctx.page.read_costs()
            got.append(c)
        np.testing.assert_array_equal(got[2], got[3])
        assert 10 not in pos
    for t in range(2):
        for i in range(2):
            ref = tm.reference_forward(tiny, prompt + [steps[u][i] for u in range(t + 1)])
            want = reference_costs(tiny, ref, [PREFIX + t], np.arange(PREFIX), "wo")[:, 0, :]
            err = np.abs(got[t][:, i, :] - want).max() / np.abs(want).max()
            assert err <= _bound(tiny), f"step {t}, future {i}: relative error {err:.2e}"


def test_an_answer_scores_the_prompt_as_its_reference_says(tiny):
    """lorekv-answer's scoring: the answer decoded in a copy of the prompt, in batches of n_ubatch, gives
    the prompt's deletion costs under the answer's queries, averaged over them, as the float64 reference
    of prompt + answer; the copy is gone afterwards and the prompt untouched."""
    rng = np.random.default_rng(11)
    prompt = rng.integers(tm.N_SPECIAL, tiny.n_vocab, size=PREFIX).tolist()
    answer = rng.integers(tm.N_SPECIAL, tiny.n_vocab, size=10).tolist()
    ref = tm.reference_forward(tiny, prompt + answer)
    want = reference_costs(tiny, ref, range(PREFIX, PREFIX + 10), np.arange(PREFIX), "wo").mean(axis=1)
    with Model(tiny.path) as model, Context(model, ContextConfig(
            n_ctx=1024, n_batch=4, n_ubatch=4, n_seq_max=2, threads=THREADS, flash_attn="off", type_kv="f32")) as ctx:
        ctx.decode(prompt, 0, logits="none")
        la = score_answer(ctx, 0, PREFIX - 1, answer, out_proj_factors(tiny.path, "wo"), work=1)
        assert ctx.seq_pos_max(1) == -1 and ctx.page.positions(0).tolist() == list(range(PREFIX))
    assert la.positions.tolist() == list(range(PREFIX)) and la.n_fed.tolist() == [10] and la.tokens == [answer]
    assert la.cost.shape == (1, tiny.n_layer, PREFIX)
    for il in range(tiny.n_layer):
        err = np.abs(la.cost[0, il] - want[il]).max() / np.abs(want[il]).max()
        assert err <= _bound(tiny), f"layer {il}: relative error {err:.2e}"


def test_out_proj_factors_preserve_the_projected_norm(smollm2, make_ctx, smollm2_path):
    ctx = make_ctx(smollm2, n_ctx=256)
    r_ctx = context_out_proj_factors(ctx, smollm2.n_layer, smollm2.n_head, smollm2.n_embd, "wo")
    r_file = out_proj_factors(smollm2_path, "wo")
    np.testing.assert_allclose(r_ctx, r_file, rtol=0, atol=1e-5)  # ggml and gguf-py dequantize alike
    w = ctx.page.out_proj_weight(3, smollm2.n_embd).astype(np.float64)
    d = r_ctx.shape[-1]
    x = np.random.default_rng(0).standard_normal((d, 5))
    for h in (0, smollm2.n_head - 1):
        blk = w[:, h * d:(h + 1) * d]
        np.testing.assert_allclose(np.linalg.norm(r_ctx[3, h].astype(np.float64) @ x, axis=0),
                                   np.linalg.norm(blk @ x, axis=0), rtol=1e-5)
    # rank-deficient blocks take the eigendecomposition and still preserve the norm
    blk = np.random.default_rng(1).standard_normal((20, 6))
    blk[:, 5] = blk[:, 4]
    np.testing.assert_allclose(np.linalg.norm(head_factor(blk) @ x[:6], axis=0), np.linalg.norm(blk @ x[:6], axis=0),
                               rtol=1e-9)
    np.testing.assert_allclose(head_factor(blk, "none"), np.eye(6))


def test_cost_probe_errors(smollm2, make_ctx):
    ctx = make_ctx(smollm2, n_ctx=512)
    with pytest.raises(InvalidArgument, match="llama_page_set_out_proj"):
        ctx.page.arm_cost_probe(0)
    with pytest.raises(InvalidArgument, match="n_layer"):
        ctx.page.set_out_proj(np.zeros((2, 9, 64, 64), dtype=np.float32))
    bad = np.zeros((smollm2.n_layer, smollm2.n_head, 64, 64), dtype=np.float32)
    bad[0, 0, 0, 0] = np.nan
    with pytest.raises(InvalidArgument, match="non-finite"):
        ctx.page.set_out_proj(bad)
    ctx.page.set_out_proj(np.zeros((smollm2.n_layer, smollm2.n_head, 64, 64), dtype=np.float32))
    toks = random_tokens(40)
    ctx.decode(toks[:-4], 0, logits="none")
    ctx.page.arm_cost_probe(0)
    ctx.decode(toks[-4:], len(toks) - 4)
    with pytest.raises(ProbeError, match="read_costs"):
        ctx.page.read_probe()
    ctx.page.arm_probe(0, 4)
    ctx.decode([toks[0]], len(toks))
    with pytest.raises(ProbeError, match="deletion costs"):
        ctx.page.read_costs()


@pytest.fixture(scope="module")
def lk_model(smollm2_path):
    with Model(smollm2_path) as m:
        yield m


def _prefilled(model, toks, **cfg):
    cfg = dict(n_ctx=1024, n_seq_max=9, threads=THREADS, flash_attn="off") | cfg
    ctx = Context(model, ContextConfig(**cfg))
    ctx.decode(toks, 0, 0)
    return ctx


def test_futures_leave_no_trace(lk_model):
    """After the lookahead the cache holds exactly what it held, and the next token's logits are
    bit-identical to a run that never looked ahead."""
    toks = random_tokens(160, seed=5)  # the cache and the next logits are compared: any length will do
    r = context_out_proj_factors
    plain = _prefilled(lk_model, toks)
    looked = _prefilled(lk_model, toks)
    try:
        proj = r(looked, lk_model.n_layer, lk_model.n_head, lk_model.n_embd)
        la = run_lookahead(looked, 0, looked.logits(), LookaheadSpec(futures=4, tokens=8, seed=1), proj,
                           lk_model.is_eog)
        assert la.cost.shape == (4, lk_model.n_layer, len(toks)) and np.all(la.n_fed >= 1)
        assert np.all(la.cost >= 0) and la.cost.sum() > 0
        for s in range(1, 9):
            assert looked.seq_pos_max(s) == -1  # every future is gone
        np.testing.assert_array_equal(looked.page.positions(0), plain.page.positions(0))
        for ctx in (plain, looked):
            ctx.decode([toks[-1] + 1], len(toks), 0)
        np.testing.assert_array_equal(looked.logits(), plain.logits())
        np.testing.assert_array_equal(looked.page.positions(0), plain.page.positions(0))
    finally:
        plain.close()
        looked.close()


def test_seeded_lookahead_is_deterministic(lk_model):
    toks = random_tokens(120, seed=6)
    runs = []
    for seed in (3, 3, 4):
        ctx = _prefilled(lk_model, toks)
        try:
            proj = context_out_proj_factors(ctx, lk_model.n_layer, lk_model.n_head, lk_model.n_embd)
            runs.append(run_lookahead(ctx, 0, ctx.logits(), LookaheadSpec(futures=2, tokens=6, seed=seed), proj,
                                      lk_model.is_eog))
        finally:
            ctx.close()
    assert runs[0].tokens == runs[1].tokens
    np.testing.assert_array_equal(runs[0].cost, runs[1].cost)
    assert runs[0].tokens != runs[2].tokens


def test_lookahead_shrinks_to_the_free_cells(lk_model):
    toks = random_tokens(488, seed=7)
    ctx = _prefilled(lk_model, toks, n_ctx=512)  # 23 free cells once one is kept for the answer
    try:
        proj = context_out_proj_factors(ctx, lk_model.n_layer, lk_model.n_head, lk_model.n_embd, "gain")
        la = run_lookahead(ctx, 0, ctx.logits(), LookaheadSpec(futures=4, tokens=32), proj, lk_model.is_eog)
        assert la.cost.shape[0] * max(la.n_fed) <= 23 and "shortened" in la.note
        assert ctx.page.positions(0).size == 488
    finally:
        ctx.close()


def test_lorekv_evictor_aggregates_and_validates():
    from page_local.engine.lookahead import Lookahead

    held = np.arange(100, dtype=np.int32)
    cost = np.zeros((2, 3, 100))
    cost[0, :, 50] = 1.0  # future 0 needs position 50, future 1 position 60
    cost[1, :, 60] = 1.0
    la = Lookahead(positions=held, cost=cost, n_fed=np.array([4, 4]), logprob=np.array([-0.1, -3.0]),
                   entropy=np.array([0.5, 0.5]))
    inp = EvictionInput(held=held, budget=4 + 32 + 1, window=np.arange(68, 100), lookahead=la)
    uni = get_evictor("lorekv").select(inp)
    assert 50 in uni and 60 not in uni  # tie broken toward the lower position
    traj = get_evictor("lorekv", weighting="trajectory", beta=5.0).weights(la)
    assert traj[0] > 0.99  # the likelier future dominates
    la0 = Lookahead(positions=held, cost=cost, n_fed=np.array([0, 4]), logprob=np.zeros(2), entropy=np.zeros(2))
    np.testing.assert_array_equal(get_evictor("lorekv").weights(la0), [0.0, 1.0])
    for bad in (dict(futures=0), dict(futures=9), dict(tokens=0), dict(temperature=0), dict(top_p=1.5),
                dict(projection="qr"), dict(weighting="entropy"), dict(beta=float("nan"))):
        with pytest.raises(ValueError):
            get_evictor("lorekv", **bad)
    with pytest.raises(ValueError, match="lookahead"):
        get_evictor("lorekv").select(EvictionInput(held=held, budget=40, window=np.arange(68, 100)))


HAY = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
# ~560 tokens: what is tested is that the lookahead leaves no trace and verify/search read the full cache's
# answer, not a length
NEEDLE = (HAY * 10 + "One of the special magic numbers for cold-ocean is: 4817302.\n" + HAY * 10
          + "What is the special magic number for cold-ocean mentioned in the provided text? "
            "The special magic number for cold-ocean mentioned in the provided text is")


@pytest.fixture(scope="module")
def engine(smollm2_path):
    with Engine(smollm2_path, n_ctx=1024, threads=THREADS, gate="always", evictor="lorekv", flash_attn="off",
                evictor_options=dict(futures=2, tokens=8)) as e:
        yield e


@pytest.fixture(scope="module")
def full_answer(engine):
    """The full cache's greedy answer to NEEDLE (gate never), 12 tokens at most: greedy decoding is the same
    token for token whatever max_tokens, so a shorter answer is a prefix of it."""
    engine.set_gate("never")
    return engine.generate(NEEDLE, max_tokens=12).tokens


def test_engine_evicts_with_lorekv_and_keeps_no_future(engine):
    engine.set_gate("always")
    engine.set_budget(0.25)
    r = engine.generate(NEEDLE, max_tokens=6)
    d = r.decision
    assert d.evicted and d.evictor == "lorekv" and d.kept == d.B and d.lookahead_ms > 0
    assert engine.cells_used() == d.B + len(r.tokens)  # futures never count against the budget
    assert all(engine.ctx.seq_pos_max(s) == -1 for s in range(1, 9))


def test_verify_with_lorekv_streams_the_full_cache_tokens(engine, full_answer):
    """The lookahead overwrites the logits buffer; under verify the answer's first tokens must still
    come from the full cache, exactly as without any eviction."""
    full = full_answer[:10]
    engine.set_gate("verify")
    engine.set_budget(0.25)
    r = engine.generate(NEEDLE, max_tokens=10)
    assert r.decision.verify_m == min(10, len(full)) and r.decision.verify_delta is not None
    assert r.tokens == full


def test_run_with_lorekv_from_the_cli(cli):
    import json

    prompt = "The grass is green. The sky is blue. " * 12  # ~120 tokens: a half is above the floor of 40
    res = cli("run", "--prompt", prompt, "--json", "--gate", "always", "--evictor", "lorekv", "--budget", "0.5",
              "--max-tokens", "4", "--threads", "1", "--n-ctx", "512")
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)["decision"]
    assert d["evictor"] == "lorekv" and d["evicted"] and d["lookahead_ms"] > 0 and d["kept"] == d["B"]


# --- lorekv-answer: the full cache's answer is the one future ------------------------------------------

def test_lorekv_answer_is_searched_on_the_answer_it_was_scored_by(engine, full_answer):
    """Under search the keep sets are chosen at the check, from the answer's queries; the user reads the
    full cache's answer, nothing is left in the other sequences, and the decision says what it cost."""
    full = full_answer
    engine.set_gate("search")
    engine.set_evictor("lorekv-answer")
    try:
        r = engine.generate(NEEDLE, max_tokens=12)
    finally:
        engine.set_evictor("lorekv", futures=2, tokens=8)
    d = r.decision
    assert r.tokens == full
    assert d.evictor == "lorekv-answer" and d.lookahead_ms > 0 and len(d.search) == 4
    assert d.evicted and d.kept == d.B == next(x["B"] for x in d.search if x["passed"])
    assert all(engine.ctx.seq_pos_max(s) == -1 for s in range(1, 9))


def test_lorekv_answer_needs_a_gate_that_has_the_answer(engine, cli):
    engine.set_gate("always")
    with pytest.raises(ValueError, match="only the verify and search gates"):
        engine.set_evictor("lorekv-answer")
    engine.set_gate("verify")
    engine.set_evictor("lorekv-answer")
    try:
        with pytest.raises(ValueError, match="only the verify and search gates"):
            engine.set_gate("page")
        assert engine.gate_mode == "verify"  # a refused change changes nothing
    finally:
        engine.set_evictor("lorekv", futures=2, tokens=8)
    res = cli("run", "--prompt", "The sky is blue. " * 8, "--gate", "always", "--evictor", "lorekv-answer",
              "--max-tokens", "2", "--threads", "1", "--n-ctx", "256")
    assert res.exit_code != 0 and "only the verify and search gates" in res.output
    assert "Traceback" not in res.output
