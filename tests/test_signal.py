"""Head-agreement drop D (PAGE, docs/algorithms.md §5.1) on hand-built top-k sets."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from page_local.signal import Signal, compute_signal, drop, drop_from_agreement, layer_agreement
from tests.factories import make_probe


def heads(*sets, k=None):
    """i32 (n_head, k) from position sets, right-padded with -1."""
    k = k or max(len(s) for s in sets)
    out = np.full((len(sets), k), -1, dtype=np.int32)
    for h, s in enumerate(sets):
        out[h, : len(s)] = sorted(s)
    return out


def reference_agreement(topk_pos):
    """PAGE's own definition with Python sets (gated_eviction.py: jaccard, head_agreement_layer)."""
    out = []
    for layer in topk_pos:
        sets = [{int(p) for p in row if p >= 0} for row in layer]
        js = [len(a & b) / len(a | b) if a | b else 0.0 for a, b in itertools.combinations(sets, 2)]
        out.append(sum(js) / len(js))
    return np.array(out)


def test_identical_heads_agree_fully():
    tp = np.stack([heads({1, 2, 3}, {1, 2, 3}, {3, 2, 1})])
    np.testing.assert_array_equal(layer_agreement(tp), [1.0])


def test_disjoint_heads_do_not_agree():
    tp = np.stack([heads({1, 2}, {3, 4}, {5, 6}, {7, 8})])
    np.testing.assert_array_equal(layer_agreement(tp), [0.0])


def test_three_layer_example_by_hand():
    tp = np.stack([
        heads({1, 2, 3}, {1, 2, 3}, {1, 2, 3}),  # alpha_0 = 1
        heads({1, 2, 3}, {2, 3, 4}, {5, 6, 7}),  # J = 2/4, 0, 0 -> 1/6
        heads({1, 2}, {3, 4}, {1, 3}, k=3),  # J = 0, 1/3, 1/3 -> 2/9 (third column is padding)
    ])
    sig = compute_signal(tp)
    np.testing.assert_allclose(sig.agreement, [1.0, 1 / 6, 2 / 9], rtol=0, atol=1e-12)
    assert sig.D == pytest.approx(1 - 2 / 9, abs=1e-12)  # third = max(1, 3 // 3) = 1
    assert drop(tp) == sig.D


def test_thirds_use_first_and_last_L_div_3_layers():
    # L = 7 -> third = 2: D = mean(alpha_0, alpha_1) - mean(alpha_5, alpha_6).
    same, apart = heads({1, 2}, {1, 2}), heads({1, 2}, {3, 4})
    half = heads({1, 2}, {1, 3})  # J = 1/3
    tp = np.stack([same, half, apart, apart, same, apart, half])
    assert drop(tp) == pytest.approx((1 + 1 / 3) / 2 - (0 + 1 / 3) / 2)


def test_single_layer_gives_zero_drop():
    assert drop(np.stack([heads({1, 2}, {2, 3})])) == 0.0


def test_padding_is_ignored_not_a_position():
    # With -1 treated as a position, both heads would share it and J would be 1/3 instead of 0.
    tp = np.stack([heads({1}, {2}, k=4)])
    assert layer_agreement(tp)[0] == 0.0
    tp = np.stack([heads({5, 6}, {5, 6, 7}, k=8)])
    assert layer_agreement(tp)[0] == pytest.approx(2 / 3)


def test_all_padding_pair_scores_zero_like_page():
    tp = np.stack([heads(set(), set(), {1}, k=2)])
    assert layer_agreement(tp)[0] == 0.0


def test_duplicate_positions_count_once():
    tp = np.array([[[4, 4, 5], [4, 5, -1]]], dtype=np.int32)
    assert layer_agreement(tp)[0] == 1.0


def test_accepts_a_probe_result():
    probe = make_probe(np.arange(50), n_layer=6, n_head=5, k=7)
    assert drop(probe) == drop(probe.topk_pos)
    assert isinstance(compute_signal(probe), Signal)


@pytest.mark.parametrize("shape", [(0, 3, 4), (3, 1, 4), (3, 3, 0), (3, 4), (2, 3, 4, 1)],
                         ids=["no-layers", "one-head", "k0", "2d", "4d"])
def test_bad_shapes_raise(shape):
    with pytest.raises(ValueError):
        layer_agreement(np.zeros(shape, dtype=np.int32))


def test_float_positions_raise():
    with pytest.raises(ValueError, match="integer"):
        layer_agreement(np.zeros((2, 3, 4), dtype=np.float32))


def test_drop_from_agreement_rejects_empty():
    with pytest.raises(ValueError):
        drop_from_agreement(np.array([]))


@settings(max_examples=200, deadline=None)
@given(hnp.arrays(np.int32, hnp.array_shapes(min_dims=3, max_dims=3, min_side=1, max_side=7)
                  .filter(lambda s: s[1] >= 2), elements=st.integers(-1, 20)))
def test_matches_python_set_reference(tp):
    np.testing.assert_allclose(layer_agreement(tp), reference_agreement(tp), rtol=0, atol=1e-12)
