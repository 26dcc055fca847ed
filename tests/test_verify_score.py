"""verify.verify_score on synthetic arrays: every monotone rule can only get stricter as the checked
span grows (adding tokens never turns a fail into a pass); the legacy mean can."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from page_local.verify import MONOTONE_RULES, RULES, VERIFY_CAP, VERIFY_RULE, verify_score

finite = st.floats(min_value=-30.0, max_value=0.0, allow_nan=False)


@st.composite
def spans(draw, min_size=0):
    """(lp_full, lp_evicted, changed) for one span of k positions."""
    k = draw(st.integers(min_size, 40))
    a = np.array(draw(st.lists(finite, min_size=k, max_size=k)))
    b = np.array(draw(st.lists(finite, min_size=k, max_size=k)))
    ch = np.array(draw(st.lists(st.booleans(), min_size=k, max_size=k)), dtype=bool)
    return a, b, ch


thresholds = st.floats(min_value=0.0, max_value=5.0, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(spans(), spans(), st.sampled_from(MONOTONE_RULES), thresholds)
def test_appending_tokens_never_turns_a_fail_into_a_pass(head, tail, rule, thr):
    a, b, ch = head
    a2, b2, ch2 = (np.concatenate(x) for x in zip(head, tail))
    short = verify_score(a, b, ch, rule=rule, threshold=thr)
    long = verify_score(a2, b2, ch2, rule=rule, threshold=thr)
    assert long.score >= short.score - 1e-9  # the score never falls as the span grows
    if not short.passed:
        assert not long.passed
    if long.passed:
        assert short.passed  # so every prefix of a passing span passes too


@settings(max_examples=200, deadline=None)
@given(spans(min_size=1), st.sampled_from(MONOTONE_RULES), thresholds)
def test_every_prefix_is_scored_at_most_the_whole_span(span, rule, thr):
    a, b, ch = span
    scores = [verify_score(a[:j], b[:j], ch[:j], rule=rule, threshold=thr).score for j in range(len(a) + 1)]
    assert all(y >= x - 1e-9 for x, y in zip(scores, scores[1:]))


def test_the_legacy_mean_dilutes_and_the_monotone_rules_do_not():
    # a digit that goes wrong (loss 0.6 nats) after 16 easy tokens, then 31 more easy tokens
    loss = np.r_[np.zeros(16), 0.6, np.zeros(31)]
    full, ev = np.zeros(48), -loss
    ch = loss > 0.5
    for rule in MONOTONE_RULES:
        thr = {"max": 0.5, "argmax": 0, "sum": 0.5}[rule]
        assert not verify_score(full[:17], ev[:17], ch[:17], rule=rule, threshold=thr).passed
        assert not verify_score(full, ev, ch, rule=rule, threshold=thr).passed
    assert not verify_score(full[:17], ev[:17], rule="mean", threshold=0.03).passed  # 0.035 > 0.03
    assert verify_score(full, ev, rule="mean", threshold=0.03).passed  # 0.0125: the longer span passes


def test_scores_and_fields_on_known_arrays():
    full = np.array([-0.1, -0.2, -0.05, -1.0])
    ev = np.array([-0.1, -0.9, -0.05, -0.5])  # losses 0, 0.7, 0, -0.5
    ch = np.array([False, True, False, False])
    v = verify_score(full, ev, ch, rule="max", threshold=0.5)
    assert v.score == pytest.approx(0.7) and not v.passed and v.n == 4 and v.changed == 1
    assert v.mean == pytest.approx(0.05) and v.max == pytest.approx(0.7)
    assert verify_score(full, ev, ch, rule="sum", threshold=1.0).score == pytest.approx(0.7)  # gains do not offset
    assert verify_score(full, ev, ch, rule="argmax", threshold=1).passed
    assert not verify_score(full, ev, ch, rule="argmax", threshold=0).passed
    assert verify_score(full, ev, ch, rule="mean", threshold=0.05).passed
    # a negative loss everywhere (the candidate is more confident) passes any rule at threshold 0
    for rule in MONOTONE_RULES:
        assert verify_score([-1.0, -2.0], [-0.5, -0.1], [False, False], rule=rule, threshold=0).passed
    assert "largest per-token loss 0.7000 > 0.5 nats" == v.describe()


def test_empty_span_passes_and_non_finite_losses_fail():
    for rule in RULES:
        assert verify_score([], [], [], rule=rule).passed
        v = verify_score([-0.1, -0.2], [-0.1, -math.inf], [False, False], rule=rule, threshold=1e9)
        assert not v.passed and v.score == math.inf
        assert not verify_score([-0.1, math.nan], [-0.1, -0.1], [False, False], rule=rule, threshold=1e9).passed


def test_defaults_and_bad_arguments():
    assert VERIFY_RULE in MONOTONE_RULES and 64 <= VERIFY_CAP <= 128
    v = verify_score([-0.1], [-0.2], [False])
    assert v.rule == VERIFY_RULE and v.threshold == RULES[VERIFY_RULE][1]
    with pytest.raises(ValueError, match="verify rule must be one of"):
        verify_score([0.0], [0.0], rule="median")
    with pytest.raises(ValueError, match="threshold"):
        verify_score([0.0], [0.0], [False], threshold=-1)
    with pytest.raises(ValueError, match="differ in length"):
        verify_score([0.0, 0.0], [0.0], [False])
    with pytest.raises(ValueError, match="needs `changed`"):
        verify_score([0.0], [0.0], rule="argmax")
