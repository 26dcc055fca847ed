"""Evictors: invariants shared by every registered evictor, then each method's own behaviour."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from page_local.evictors import EVICTORS, EvictionInput, get_evictor, resolve_budget
from page_local.evictors.pyramidkv import layer_budgets
from tests.factories import make_input, make_probe

# Every registered evictor with its defaults, plus the option variants worth covering.
EVERY = sorted(EVICTORS)
CONFIGS = [(name, {}) for name in EVERY] + [
    ("snapkv", {"pool": "avg", "kernel": 5}),
    ("snapkv", {"pool": "max", "kernel": 3}),
    ("pyramidkv", {"reduce": "weighted"}),
    ("pyramidkv", {"pool": "avg", "kernel": 7}),
    ("snapkv-spans", {"agg": "max"}),
    ("snapkv-spans", {"agg": "mean"}),
]
CONFIG_IDS = [name + "".join(f"-{k}={v}" for k, v in opts.items()) for name, opts in CONFIGS]

# (T, B, W, n_sink, seed, gaps)
CASES = [
    (64, 20, 8, 4, 0, False),
    (64, 20, 8, 4, 1, True),
    (64, 12, 8, 4, 2, False),  # B == protected: nothing to choose
    (100, 99, 8, 4, 3, True),  # evict one
    (200, 50, 32, 4, 4, True),
    (40, 13, 1, 0, 5, False),  # no sinks, one-query window
    (30, 30, 8, 4, 6, False),  # T == B: nothing to do
    (20, 50, 8, 4, 7, True),  # T < B
]
CASE_IDS = [f"T{T}-B{B}-W{W}-s{n}-seed{s}{'-gaps' if g else ''}" for T, B, W, n, s, g in CASES]


def check_invariants(inp: EvictionInput, keep: np.ndarray) -> None:
    assert keep.dtype == np.int32 and keep.ndim == 1
    assert np.all(np.diff(keep) > 0), "sorted and unique"
    assert np.all(np.isin(keep, inp.held)), "subset of held"
    if inp.T <= inp.budget:
        np.testing.assert_array_equal(keep, inp.held)
    else:
        assert keep.size == inp.budget
    assert np.all(np.isin(inp.held[: inp.n_sink], keep)), "sinks kept"
    assert np.all(np.isin(inp.window, keep)), "window kept"


def test_registry_covers_the_documented_methods():
    assert set(EVICTORS) == {"snapkv", "snapkv-spans", "streamingllm", "h2o", "tova", "knorm", "pyramidkv", "random",
                             "lorekv", "lorekv-answer"}
    for name, cls in EVICTORS.items():
        assert cls.name == name
        assert cls.needs <= {"probe", "last_query", "prefill_attention", "key_norms", "lookahead", "answer_lookahead",
                             "spans"}


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("name, opts", CONFIGS, ids=CONFIG_IDS)
def test_invariants(name, opts, case):
    T, B, W, n_sink, seed, gaps = case
    inp = make_input(T, B, W=W, n_sink=n_sink, seed=seed, gaps=gaps)
    keep = get_evictor(name, **opts).select(inp)
    check_invariants(inp, keep)
    # Deterministic: same input, fresh instance -> same keep set.
    np.testing.assert_array_equal(keep, get_evictor(name, **opts).select(inp))


@pytest.mark.parametrize("name", sorted(n for n, c in EVICTORS.items() if c.needs), ids=str)
def test_missing_signal_is_a_clear_error(name):
    needs = EVICTORS[name].needs
    inp = make_input(64, 20, **{n: None for n in needs})
    with pytest.raises(ValueError, match=name):
        get_evictor(name).select(inp)


@pytest.mark.parametrize("name", EVERY, ids=str)
def test_nothing_needed_when_nothing_to_evict(name):
    inp = make_input(20, 40, probe=None, last_query=None, prefill_attention=None, key_norms=None)
    np.testing.assert_array_equal(get_evictor(name).select(inp), inp.held)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(EVERY), T=st.integers(1, 120), W=st.integers(0, 16),
       n_sink=st.integers(0, 6), extra=st.integers(0, 130), seed=st.integers(0, 2**31 - 1),
       gaps=st.booleans())
def test_invariants_property(name, T, W, n_sink, extra, seed, gaps):
    W = min(W, T)
    n_protected = len(set(range(min(n_sink, T))) | set(range(T - W, T)))
    inp = make_input(T, max(1, n_protected + extra), W=W, n_sink=n_sink, seed=seed, gaps=gaps)
    check_invariants(inp, get_evictor(name).select(inp))


# --- per-method behaviour ----------------------------------------------------------------------

def middle(keep, inp):
    """Kept positions that are not protected."""
    return sorted(set(keep.tolist()) - set(inp.held[inp.protected()].tolist()))


def test_snapkv_keeps_the_highest_scoring_middle_positions():
    held = np.arange(40, dtype=np.int32)
    mean = np.full((3, 40), 0.01, dtype=np.float32)
    mean[:, [10, 20, 25]] = 0.5
    mean[0, 30] = 0.9  # high in one layer only: mean 0.3, still above 0.01
    inp = make_input(40, 4 + 8 + 4, W=8, probe=make_probe(held, mean))
    assert middle(get_evictor("snapkv").select(inp), inp) == [10, 20, 25, 30]


def test_snapkv_ties_go_to_the_lower_position():
    held = np.arange(40, dtype=np.int32)
    inp = make_input(40, 4 + 8 + 3, W=8, probe=make_probe(held, np.zeros((2, 40))))
    assert middle(get_evictor("snapkv").select(inp), inp) == [4, 5, 6]


def test_snapkv_aligns_scores_through_probe_positions():
    # Held positions have gaps; the probe also saw position 7, which is no longer held, and did not
    # see held position 31, which therefore scores 0.
    held = np.array([0, 1, 2, 3, 9, 11, 15, 31, 40, 41, 42, 43], dtype=np.int32)
    positions = np.array([0, 1, 2, 3, 7, 9, 11, 15, 40, 41, 42, 43], dtype=np.int32)
    mean = np.zeros((1, positions.size))
    mean[0, positions == 7] = 9.0
    mean[0, positions == 11] = 1.0
    mean[0, positions == 15] = 0.5
    inp = EvictionInput(held=held, budget=4 + 4 + 2, window=held[-4:], probe=make_probe(positions, mean))
    assert middle(get_evictor("snapkv").select(inp), inp) == [11, 15]


def test_snapkv_avg_pooling_keeps_neighbours_of_a_peak():
    held = np.arange(60, dtype=np.int32)
    mean = np.zeros((1, 60))
    mean[0, 30] = 1.0
    mean[0, 45] = 0.3  # beats 30's neighbours without pooling, loses to them with kernel 5 (1/5 > 0.3/5)
    inp = make_input(60, 4 + 8 + 3, W=8, probe=make_probe(held, mean))
    assert middle(get_evictor("snapkv").select(inp), inp) == [4, 30, 45]  # 4: first of the zero ties
    assert middle(get_evictor("snapkv", pool="avg", kernel=5).select(inp), inp) == [28, 29, 30]


@pytest.mark.parametrize("opts", [dict(pool="mean"), dict(kernel=4), dict(kernel=0), dict(window=3)],
                         ids=["bad-pool", "even-kernel", "zero-kernel", "unknown-option"])
def test_snapkv_rejects_bad_options(opts):
    with pytest.raises(ValueError):
        get_evictor("snapkv", **opts)


@pytest.mark.parametrize("gaps", [False, True], ids=["contiguous", "gaps"])
def test_streamingllm_keeps_sinks_and_the_most_recent(gaps):
    inp = make_input(80, 30, W=8, gaps=gaps)
    keep = get_evictor("streamingllm").select(inp)
    np.testing.assert_array_equal(keep, np.concatenate([inp.held[:4], inp.held[-26:]]))


def test_h2o_keeps_recent_half_and_heavy_hitters():
    acc = np.zeros((2, 100), dtype=np.float32)
    acc[:, [10, 30, 50, 70]] = [5.0, 4.0, 3.0, 2.0]
    inp = make_input(100, 10, W=2, prefill_attention=acc)  # B = 10: 4 sinks, recent (10-4)//2 = 3, heavy 3
    keep = get_evictor("h2o").select(inp)
    np.testing.assert_array_equal(keep, [0, 1, 2, 3, 10, 30, 50, 97, 98, 99])


def test_h2o_keeps_the_window_when_it_is_longer_than_the_recent_half():
    inp = make_input(100, 4 + 32 + 4, W=32)  # recent half = 18 < W = 32
    check_invariants(inp, get_evictor("h2o").select(inp))


def test_tova_forces_the_last_token_and_follows_the_last_query():
    held = np.arange(50, dtype=np.int32)
    mean = np.zeros((2, 50))
    mean[:, [12, 13]] = 1.0
    inp = make_input(50, 4 + 0 + 3, W=0, last_query=make_probe(held, mean))
    keep = get_evictor("tova").select(inp)
    np.testing.assert_array_equal(keep, [0, 1, 2, 3, 12, 13, 49])


def test_knorm_keeps_the_lowest_norms():
    norms = np.full((1, 1, 60), 5.0, dtype=np.float32)
    norms[0, 0, [20, 21, 40]] = 1.0
    inp = make_input(60, 4 + 8 + 3, W=8, key_norms=norms)
    assert middle(get_evictor("knorm").select(inp), inp) == [20, 21, 40]


def test_knorm_z_mean_is_invariant_to_layer_scale():
    inp = make_input(90, 30, W=8, seed=3)
    scaled = inp.key_norms.copy()
    scaled[0] *= 1000.0  # a layer with much larger key norms must not dominate
    scaled[1] += 50.0
    a = get_evictor("knorm").select(inp)
    b = get_evictor("knorm").select(make_input(90, 30, W=8, seed=3, key_norms=scaled))
    np.testing.assert_array_equal(a, b)


def test_random_is_deterministic_per_seed_and_differs_across_seeds():
    keeps = [get_evictor("random").select(make_input(200, 60, seed=s)) for s in (0, 0, 1, 2)]
    np.testing.assert_array_equal(keeps[0], keeps[1])
    assert not np.array_equal(keeps[0], keeps[2]) and not np.array_equal(keeps[2], keeps[3])


def test_random_is_roughly_uniform():
    counts = np.zeros(100)
    for s in range(400):
        inp = make_input(100, 4 + 8 + 22, W=8, seed=s)
        counts[get_evictor("random").select(inp)] += 1
    mid = counts[4:92] / 400  # each middle position is kept with probability 22/88 = 0.25
    assert abs(mid.mean() - 0.25) < 1e-9 and mid.min() > 0.12 and mid.max() < 0.38


def test_pyramidkv_schedule():
    b = layer_budgets(K=100, n_evictable=1000, n_layer=5, beta=20)
    assert b.mean() == pytest.approx(100) and np.all(np.diff(b) < 0)
    assert b[-1] == pytest.approx(5) and b[0] == pytest.approx(195)
    capped = layer_budgets(K=100, n_evictable=150, n_layer=5)
    assert capped[0] == pytest.approx(150) and capped.mean() == pytest.approx(100)


def test_pyramidkv_rankunion_follows_the_layer_budgets():
    # Two layers, K = 40 slots: the schedule gives b = (78, 2). Layer 0 prefers 100..199, layer 1
    # prefers 300..399. Ordering by rank / b keeps layer 0's top 39 and layer 1's top 1 (both at
    # kappa = 0.5): the union of each layer's top picks in proportion to its budget.
    held = np.arange(500, dtype=np.int32)
    mean = np.zeros((2, 500))
    mean[0, 100:200] = np.linspace(1.0, 0.5, 100)
    mean[1, 300:400] = np.linspace(1.0, 0.5, 100)
    inp = make_input(500, 4 + 8 + 40, W=8, probe=make_probe(held, mean))
    np.testing.assert_allclose(layer_budgets(40, 500 - 12, 2), [78, 2])
    assert middle(get_evictor("pyramidkv").select(inp), inp) == list(range(100, 139)) + [300]


def test_pyramidkv_weighted_is_page_layer_weighted_mean():
    held = np.arange(60, dtype=np.int32)
    mean = np.zeros((3, 60))
    mean[0, 20] = 1.0  # weight 2.0
    mean[2, 40] = 1.0  # weight 0.5
    mean[1, 30] = 1.9  # weight 1.25: 2.375 > 2.0 > 0.5
    inp = make_input(60, 4 + 8 + 2, W=8, probe=make_probe(held, mean))
    assert middle(get_evictor("pyramidkv", reduce="weighted").select(inp), inp) == [20, 30]


def test_pyramidkv_rejects_unknown_reduce():
    with pytest.raises(ValueError, match="rankunion, weighted"):
        get_evictor("pyramidkv", reduce="max")


# --- registry, input and budget validation -----------------------------------------------------

# --- snapkv-spans: kept a sentence at a time (issue 43) ------------------------------------------------

def test_sentences_end_at_stops_newlines_control_tokens_and_the_span_cap():
    from page_local.evictors.spans import sentence_spans

    pieces = ["The", " code", " is", " ", "7", "8", ".", " Then", " he", " said", ' "no."', " Next", "\n", "<|im_end|>",
              "x", "y", "z", "w"]
    ids = sentence_spans(pieces, is_control=lambda i: pieces[i] == "<|im_end|>", max_span=3)
    assert ids.tolist() == [0, 0, 0, 1, 1, 1, 2, 3, 3, 3, 4, 5, 5, 6, 7, 7, 7, 8]
    assert sentence_spans(["a.", "b", "c"], max_span=64).tolist() == [0, 1, 1]
    with pytest.raises(ValueError, match="max_span must be an int >= 1, got 0"):
        sentence_spans(["a"], max_span=0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["a", " b", ".", "?\"", "\n", "<c>", " d.", "e "]), max_size=60),
       st.lists(st.integers(0, 60), max_size=5), st.integers(1, 6))
def test_sentences_cut_in_parts_are_the_sentences_cut_at_once(pieces, cuts, max_span):
    from page_local.evictors.spans import SentenceCut, sentence_spans

    control = [p == "<c>" for p in pieces]
    cut, bounds = SentenceCut(max_span), sorted({0, len(pieces), *(c for c in cuts if c <= len(pieces))})
    for a, b in zip(bounds, bounds[1:]):
        cut.extend(pieces[a:b], control[a:b])
    ids = sentence_spans(pieces, lambda i: control[i], max_span).tolist()
    assert cut.ids.tolist() == ids
    assert not cut.ids.flags.writeable
    texts = ["" for _ in range(max(ids) + 1 if ids else 0)]
    for p, c, i in zip(pieces, control, ids):
        texts[i] += "" if c else p
    assert cut.texts == texts


def spans_input(mean: np.ndarray, spans: list[int], budget: int) -> EvictionInput:
    held = np.arange(len(spans), dtype=np.int32)
    return EvictionInput(held=held, budget=budget, window=held[:0], n_sink=0, probe=make_probe(held, mean[None, :]),
                         spans=np.asarray(spans))


def test_a_high_scoring_cell_keeps_its_sentence_where_snapkv_keeps_the_cell():
    """A fact's key words score high and its value low (what the question's queries attend to): per cell,
    SnapKV keeps the key and drops the value; kept a sentence at a time, the value stays with its key."""
    spans = [0] * 6 + [1] * 6 + [2] * 6  # three sentences of 6 cells
    mean = np.full(18, 0.01)
    mean[[0, 13]] = 0.05  # a stray peak in sentences 0 and 2
    mean[6:8] = 0.3  # sentence 1's key
    inp = spans_input(mean, spans, 6)
    assert get_evictor("snapkv").select(inp).tolist() == [0, 1, 2, 6, 7, 13]  # ties: the lower positions
    assert get_evictor("snapkv-spans").select(inp).tolist() == [6, 7, 8, 9, 10, 11]


def test_spans_that_do_not_fit_leave_the_budget_to_the_best_cells():
    spans = [0] * 4 + [1] * 8 + [2] * 3
    mean = np.array([0.1] * 4 + [0.2] * 8 + [0.0, 0.05, 0.0])  # sentence 1 first, but it does not fit in 6
    keep = get_evictor("snapkv-spans").select(spans_input(mean, spans, 6))
    assert keep.tolist() == [0, 1, 2, 3, 4, 5]  # sentence 0 whole, then sentence 1's best cells (ties: first)
    keep = get_evictor("snapkv-spans").select(spans_input(mean, spans, 14))
    assert keep.tolist() == list(range(14))  # both whole, then 13 (0.05) and 12 (ties with 14: the lower)


def test_a_sentence_keeps_the_best_score_an_earlier_cut_gave_it():
    """Room-making's earlier cuts of one message (EvictionInput.prior): a sentence the question ranked first when it
    was the newest part, and ranks below a newer sentence now that the question moved away from it, keeps its
    place under prior "max" (the default) and loses it under prior "none"."""
    spans = [0] * 4 + [1] * 4 + [2] * 4
    mean = np.array([0.01] * 4 + [0.02] * 4 + [0.03] * 4)  # now: sentence 2 first, sentence 0 last
    prior = np.array([0.05] * 4 + [0.0] * 8)  # sentence 0 was first at an earlier cut; 1 and 2 were not there
    held = np.arange(12, dtype=np.int32)
    inp = EvictionInput(held=held, budget=4, window=held[:0], n_sink=0, probe=make_probe(held, mean[None, :]),
                        spans=np.asarray(spans), prior=prior)
    assert get_evictor("snapkv-spans").select(inp).tolist() == [0, 1, 2, 3]
    assert get_evictor("snapkv-spans", prior="none").select(inp).tolist() == [8, 9, 10, 11]
    assert get_evictor("snapkv-spans").select(spans_input(mean, spans, 4)).tolist() == [8, 9, 10, 11]  # no prior
    np.testing.assert_allclose(get_evictor("snapkv-spans").score(inp), np.maximum(mean, prior))


def test_snapkv_spans_options_and_its_signal():
    with pytest.raises(ValueError, match="agg must be one of sum, max, mean; got 'median'"):
        get_evictor("snapkv-spans", agg="median")
    with pytest.raises(ValueError, match="prior must be one of max, none; got 'min'"):
        get_evictor("snapkv-spans", prior="min")
    with pytest.raises(ValueError, match="prior must be scores aligned with held"):
        make_input(20, 10, prior=np.zeros(19))
    with pytest.raises(ValueError, match="spans must be integers aligned with held"):
        make_input(20, 10, spans=np.zeros(19, dtype=np.int64))


def test_unknown_evictor_lists_the_valid_names():
    valid = "h2o, knorm, lorekv, lorekv-answer, pyramidkv, random, snapkv, snapkv-spans, streamingllm, tova"
    with pytest.raises(ValueError, match=f"'snapkvv'.*{valid}"):
        get_evictor("snapkvv")


@pytest.mark.parametrize("budget, T, expected", [
    (0.5, 1000, 500), (1.0, 1000, 1000), (0.01, 1000, 40), (0.25, 100, 40), (np.float32(0.5), 200, 100),
    (36, 1000, 36), (500, 100, 500), (np.int64(64), 10, 64),
], ids=["half", "one", "floor-at-40", "small-T", "np-float", "exact-protected", "count-above-T", "np-int"])
def test_resolve_budget(budget, T, expected):
    assert resolve_budget(budget, T) == expected


@pytest.mark.parametrize("budget", [0.0, -0.5, 1.5, float("nan"), True, 0, -3, "0.5", None],
                         ids=["zero", "negative", "above-one", "nan", "bool", "int-zero", "int-negative",
                              "string", "none"])
def test_resolve_budget_rejects(budget):
    with pytest.raises(ValueError, match="budget"):
        resolve_budget(budget, 1000)


def test_resolve_budget_count_must_cover_the_protected_positions():
    with pytest.raises(ValueError, match="35 is smaller than the 36 protected"):
        resolve_budget(35, 1000)
    assert resolve_budget(6, 1000, window=2, n_sink=4) == 6


def test_input_validation():
    held = np.arange(20, dtype=np.int32)
    with pytest.raises(ValueError, match="ascending"):
        EvictionInput(held=held[::-1], budget=10, window=held[-2:])
    with pytest.raises(ValueError, match="not held"):
        EvictionInput(held=held, budget=10, window=np.array([99]))
    with pytest.raises(ValueError, match="budget"):
        EvictionInput(held=held, budget=0.5, window=held[-2:])
    inp = EvictionInput(held=held, budget=5, window=held[-4:])  # 4 sinks + 4 window > 5
    with pytest.raises(ValueError, match="protected"):
        get_evictor("streamingllm").select(inp)


def test_bad_signal_shapes_are_clear_errors():
    inp = make_input(64, 20, prefill_attention=np.zeros((2, 63)))
    with pytest.raises(ValueError, match="prefill_attention"):
        get_evictor("h2o").select(inp)
    inp = make_input(64, 20, key_norms=np.zeros((2, 64)))
    with pytest.raises(ValueError, match="key_norms"):
        get_evictor("knorm").select(inp)
